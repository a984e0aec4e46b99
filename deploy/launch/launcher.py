"""``isthmus run``: every site of a job on this machine, through the emulated WAN.

The launcher prepares the run directory, starts the emulator (``isthmus wan
up``, its own process) when the job has a ``wan:`` section, starts each
site's ranks as torchrun would (each rank its own process group, so a Ctrl-C
reaches the launcher alone and the launcher stops them in order), follows
what the sites write, and ends with ``summary.json`` and the report. It is the
only writer of the run's ``metrics.jsonl``; sites write their own files.

Each rank runs the user's command (``isthmus run JOB -- CMD``) or the built-in
training loop (:func:`builtin_command`). A site whose command
never calls ``isthmus.join()`` (within ``join_timeout_s``, or before its
processes exit) has failed: nothing else would tell the operator why it never
trains.

Ending: when every site has finished or left; or at SIGINT/SIGTERM. A site
that is lost (a rank killed) or fails does not end a run of two or more sites:
every strategy runs its rounds under membership views, so the others train on
without it (and with ``--restart-lost`` it is started again and rejoins); a
one-site run ends with its site. Either way every child process is stopped
(SIGTERM, then SIGKILL after a grace period) before the launcher returns.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import yaml

from isthmus.deploy.launch import warm_start
from isthmus.deploy.launch.run_dir import RunError
from isthmus.deploy.launch.run_state import RunState, SiteState, apply_record
from isthmus.deploy.launch.site_processes import (
    exit_reason,
    launch,
    log_tail,
    site_environment,
    terminate,
)
from isthmus.deploy.launch.stale_run import forget_stale_run
from isthmus.deploy.launch.warm_start import ForkedRank, RankTemplate, TemplateError
from isthmus.job.addressing import load_state
from isthmus.job.basics import to_json
from isthmus.job.file import Job
from isthmus.job.ports import free_ports
from isthmus.training.environment import METRICS_PORTS, RUN_OVER_STATUS
from isthmus.training.orphan import parent_environment
from isthmus.training.records import RecordTail, write_json_atomic

log = logging.getLogger(__name__)

EMULATOR_START_S = 60.0
POLL_S = 0.25
RESTART_AFTER_S = 2.0
"""With ``restart_lost``: how long after a site's loss it is started again."""
MAX_RESTARTS = 3
"""Restarts in a row of a site that never completed a round in between: one that
keeps dying before it trains (a crash loop) is not restarted forever, while one
that trains between losses (churn) is restarted every time."""
JOIN_TIMEOUT_S = 300.0
"""How long a site's processes may run before its rank 0 has called
``isthmus.join()`` (``isthmus run --join-timeout``): a script that never joins
would otherwise hold the run forever with nothing to show."""


