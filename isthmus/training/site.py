"""``isthmus.join()``: this rank's place in a job, and what a script trains through.

Under a launcher (``isthmus run JOB -- CMD``, ``isthmus site JOB --site NAME --
CMD``) ``isthmus.join()`` reads the job, site and run directory from the
environment (:mod:`isthmus.training.environment`) and brings up
everything the built-in loop has: the site's control-plane client
(membership, live settings, status), its records (``sites/SITE/metrics.jsonl``,
the progress table, ``summary.json``), signals (SIGUSR1: leave at the next
round; SIGTERM: stop cleanly), then the peer service. Called with a job file
and a site (``isthmus.join("job.yaml", site="a")``) it joins without a run
directory: the exchange and the strategies, no records and no control plane.
"""

from __future__ import annotations

import atexit
import logging
import os
import signal
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from isthmus.inter.allocator import keep_freed_memory
from isthmus.inter.codecs import parse_codec
from isthmus.inter.join import SiteRuntime, start_site
from isthmus.intra.devices import compute_device
from isthmus.intra.process_group import SiteError, launcher_rank
from isthmus.job.addressing import default_state_path, load_state, resolve
from isthmus.job.file import Job, load_job
from isthmus.job.layout import Layout
from isthmus.training.builtin_loop import TrainingRun
from isthmus.training.environment import LaunchEnvironment
from isthmus.training.orphan import end_with_parent
from isthmus.training.prometheus import MetricsEndpoint, metrics_port
from isthmus.training.records import RecordWriter, write_json_atomic
from isthmus.training.site_control import SiteControl, membership_for

log = logging.getLogger("isthmus.session")


