"""``isthmus site JOB.yaml --site NAME``: one site of a job, on a real cluster.

Every site of a job runs this command on its own machines, with the same job
file. The site's ranks form one torch.distributed job (torchrun); the sites
meet over the WAN through the addresses and the broker the job file names.

Two ways to start a site's ranks:

* under ``torchrun`` (``torchrun ... -m isthmus site JOB --site NAME``):
  every rank trains in its own process; the layout torchrun reports (world
  size, nodes, processes per node) must be the one the job file gives;
* on its own: it starts torchrun itself with the site's layout (``--standalone``
  on one node; c10d rendezvous at ``--rdzv-endpoint`` with several nodes, where
  the same command runs on every node), and a one-rank site trains in this
  process.

Each rank runs the user's command after ``--`` (``isthmus site JOB --site NAME
-- python train.py``), which learns its job, site and rank from the environment
(:mod:`isthmus.training.environment`), or without one the built-in loop.

Nothing assumes one machine: addresses come from the job file (never
loopback), each site writes only its own ``--out`` directory, and rounds, not
clocks, order what the sites do.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from isthmus.deploy.launch.host_tuning import tcp_advice

# The checks before start and the progress lines live apart (one topic each).
from isthmus.deploy.launch.site_checks import (
    check_can_listen,
    check_gpus,
    check_real_network,
    describe_ports,
    site_of,
)
from isthmus.deploy.launch.site_progress import SiteProgress, prints_progress, scheduler_node_index
from isthmus.deploy.usage import UsageError
from isthmus.job.exposure import insecure_warning
from isthmus.job.file import Job, SiteSpec, load_job, parse_address
from isthmus.job.ports import RDZV_PORT
from isthmus.training import log_format
from isthmus.training.log_format import say

SPAWNED_BY_SITE = "ISTHMUS_SITE_LAUNCHER"
"""Set for the ranks this command starts through torchrun: the launcher prints progress."""


def run_site(args: argparse.Namespace) -> int:
    """``isthmus site``: the parsed command line in, the exit status out."""
    log_format.use(args.log_format, args.site)  # first: every line after it in that format
    job = load_job(args.job, require_tls=True)
    index, spec = site_of(job, args.site)
    if args.print_ports:
        print(describe_ports(job, spec))
        return 0
    command = getattr(args, "command", None)
    if command is not None and not command:
        raise UsageError("--: name the command every rank runs after it, e.g. -- python train.py")
    check_real_network(job, spec)
    out = args.out or Path("runs") / f"{job.name}-{spec.name}"
    launcher = TorchrunLayout.from_environment()
    if args.resume is not None:
        out = _plan_resume(args, job, spec, launcher)
    elif not args.rejoin and (launcher is None or launcher.rank == 0):
        # A fresh start: what a stopped earlier run left at the broker is not this run's.
        from isthmus.deploy.launch.stale_run import forget_stale_run

        forget_stale_run(job, spec.name)
    if launcher is None or launcher.rank == 0:  # once per site, not once per rank
        warning = insecure_warning(job)
        for line in tcp_advice() + ([warning] if warning else []):
            say(line, "WARNING", prefix="warning: ")
    if launcher is not None:
        launcher.check(job, spec, index)
        check_can_listen(spec, index, ranks=[launcher.rank])
        if command is not None:
            return _exec_command(command, Path(args.job), job, spec, out, args.rejoin)
        return _train_rank(Path(args.job), job, spec, out, args.rejoin, launcher.rank)
    check_gpus(job, spec, index, spec.ranks_per_node)
    if spec.ranks == 1:
        check_can_listen(spec, index, ranks=[0])
        if command is not None:
            return run_one_rank(command, Path(args.job), job, spec, out, args.rejoin)
        return _train_rank(Path(args.job), job, spec, out, args.rejoin, 0)
    if spec.nodes == 1:
        check_can_listen(spec, index, ranks=range(spec.ranks))
    return run_torchrun(args, job, spec, out)


def _plan_resume(
    args: argparse.Namespace, job: Job, spec: SiteSpec, launcher: TorchrunLayout | None
) -> Path:
    """--resume: agree with the other sites how to start (the round, or rejoining the
    live ones); the ranks learn it from ISTHMUS_RESUME_ROUND, or --rejoin. Returns
    the run directory the site goes on in."""
    from isthmus.deploy.launch.site_resume import check_run_dir, describe, plan_resume
    from isthmus.training.environment import RESUME_ROUND

    if args.out is not None or args.rejoin:
        raise UsageError(
            "--resume: RUN_DIR is where the site goes on; give it without --out or --rejoin"
        )
    if launcher is not None:
        raise UsageError(
            "--resume: run isthmus site itself, not under your torchrun (it starts torchrun "
            "for the site's ranks): every rank would otherwise agree on its own"
        )
    node = _node_rank(args, spec)
    rounds = check_run_dir(args.resume, job, spec)
    plan = plan_resume(job, spec.name, rounds, node=node)
    if node == 0:  # once per site
        say(describe(plan, rounds), prefix=f"isthmus site {spec.name}: ")
    if plan.round is None:
        args.rejoin = True
    else:
        os.environ[RESUME_ROUND] = str(plan.round)  # torchrun passes it to the ranks
    return args.resume


def _node_rank(args: argparse.Namespace, spec: SiteSpec) -> int:
    """This node's index in its site, for the resume agreement: every node of a
    multi-node site answers for itself, since each sees the checkpoints only
    through its own mount of the run directory."""
    if spec.nodes == 1:
        return 0
    if args.node_rank is not None:
        node, source = args.node_rank, "--node-rank"
    else:
        scheduled = scheduler_node_index()
        if scheduled is None:
            raise UsageError(
                f"--node-rank: site {spec.name!r} has {spec.nodes} nodes; give each node's "
                f"index (0 to {spec.nodes - 1}) with --node-rank when it resumes (under "
                "Slurm or a Kubernetes indexed job it is found on its own)"
            )
        source, value = scheduled
        try:
            node = int(value)
        except ValueError:
            raise UsageError(f"{source}={value!r} is not a node index; give --node-rank") from None
    if not 0 <= node < spec.nodes:
        raise UsageError(
            f"{source}: {node} is not a node of site {spec.name!r}, which has {spec.nodes} "
            f"nodes (0 to {spec.nodes - 1})"
        )
    return node


def _resume_round() -> int | None:
    from isthmus.training.environment import RESUME_ROUND

    value = os.environ.get(RESUME_ROUND)
    return int(value) if value and value.isdigit() else None


@dataclass(frozen=True)
class TorchrunLayout:
    """What torchrun's environment says about this rank and its site."""

    rank: int
    world_size: int
    local_world_size: int

    @classmethod
    def from_environment(cls) -> TorchrunLayout | None:
        env = os.environ
        if "TORCHELASTIC_RUN_ID" not in env and "LOCAL_WORLD_SIZE" not in env:
            return None
        try:
            return cls(int(env["RANK"]), int(env["WORLD_SIZE"]), int(env["LOCAL_WORLD_SIZE"]))
        except (KeyError, ValueError):
            raise UsageError(
                "torchrun's environment is incomplete (RANK, WORLD_SIZE, LOCAL_WORLD_SIZE); "
                "start this command with torchrun, or without it"
            ) from None

    @property
    def nodes(self) -> int:
        return self.world_size // self.local_world_size

    def check(self, job: Job, spec: SiteSpec, index: int) -> None:
        if self.world_size != spec.ranks:
            raise UsageError(
                f"sites[{index}].ranks: the job file gives site {spec.name!r} {spec.ranks} "
                f"ranks, torchrun started {self.world_size} ({self.nodes} node(s) x "
                f"{self.local_world_size}); run torchrun with --nnodes {spec.nodes} "
                f"--nproc-per-node {spec.ranks_per_node}, or change ranks"
            )
        if self.nodes != spec.nodes:
            raise UsageError(
                f"sites[{index}].nodes: the job file gives site {spec.name!r} {spec.nodes} "
                f"node(s), torchrun reports {self.nodes} ({self.local_world_size} processes "
                f"per node); run torchrun with --nnodes {spec.nodes} --nproc-per-node "
                f"{spec.ranks_per_node}, or change nodes"
            )
        check_gpus(job, spec, index, self.local_world_size)