class Launcher:
    """Starts, follows and stops the processes of one run."""

    def __init__(
        self,
        job: Job,
        raw: dict[str, Any],
        run_dir: Path,
        *,
        on_update: Callable[[RunState], None] | None = None,
        resume_round: int | None = None,
        restart_lost: bool = False,
        command: list[str] | None = None,
        join_timeout_s: float = JOIN_TIMEOUT_S,
        template: RankTemplate | None = None,
    ) -> None:
        """``restart_lost``: start a lost site again (as its operator would) so it
        rejoins; needs a run that survives the loss of a site. ``command``: what
        every rank runs (None: the built-in loop). ``join_timeout_s``: how long a
        site may run without calling ``isthmus.join()`` before it has failed.
        ``template``: a warm template that outlives this run (several runs in a
        row, :func:`~isthmus.deploy.launch.warm_start.template_for_runs`); without
        one the run starts its own."""
        if join_timeout_s <= 0:
            raise RunError(f"--join-timeout: must be > 0 seconds, got {join_timeout_s:g}")
        if command is not None and not command:
            raise RunError("-- CMD: name the command every rank runs after --")
        self.job = job
        self.survives_loss = job.survives_site_loss
        if restart_lost and not self.survives_loss:
            raise RunError(
                "--restart-lost: only a run of at least 2 sites can lose a site and take it back"
            )
        self.restart_lost = restart_lost
        self.resume_round = resume_round
        self.command = command
        self.join_timeout_s = join_timeout_s
        self.raw = raw
        self.run_dir = run_dir
        self.on_update = on_update
        self.state = RunState(
            job=job,
            run_dir=run_dir,
            started=time.time(),
            sites={s.name: SiteState(s.name, s.ranks) for s in job.sites},
            command=command,
        )
        self.emulator: subprocess.Popen | None = None
        self.emulator_control: Any = None
        self.broker: Any = None
        self._control_state: Path | None = None
        # A resumed run follows only what its sites write from now on.
        self._tails = {
            s.name: RecordTail(
                run_dir / "sites" / s.name / "metrics.jsonl", from_end=resume_round is not None
            )
            for s in job.sites
        }
        self._metrics: IO[str] | None = None
        self._files: list[IO[Any]] = []
        self._stop_signal: int | None = None
        self._last_link_poll = 0.0
        self._link_bytes: dict[str, tuple[float, float]] = {}
        self.tensorboard: Any = None
        self.template: RankTemplate | None = None
        """Forks the built-in loop's ranks (:mod:`isthmus.deploy.launch.warm_start`)."""
        self._given_template = template
        """Not this run's to close."""
        self._template_failed = False
        """The template refused a fork: new ranks start fresh (it still runs its own)."""
        self.tuner: Any = None
        self._pids: dict[str, list[int]] = {}
        # Faults that start or end at a round wait on the rounds the launcher reports.
        self._reports_progress = job.wan is not None and any(
            f.at_round is not None or f.for_rounds is not None for f in job.wan.faults
        )
        self._reported: dict[str, int] = {}
        self.metrics_ports: dict[str, list[int]] = {}
        """Each site's ranks' ``/metrics`` ports (a job with ``metrics:``)."""

    # -- start ---------------------------------------------------------------------
    def start(self) -> None:
        run_dir = self.run_dir
        (run_dir / "job.yaml").write_text(
            "# As resolved by isthmus run: every default filled in, overrides applied.\n"
            + yaml.safe_dump(self.raw, sort_keys=False)
        )
        self._metrics = (run_dir / "metrics.jsonl").open("a", encoding="utf-8")
        if self.command is None and warm_start.enabled():
            # Its imports run while the broker and the emulator start.
            self.template = self._given_template or RankTemplate(
                run_dir, run_dir / "logs" / "template.log"
            )
        if self.job.metrics is not None:
            self._choose_metrics_ports()
        if self.job.control is None:
            self._start_broker()
        else:
            # A broker of the user's own may hold an earlier run's view and statuses.
            forget_stale_run(self.job, None)
        if self.job.wan is not None:
            self._start_emulator()
        if self.job.tune.online:
            self._start_tuner()
        for site in self.job.sites:
            self._start_site(site.name)

    def _choose_metrics_ports(self) -> None:
        """A free loopback port for every rank's ``/metrics`` (on one machine the job's
        ``prometheus_port`` + local rank would collide across sites), listed in
        ``endpoints.json`` as ``{SITE: {RANK: URL}}`` for a Prometheus to scrape."""
        # Not a port a site's peer service will listen on (picked free, not yet bound).
        taken = {port for s in self.job.sites for _, port in s.listen_addresses() or []}
        for site in self.job.sites:
            ports = free_ports("127.0.0.1", site.ranks)
            while taken & set(ports):
                ports = free_ports("127.0.0.1", site.ranks)
            taken |= set(ports)
            self.metrics_ports[site.name] = ports
        write_json_atomic(
            self.run_dir / "endpoints.json",
            {
                name: {str(r): f"http://127.0.0.1:{port}/metrics" for r, port in enumerate(ports)}
                for name, ports in self.metrics_ports.items()
            },
        )

    def _start_site(self, name: str, *, rejoin: bool = False) -> None:
        run_dir = self.run_dir
        site = self.job.site(name)
        total_ranks = sum(s.ranks for s in self.job.sites)
        threads = max(1, (os.cpu_count() or 1) // total_ranks)
        env = {"OMP_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1"}
        state = self.state.sites[name]
        logs = [run_dir / "logs" / f"{name}-r{r}.log" for r in range(site.ranks)]
        how = {"rejoin": rejoin, "resume_round": self.resume_round}
        command = self.command or builtin_command()
        env |= site_environment(run_dir, name, **how)
        if name in self.metrics_ports:  # the same ports when the site is restarted
            env[METRICS_PORTS] = ",".join(str(p) for p in self.metrics_ports[name])
        state.procs = self._launch(command, site.ranks, env, logs)
        state.logs = logs
        state.started = time.time()
        state.launched_at = time.monotonic()
        state.joined = False
        self._pids[name] = [p.pid for p in state.procs]
        write_json_atomic(run_dir / "pids.json", self._pids)

    def _launch(
        self, command: list[str], ranks: int, env: dict[str, str], logs: list[Path]
    ) -> list[subprocess.Popen | ForkedRank]:
        """The ranks of one site: forked from the warm template when they run the
        built-in loop and it is up, else fresh processes."""
        if self.template is not None and not self._template_failed:
            try:
                return launch(command, ranks, env, logs, self.template)
            except TemplateError as exc:
                # It may still run other sites' ranks: it is closed at the end (stop),
                # only no new rank comes from it.
                log.warning("%s; starting ranks as fresh processes from now on", exc)
                self._template_failed = True
        return launch(command, ranks, env, logs)

    def _start_broker(self) -> None:
        """The control plane's embedded broker; its address goes where the sites
        (RUN_DIR/control.json) and ``isthmus config set|watch`` (./JOB.control.json)
        look for it."""
        from isthmus.deploy.launch.broker import (
            BrokerStartError,
            EmbeddedBroker,
            control_state_path,
        )

        try:
            self.broker = EmbeddedBroker().start()
        except BrokerStartError as exc:
            raise RunError(str(exc)) from None
        state = {"broker": self.broker.address.url, "run_dir": str(self.run_dir.resolve())}
        write_json_atomic(self.run_dir / "control.json", state)
        self._control_state = control_state_path(self.job)
        write_json_atomic(self._control_state, state)

    def _start_tuner(self) -> None:
        """The online H controller, a client of the run's broker like any site."""
        from isthmus.deploy.launch.online_tuner import OnlineTuner
        from isthmus.inter.control_plane import Broker

        if self.job.control is not None:
            broker, wait_s = self.job.control.broker_for(None), self.job.control.wait_s
        else:
            broker, wait_s = Broker.from_url(self.broker.address.url), 10.0
        try:
            self.tuner = OnlineTuner(broker, self.job).start(wait_s)
        except ConnectionError as exc:
            raise RunError(f"tune.online: {exc}") from None

    def _poll_tuner(self) -> None:
        if self.tuner is None:
            return
        decision = self.tuner.poll()
        if decision is None:
            return
        change = decision.to_dict()
        self.state.sync_every_changes.append(change)
        assert self._metrics is not None
        self._metrics.write(to_json({**change, "site": None, "kind": "tune"}) + "\n")

    def _start_emulator(self) -> None:
        log = (self.run_dir / "logs" / "wan.log").open("ab")
        self._files.append(log)
        state_path = self.run_dir / "wan.json"
        command = [sys.executable, "-m", "isthmus", "wan", "up", str(self.run_dir / "job.yaml")]
        self.emulator = subprocess.Popen(
            [*command, "--state", str(state_path)],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, **parent_environment()},
        )
        deadline = time.monotonic() + EMULATOR_START_S
        while not state_path.exists():
            if self.emulator.poll() is not None:
                raise RunError(
                    "the WAN emulator did not start: "
                    + (log_tail(self.run_dir / "logs" / "wan.log") or "(empty log)")
                )
            if time.monotonic() > deadline:
                raise RunError(f"the WAN emulator did not start in {EMULATOR_START_S:.0f} s")
            time.sleep(0.05)
        from isthmus.sim.emulator_control import ControlClient

        host, port = str(load_state(state_path)["control"]).rsplit(":", 1)
        self.emulator_control = ControlClient((host, int(port)), timeout_s=5)

    # -- follow --------------------------------------------------------------------
    def follow(self) -> str:
        """Follow the run until it ends; returns ``finished``, ``failed`` or
        ``interrupted``."""
        previous = {
            sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGINT, signal.SIGTERM)
        }
        try:
            while True:
                self._read_records()
                self._report_progress()
                self._poll_links()
                self._poll_tuner()
                if self._stop_signal is not None:
                    outcome = "interrupted"
                    break
                outcome = self._check_processes()
                if self.on_update is not None:
                    self.on_update(self.state)
                if outcome:
                    break
                time.sleep(POLL_S)
        finally:
            self.stop()
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        self.state.status = outcome
        if self.on_update is not None:
            self.on_update(self.state)
        return outcome

    def _on_signal(self, signum: int, frame: object) -> None:
        self._stop_signal = signum

    def _check_processes(self) -> str:
        running = False
        for site in self.state.sites.values():
            if site.restart_at is not None:
                running = True
                if time.monotonic() >= site.restart_at:
                    site.restart_at = None
                    over = self._run_over_for(site, False)
                    if over:  # the others ended while it waited to be started again
                        site.reason += f"; not restarted: {over}"
                        continue
                    site.restarts += 1
                    site.restarts_in_a_row += 1
                    site.status, site.reason = "rejoining", ""
                    self._start_site(site.name, rejoin=True)
                continue
            if site.status in ("failed", "lost"):
                continue
            # A site says "finished" before its processes exit; the exit codes decide.
            codes = [p.poll() for p in site.procs]
            bad = [(rank, c) for rank, c in enumerate(codes) if c is not None and c != 0]
            if bad:
                # A rank killed by a signal is the cause where others failed beside it
                # (they lost their peer): it names the site's end, else the first rank.
                rank, code = min(bad, key=lambda rank_code: (rank_code[1] > 0, rank_code[0]))
                # The run was over for it: its exit status says so, and its last record
                # (a script may exit with the same status for reasons of its own).
                self._read_records()
                run_over = code == RUN_OVER_STATUS and site.status == "run_over"
                site.status = "lost" if code < 0 or run_over else "failed"
                site.reason = exit_reason(rank, code, site.logs[rank])
                site.ended = time.time()
                if code < 0 and self._has_finished(site):
                    # Killed once its result was written: it holds the final model.
                    site.status = "finished"
                    site.reason += " after it had written its result"
                    terminate(site.procs)
                    continue
                if not self.survives_loss:
                    return "failed"
                # The other sites train on without it (the membership protocol).
                terminate(site.procs)
                if self.restart_lost and site.restarts_in_a_row < MAX_RESTARTS:
                    over = self._run_over_for(site, run_over)
                    if over:
                        site.reason += f"; not restarted: {over}"
                    else:
                        site.restart_at = time.monotonic() + RESTART_AFTER_S
                        running = True
                continue
            if not self._check_joined(site, exited=all(c == 0 for c in codes)):
                if not self.survives_loss:
                    return "failed"
                # Not restarted: a script that does not join will not join next time.
                terminate(site.procs)
                continue
            if all(c == 0 for c in codes):
                site.status = "left" if site.status in ("left", "leaving") else "finished"
                site.ended = time.time()
            elif site.restarts_in_a_row and self.state.others_ended(site):
                # Started again, it has not trained since, and every other site has
                # ended: no one is left to let it in or give it the state. (A broker
                # may keep a finished site's Last Will as its retained status, so the
                # site itself may take them for lost ones that could come back.)
                terminate(site.procs)
                site.status, site.ended = "lost", time.time()
                site.reason = (
                    "started again, it was still coming back when every other site had "
                    "ended; stopped (the run is over)"
                )
            else:
                running = True
        if running:
            return ""
        # A site lost (killed) and not back is what the membership lets the others
        # survive; one that ended with an error (below the quorum, let back in too
        # late) ends with a model of its own, and the run must not say it finished.
        statuses = [s.status for s in self.state.sites.values()]
        finished = "finished" in statuses and "failed" not in statuses
        return "finished" if finished else "failed"

    def _has_finished(self, site: SiteState) -> bool:
        """Whether the site's result says it finished (written after its final
        synchronisation, with its model's digest)."""
        path = self.run_dir / "sites" / site.name / "result.json"
        try:
            return json.loads(path.read_text()).get("status") == "finished"
        except (OSError, ValueError):
            return False

    def _run_over_for(self, site: SiteState, run_over: bool) -> str:
        """Why a lost site is not started again (empty: it is); its last records first."""
        self._read_records()
        return self.state.run_over_for(site, run_over=run_over)

    def _check_joined(self, site: SiteState, *, exited: bool) -> bool:
        """Whether the site has joined or may still; else it has failed, with why."""
        if site.joined:
            return True
        if exited:  # it may have written its records just before it exited
            self._read_records()
            if site.joined:
                return True
        elif time.monotonic() - site.launched_at < self.join_timeout_s:
            return True
        log = site.logs[0] if site.logs else self.run_dir / "logs"
        what = (
            "exited without calling isthmus.join()"
            if exited
            else f"never called isthmus.join() in {self.join_timeout_s:g} s"
        )
        site.status = "failed"
        site.reason = (
            f"the command {what} (rank 0 log: {log}); call isthmus.join() at the start of "
            "the script, before the model is built"
            + ("" if exited else ", or raise --join-timeout")
        )
        return False

    def _read_records(self) -> None:
        assert self._metrics is not None
        for name, tail in self._tails.items():
            site = self.state.sites[name]
            for record in tail.read():
                self._metrics.write(to_json(record) + "\n")
                apply_record(site, record)
                if self.tensorboard is not None:
                    self.tensorboard.add(record)
        self._metrics.flush()

    def _report_progress(self) -> None:
        """Tell the emulator the rounds each site has completed, when they change."""
        if not self._reports_progress or self.emulator_control is None:
            return
        rounds = {name: site.outer_steps for name, site in self.state.sites.items()}
        if rounds == self._reported:
            return
        from isthmus.sim.emulator_control import ControlError

        try:
            self.emulator_control.progress(rounds)
        except ControlError:  # the emulator is gone; the process check reports it
            return
        self._reported = rounds

    def _poll_links(self) -> None:
        if self.emulator_control is None or time.monotonic() - self._last_link_poll < 1.0:
            return
        self._last_link_poll = now = time.monotonic()
        try:
            stats = self.emulator_control.stats()
        except Exception:  # the emulator is gone; the process check reports it
            return
        record = {"t": time.time(), "site": None, "kind": "link", "links": {}}
        for link in stats.get("links", []):
            a, b = link["between"]
            wire = int(link[f"{a}->{b}"]["bytes"] + link[f"{b}->{a}"]["bytes"])
            key = f"{a}<->{b}"
            before_t, before = self._link_bytes.get(key, (now, wire))
            rate = (wire - before) * 8 / 1e6 / (now - before_t) if now > before_t else 0.0
            self._link_bytes[key] = (now, wire)
            self.state.links[key] = {"bytes": wire, "mbit_s": rate}
            record["links"][key] = wire
        assert self._metrics is not None
        self._metrics.write(to_json(record) + "\n")

    # -- stop ----------------------------------------------------------------------
    def stop(self) -> None:
        """Stop every child still running: SIGTERM to each process group, SIGKILL
        after the grace period. Safe to call twice."""
        children = [p for s in self.state.sites.values() for p in s.procs]
        for site in self.state.sites.values():
            if site.status not in ("finished", "failed", "lost") and any(
                p.poll() is None for p in site.procs
            ):
                site.status = "lost"
                site.reason = site.reason or "stopped by the launcher before it finished"
        if self.emulator is not None:
            self._final_link_stats()
        terminate([*children, *([self.emulator] if self.emulator else [])])
        if self.template is not None and self.template is not self._given_template:
            self.template.close()
        self.template = None
        if self.tuner is not None:
            self.tuner.close()
            self.tuner = None
        if self.broker is not None:
            self.broker.stop()
            self.broker = None
        if self._control_state is not None:
            with contextlib.suppress(FileNotFoundError):
                self._control_state.unlink()
        for f in self._files:
            f.close()
        self._files.clear()
        if self._metrics is not None and not self._metrics.closed:
            self._read_records()
            self._metrics.close()

    def _final_link_stats(self) -> None:
        self._last_link_poll = 0.0
        self._poll_links()


def builtin_command() -> list[str]:
    """What every rank runs without ``-- CMD``: Isthmus's own training loop, a script
    like any other (it learns its job, site and run directory from the environment
    every rank gets, see :func:`site_environment`)."""
    return [sys.executable, "-m", "isthmus.training.worker"]