class Site:
    """This rank of one site of a job, joined: what ``isthmus.join()`` returns.

    ``site.strategy(model, optimizer)`` runs the job's strategy over the script's
    model; ``site.steps()`` hands out the steps to train; ``site.log(...)``
    reports each. The explicit strategy classes (``isthmus.DiLoCo(site, ...)``)
    take it as well."""

    def __init__(
        self,
        job: Job,
        runtime: SiteRuntime,
        *,
        launch: LaunchEnvironment | None = None,
        control: SiteControl | None = None,
        records: RecordWriter | None = None,
    ) -> None:
        self.job = job
        self.runtime = runtime
        """The peer service, the hierarchical step and the membership (the layer below)."""
        self.launch = launch
        """What the launcher said (None: joined by job file and site, no run directory)."""
        self.run_dir = launch.run_dir if launch is not None else None
        self.control = control or _NoControl()
        self.records = records or RecordWriter(Path(os.devnull), runtime.name, enabled=False)
        self.checkpoints = (
            self.run_dir / "checkpoints" / runtime.name if self.run_dir is not None else None
        )
        self.leave_requested = False
        """Set by SIGUSR1 (an operator asks this site to leave at the next round)."""
        self.stopped = False
        """SIGTERM came (the launcher stops the run): closing waits for no peer."""
        self.run: TrainingRun | None = None
        self.described: dict[str, Any] = {}
        """What :meth:`describe` said of the training (the run's records carry it)."""
        self.builtin_loop = False
        """Set by the built-in loop (``isthmus run JOB``): it applies the job's optimizer,
        schedule and batch settings (and ``inner_lr`` changed live); a script its own."""
        self.metrics: MetricsEndpoint | None = None
        """This rank's ``/metrics`` (a job with ``metrics:``, launched)."""
        self._done = False
        self._closed = False

    # -- who and where -------------------------------------------------------------------
    @property
    def name(self) -> str:
        return self.runtime.name

    @property
    def names(self) -> list[str]:
        """Every site of the job, in the job file's order."""
        return self.runtime.names

    @property
    def site_index(self) -> int:
        return self.runtime.site_index

    @property
    def rank(self) -> int:
        """This process's rank within its site."""
        return self.runtime.rank

    @property
    def dp_rank(self) -> int:
        """This rank's data-parallel index within its site (which share of the data)."""
        return self.runtime.dp_rank

    @property
    def layout(self) -> Layout:
        return self.runtime.layout

    @property
    def device(self) -> torch.device:
        """Where this rank computes (``train.device``): its GPU, ``cuda:LOCAL_RANK``,
        or the CPU. Put the model and batches there."""
        return self.runtime.device

    @property
    def refusals(self) -> dict[str, int]:
        """What this rank's peer service refused so far, by kind (``WRONG_JOB``,
        ``STALE_ROUND``, ``TOO_MANY_STREAMS``, ``REVOKED``...): for security audits."""
        return dict(self.runtime.endpoint.server.servicer.refusals)

    # -- training ------------------------------------------------------------------------
    def strategy(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        tokens_per_step: int | None = None,
        stage_group: Any = None,
    ) -> TrainingRun:
        """The job's ``train.strategy``, with its settings, over ``model`` (plain,
        DDP-wrapped or sharded) and its inner ``optimizer``; use it as a ``with``
        block. ``tokens_per_step``: tokens one rank trains on per step, which weighs
        the sites in each average (default: ``train.batch_size``: sites
        weighed by samples; only the ratio between sites matters)."""
        if self.run is not None and self.run.strategy is not None and not self._done:
            raise RuntimeError("site.strategy(): this site already trains (one block per run)")
        self.run = TrainingRun(
            self, model, optimizer, tokens_per_step=tokens_per_step, stage_group=stage_group
        )
        return self.run

    def steps(self) -> Iterator[int]:
        """The steps to train (see :meth:`TrainingRun.steps`)."""
        if self.run is None:
            raise RuntimeError("site.steps() runs inside `with site.strategy(model, optimizer):`")
        return self.run.steps()

    def describe(self, **fields: Any) -> None:
        """Say what this site trains, for the run's records (``summary.json``,
        ``report.md``, ``compare.md``, TensorBoard): ``model`` (a name; default: the
        model's class), ``data``, and any other field (a string, a number, a bool).
        Isthmus records the strategy's settings itself, and of the script's own
        only the optimizer's class and settings, the parameter count and the
        tokens: the rest is what the script says here. Call it before or inside
        the ``with site.strategy(...)`` block; later calls add to earlier ones."""
        from isthmus.training.description import plain_value

        checked = {name: plain_value(name, value) for name, value in fields.items()}
        self.described.update(checked)
        if self.run is not None and self.run.strategy is not None:
            self.records.write("described", fields=checked)

    def log(self, **metrics: Any) -> None:
        """Report the step under way (``loss``, ``tokens``, ``eval_loss``, any other
        number); after the block, ``eval_loss`` reports the final model's."""
        if self.run is not None and not self._done:
            self.run.log(**metrics)
            return
        if self.run is None:
            raise RuntimeError("site.log() runs inside `with site.strategy(model, optimizer):`")
        if "eval_loss" in metrics:
            self._final_eval(float(metrics["eval_loss"]))

    def run_ended(self, run: TrainingRun, totals: dict[str, Any]) -> None:
        """(Called by the run's block on a clean exit.) Write the site's result."""
        self._done = True
        if self.rank != 0:
            return
        run.result = run.result_fields(totals)
        if self.run_dir is not None and self.site_index == 0 and not run.left:
            self._save_model(run)
        self._write_result(run.result)

    def _save_model(self, run: TrainingRun) -> None:
        """``RUN_DIR/model.safetensors``: the final model every site holds (sharded
        tensors gathered, pipeline stages merged), written by the job's first site."""
        from isthmus.training.description import save_model_file

        assert run.final_state is not None and self.run_dir is not None
        model = self.described.get("model") or type(run.model).__name__
        metadata = {
            "job": self.job.name,
            "model": str(model),
            "loop": "built-in" if self.builtin_loop else "script",
            "param_sha256": run.result["param_sha256"] if run.result else "",
            "consolidated": "sharded tensors gathered, pipeline stages merged",
        }
        save_model_file(
            run.final_state,
            self.run_dir / "model.safetensors",
            metadata,
            mode_of=self.run_dir / "job.yaml",
        )

    def _final_eval(self, eval_loss: float) -> None:
        run = self.run
        assert run is not None
        self.records.write(
            "eval", step=run.step + 1, tokens=run.tokens, eval_loss=eval_loss, final=True
        )
        if self.rank == 0 and run.result is not None:
            run.result["eval_loss"] = eval_loss
            self._write_result(run.result, announce=False)

    def _write_result(self, result: dict[str, Any], *, announce: bool = True) -> None:
        if self.run_dir is None:
            return
        write_json_atomic(self.run_dir / "sites" / self.name / "result.json", result)
        if announce:
            self.records.write("state", state=result["status"])

    # -- the end -------------------------------------------------------------------------
    def close(self) -> None:
        """Leave the control plane (as done, when the run ended or this site left) and
        stop the peer service. Runs at exit by itself."""
        if self._closed:
            return
        self._closed = True
        try:
            if self.metrics is not None:
                final = None
                if self.run_dir is not None:
                    final = self.run_dir / "sites" / self.name / f"metrics-rank-{self.rank}.prom"
                self.metrics.close(final)
            self.control.close(done=self._done)
        finally:
            self.records.close()
            # Stopped (SIGTERM: the launcher stops every site): no peer will wait for
            # this site's last acknowledgements, so do not wait for them either.
            self.runtime.close(flush_s=0.0 if self.stopped else None)

    def __enter__(self) -> Site:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _NoControl:
    """No control plane (joined without a launcher): nothing to report to."""

    def step(self, step: int, outer_round: int) -> None:
        pass

    def round_ended(self, outer_round: int, step: int, **metrics: Any) -> dict[str, Any]:
        return {}

    def close(self, done: bool) -> None:
        pass


class Stopped(SystemExit):
    """SIGTERM from the launcher: leave through the ``finally`` blocks (143)."""