def prepare_site_dir(job_path: Path, job_name: str, site: str, out: Path, rejoin: bool) -> None:
    """The site's run directory, as ``isthmus run`` lays one out for each site:
    ``job.yaml`` resolved (every default filled in, no emulated WAN) and
    ``sites/SITE/``. Every rank may call it: the file is replaced atomically."""
    from isthmus.deploy.launch.run_dir import RunError, resolve_job

    if _resume_round() is not None and (out / "job.yaml").is_file():
        return  # a resumed site goes on with its run's own job file
    finished = out / "sites" / site / "result.json"
    if finished.exists() and not rejoin:
        raise UsageError(
            f"--out: {out} holds a finished run of site {site!r}; pass another --out, or remove it"
        )
    try:
        _, raw = resolve_job(job_path)
    except RunError as exc:
        raise UsageError(str(exc)) from None
    raw.pop("wan", None)  # the WAN is real: an emulator's links are not this site's concern
    _rebase_tls_paths(raw, job_path)
    try:
        (out / "sites" / site).mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UsageError(f"--out: cannot create {out}: {exc.strerror}") from None
    text = f"# isthmus site {job_name} --site {site}: resolved from {job_path}\n"
    text += yaml.safe_dump(raw, sort_keys=False)
    temporary = out / f".job.yaml.{os.getpid()}"
    temporary.write_text(text)
    temporary.replace(out / "job.yaml")


def _rebase_tls_paths(raw: dict[str, Any], job_path: Path) -> None:
    """Certificate paths are relative to the job file; the resolved copy lives in
    ``--out``, so make them absolute."""
    base = job_path.resolve().parent
    sections = [raw.get("tls"), (raw.get("control") or {}).get("tls")]
    for section in sections:
        if not isinstance(section, dict):
            continue
        for key in ("ca", "cert", "key", "crl"):
            value = section.get(key)
            if isinstance(value, str) and not Path(value).is_absolute():
                section[key] = str(base / value)


def _train_rank(
    job_path: Path, job: Job, spec: SiteSpec, out: Path, rejoin: bool, rank: int
) -> int:
    """Train this process's rank of the site (rank 0 also prints the site's progress,
    unless this command's own launcher does)."""
    from isthmus.training.site_errors import run_site_main
    from isthmus.training.worker import train_until_stopped

    if not os.environ.get(SPAWNED_BY_SITE):  # else the launcher prepared it
        prepare_site_dir(job_path, job.name, spec.name, out, rejoin)
    progress = None
    if rank == 0 and not os.environ.get(SPAWNED_BY_SITE):
        progress = SiteProgress(out, spec.name).start()
    try:
        # A peer, round or broker failure: one line naming it, not a traceback.
        code = run_site_main(
            lambda: train_until_stopped(
                out, spec.name, resume_round=_resume_round(), rejoin=rejoin
            ),
            "isthmus site",
            reach_hint=f"isthmus site {job_path} --site {spec.name} --print-ports",
        )
    finally:
        if progress is not None:
            progress.stop()
    return code


def launch_environment(out: Path, site: str, rejoin: bool) -> dict[str, str]:
    """The ``ISTHMUS_*`` variables of the site's ranks; paths absolute, for a script
    that changes its directory."""
    from isthmus.training.environment import LaunchEnvironment

    run_dir = out.resolve()
    return LaunchEnvironment(
        job=run_dir / "job.yaml",
        site=site,
        run_dir=run_dir,
        rejoin=rejoin,
        resume_round=_resume_round(),
    ).to_environ()


def _exec_command(
    command: list[str], job_path: Path, job: Job, spec: SiteSpec, out: Path, rejoin: bool
) -> int:
    """Under torchrun: this rank becomes the command, in torchrun's environment with
    the launcher's variables added."""
    prepare_site_dir(job_path, job.name, spec.name, out, rejoin)
    env = {**os.environ, **launch_environment(out, spec.name, rejoin)}
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execvpe(command[0], command, env)
    except OSError as exc:
        raise UsageError(f"-- CMD: cannot run {command[0]!r}: {exc.strerror}") from None


def run_one_rank(
    command: list[str], job_path: Path, job: Job, spec: SiteSpec, out: Path, rejoin: bool
) -> int:
    """A one-rank site without torchrun: the command as a child with torchrun's
    variables and the launcher's, the operator's signals passed on, the site's
    progress printed; returns the command's exit status (128 + N for signal N)."""
    from isthmus.intra.launch import free_port, rank_environment
    from isthmus.training.orphan import parent_environment

    prepare_site_dir(job_path, job.name, spec.name, out, rejoin)
    env = {**os.environ, **rank_environment(0, 1, free_port())}
    env |= {**launch_environment(out, spec.name, rejoin), **parent_environment()}
    try:
        # Its own session: a terminal's Ctrl-C reaches this process, which passes it on once.
        proc = subprocess.Popen(command, env=env, start_new_session=True)
    except OSError as exc:
        raise UsageError(f"-- CMD: cannot run {command[0]!r}: {exc.strerror}") from None
    forwarding = _pass_signals(proc)
    code = _wait_with_progress(proc, forwarding, out, spec.name)
    return code if code >= 0 else 128 - code


def _wait_with_progress(
    proc: subprocess.Popen,
    forwarding: dict[int, Any],
    out: Path,
    site: str,
    *,
    show_progress: bool = True,
) -> int:
    """Print the site's progress until ``proc`` ends (unless another node of the site
    prints it), then put the signal handlers that ``forwarding`` replaced back;
    returns its exit status."""
    progress = SiteProgress(out, site).start() if show_progress else None
    try:
        return proc.wait()
    finally:
        if progress is not None:
            progress.stop()
        for sig, previous in forwarding.items():
            signal.signal(sig, previous)