def join(
    job: str | Path | Job | None = None,
    site: str | None = None,
    *,
    state: str | Path | None = None,
    codec: str = "none",
    deadline_s: float | None = None,
) -> Site:
    """Join this rank's site of a job.

    ``isthmus.join()``: the job, site and run directory from the launcher that
    started this process (``isthmus run JOB -- CMD``, ``isthmus site JOB --site
    NAME -- CMD``). ``isthmus.join(job, site=NAME)``: a job file (or a loaded
    job) and a site, without a launcher's run directory.

    Addresses: the emulator's state file (``state``, or the launcher's); else,
    when the job has a ``wan:`` section and ``<job name>.wan.json`` (what ``isthmus
    wan up`` writes) exists, that; else the sites' own ``address`` fields. Under
    torchrun, every rank of the site calls it."""
    launch = None
    if job is None:
        launch = LaunchEnvironment.from_environ()
        if site is not None and site != launch.site:
            raise SiteError(
                f"isthmus.join(site={site!r}): the launcher started this process as site "
                f"{launch.site!r}; leave site out"
            )
        job, site = launch.job, launch.site
        if state is None:
            state = launch.wan_state
    elif site is None:
        raise SiteError("isthmus.join(job, site=NAME): name the site this process is a rank of")
    job = job if isinstance(job, Job) else load_job(job)
    if state is None and job.wan is not None and default_state_path(job).exists():
        state = default_state_path(job)
    loaded_state = load_state(state) if state is not None else None
    if launch is None or launch.run_dir is None:
        device = compute_device(job.train.device)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        runtime = start_site(
            job,
            site,
            state=loaded_state,
            codec=parse_codec(codec),
            deadline_s=deadline_s or job.train.round_deadline_s,
            backend="nccl" if device.type == "cuda" else "gloo",
        )
        return Site(job, runtime, launch=launch)
    return _join_run(job, site, launch, launch.run_dir, loaded_state, codec, deadline_s)


def _join_run(
    job: Job,
    site_name: str,
    launch: LaunchEnvironment,
    run_dir: Path,
    state: dict | None,
    codec: str,
    deadline_s: float | None,
) -> Site:
    """Join as a launched rank: records, control plane and membership first, then
    the peer service."""
    end_with_parent()  # stop with the launcher
    keep_freed_memory()  # chunk buffers are reused, not faulted in anew (see allocator)
    settings = job.train
    membership = membership_for(job, run_dir, site_name, rejoining=launch.rejoin)
    if launch.rejoin and membership is None:
        raise SiteError(
            "rejoining needs a run that can lose and regain sites: at least 2 sites and a "
            "control plane"
        )
    spec = job.site(site_name)
    rank, _ = launcher_rank()
    device = compute_device(settings.device)  # refused here, before the others wait on it
    if device.type == "cuda":
        # One GPU per rank, chosen before NCCL binds its communicator to one.
        torch.cuda.set_device(device)
    where = metrics_port(job, rank)  # a port in use is refused before anyone waits on it
    metrics = MetricsEndpoint(site_name, rank, *where) if where is not None else None
    records = RecordWriter(run_dir / "sites" / site_name / "metrics.jsonl", site_name, rank == 0)
    records.write("joined", rank=rank, ranks=spec.ranks, pid=os.getpid())
    # The broker first: a site that cannot reach it stops at once, before its peers
    # wait on it (the address in its status is the one the others dial: on a real
    # network the advertised one, not 0.0.0.0).
    dialled = None if state is not None else spec.dial_addresses()
    host, port = (dialled or resolve(job, site_name, state).listen)[0]
    control = SiteControl(job, run_dir, site_name, rank, spec.ranks, f"{host}:{port}", membership)
    try:
        runtime = start_site(
            job,
            site_name,
            state=state,
            codec=parse_codec(codec),
            rejoining=launch.rejoin,
            deadline_s=deadline_s or settings.round_deadline_s,
            collective_timeout_s=settings.collective_timeout_s,
            site_wait_s=settings.site_wait_s,
            backend="nccl" if device.type == "cuda" else "gloo",
        )
    except BaseException:
        control.close(done=False)
        records.close()
        if metrics is not None:
            metrics.close(None)
        raise
    runtime.membership = membership
    joined = Site(job, runtime, launch=launch, control=control, records=records)
    if metrics is not None:
        metrics.attach(joined)
        joined.metrics = metrics
    _install_signals(joined)
    atexit.register(joined.close)
    return joined


def _install_signals(site: Site) -> None:
    """SIGUSR1: leave the run at the next round (the loop acts on it: a signal
    handler must not take the membership's lock); SIGTERM: end cleanly (143)."""
    if threading.current_thread() is not threading.main_thread():
        return

    def leave(signum: int, frame: object) -> None:
        site.leave_requested = True

    def stop(signum: int, frame: object) -> None:
        site.stopped = True
        raise Stopped(143)

    signal.signal(signal.SIGUSR1, leave)
    signal.signal(signal.SIGTERM, stop)