def _pass_signals(proc: subprocess.Popen) -> dict[int, Any]:
    """SIGINT, SIGTERM and SIGUSR1 (leave the run) go to the command as they came."""

    def forward(signum: int, frame: object) -> None:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signum)

    sigs = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)
    return {sig: signal.signal(sig, forward) for sig in sigs}


def run_torchrun(args: argparse.Namespace, job: Job, spec: SiteSpec, out: Path) -> int:
    """Start torchrun with the site's layout, print the site's progress, pass on
    the operator's signals, and return torchrun's exit status. Its ranks run the
    user's command (``--no-python``: torchrun runs it as it is) or this command."""
    # torchrun itself, less its traceback when a rank fails (the rank says why).
    command = [sys.executable, "-m", "isthmus.deploy.launch.torchrun"]
    command += torchrun_layout_flags(job, spec, args.rdzv_endpoint)
    user_command = getattr(args, "command", None)
    # torchrun sets 1 where it is unset, with a banner saying so: set it quietly.
    env = {"OMP_NUM_THREADS": "1", **os.environ, SPAWNED_BY_SITE: "1"}
    if user_command is not None:
        command += ["--no-python", *user_command]
        env |= launch_environment(out, spec.name, args.rejoin)  # torchrun passes it on
    else:
        command += ["--module", "isthmus", "site", str(args.job), "--site", spec.name]
        command += ["--out", str(out)]
        if args.rejoin:
            command.append("--rejoin")
    prepare_site_dir(Path(args.job), job.name, spec.name, out, args.rejoin)
    say(
        f"{spec.ranks} ranks on {spec.nodes} node(s) through torchrun",
        prefix=f"isthmus site {spec.name}: ",
    )
    proc = subprocess.Popen(command, env=env, start_new_session=True)
    forwarding = _forward_signals(proc)
    shown = prints_progress(spec, args.rdzv_endpoint)
    if not shown:
        say(
            "the site's progress is printed by its first node", prefix=f"isthmus site {spec.name}: "
        )
    return _wait_with_progress(proc, forwarding, out, spec.name, show_progress=shown)


def torchrun_layout_flags(job: Job, spec: SiteSpec, endpoint: str | None) -> list[str]:
    """torchrun's flags for the site's layout: one node standalone, several through
    the c10d rendezvous at ``endpoint`` (the same on every node)."""
    flags = ["--nnodes", str(spec.nodes), "--nproc-per-node", str(spec.ranks_per_node)]
    flags += ["--max-restarts", "0"]  # a lost site rejoins through the job, not torchrun
    if spec.nodes == 1:
        # One node needs no rendezvous across machines: --standalone picks a free port.
        # A given endpoint is not used: a fixed port may be held by another job on
        # the node, whose listener torchrun would then join and wait on.
        return [*flags, "--standalone"]
    if endpoint is None:
        if spec.nodes > 1:
            raise UsageError(
                f"--rdzv-endpoint: site {spec.name!r} has {spec.nodes} nodes; run this "
                f"command on each with the first node's address, e.g. --rdzv-endpoint "
                f"node0:{RDZV_PORT}"
            )
        return [*flags, "--standalone"]
    host_port = endpoint if ":" in endpoint else f"{endpoint}:{RDZV_PORT}"
    if isinstance(parse_address(host_port), str):
        raise UsageError(f"--rdzv-endpoint: give HOST:PORT, got {endpoint!r}")
    return [
        *flags,
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        host_port,
        "--rdzv-id",
        f"isthmus-{job.name}-{spec.name}",
    ]


def _forward_signals(proc: subprocess.Popen) -> dict[int, Any]:
    """SIGINT/SIGTERM stop torchrun (which stops the ranks); SIGUSR1 (leave the run)
    goes to the ranks themselves: torchrun would die of it."""

    def stop(signum: int, frame: object) -> None:
        proc.send_signal(signal.SIGTERM)

    def leave(signum: int, frame: object) -> None:
        for pid in _children(proc.pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGUSR1)

    handlers = {signal.SIGINT: stop, signal.SIGTERM: stop, signal.SIGUSR1: leave}
    return {sig: signal.signal(sig, handler) for sig, handler in handlers.items()}


def _children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (from /proc; empty where there is none)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # The command name (field 2) may hold spaces; the parent follows its ")".
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            found.append(int(entry.name))
    return found
