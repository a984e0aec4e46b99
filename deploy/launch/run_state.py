"""What the launcher knows of a run and each of its sites, from their processes and
the records they write: what the progress display, the summary and the tuner read.
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from isthmus.deploy.launch.warm_start import ForkedRank
from isthmus.job.file import Job


@dataclass
class SiteState:
    """What the launcher knows of one site, from its processes and records."""

    name: str
    ranks: int
    procs: list[subprocess.Popen | ForkedRank] = field(default_factory=list)
    logs: list[Path] = field(default_factory=list)
    status: str = "starting"
    """starting, computing, waiting, syncing, rejoining, leaving, left, finished, failed
    or lost."""
    reason: str = ""
    step: int = 0
    loss: float | None = None
    eval_loss: float | None = None
    tokens: int = 0
    compute_s: float = 0.0
    eval_s: float = 0.0
    outer_steps: int = 0
    wan_bytes_sent: int = 0
    wan_bytes_sent_to: dict[str, int] = field(default_factory=dict)
    started: float | None = None
    last_step_t: float | None = None
    tokens_per_s: float = 0.0
    restarts: int = 0
    restarts_in_a_row: int = 0
    """Restarts since the site last completed a round (see the launcher's MAX_RESTARTS)."""
    restart_at: float | None = None
    """``time.monotonic()`` at which a lost site is started again (None: not pending)."""
    joined: bool = False
    """Its rank 0 has called ``isthmus.join()`` since the site was last started."""
    launched_at: float = 0.0
    """``time.monotonic()`` at which its processes were last started."""
    last_round_step: int = 0
    """The step of its last ``round`` record (the final synchronisation's at the end)."""
    ended: float | None = None
    """``time.time()`` when it ended (finished, left, failed or lost), as the launcher saw."""
    ran: dict[str, Any] = field(default_factory=dict)
    """What it trains, as its ``start`` and ``described`` records say (the model, the
    inner optimizer and its settings, tokens per step: :mod:`isthmus.training.description`)."""
    live_changes: list[dict[str, Any]] = field(default_factory=list)
    """Live settings it applied: ``round``, ``step``, ``settings`` (its ``config`` records)."""


@dataclass
class RunState:
    """Everything the progress display and the summary read."""

    job: Job
    run_dir: Path
    started: float
    sites: dict[str, SiteState]
    links: dict[str, dict[str, float]] = field(default_factory=dict)
    """``a<->b`` -> {bytes: emulator wire bytes both ways, mbit_s: current throughput}."""
    status: str = "running"
    sync_every_changes: list[dict[str, Any]] = field(default_factory=list)
    """What the online H controller (``tune: {online: true}``) published, in order."""
    command: list[str] | None = None
    """What every rank runs (``isthmus run JOB -- CMD``); None: the built-in loop."""

    @property
    def steps(self) -> int:
        return self.job.train.steps

    def run_over_for(self, site: SiteState, *, run_over: bool = False) -> str:
        """Why a lost site is not started again (empty: it is): the run is over for
        it. It came back after the others had finished (``run_over``: its ranks said
        so), or it had trained every step and recorded its last round (the others
        end the run without it: a restarted site would find them done), or no other
        site trains on."""
        if run_over:
            return "it came back after every other site had finished"
        if site.last_round_step >= self.steps:
            return (
                f"it had trained all {self.steps} steps and recorded its last round; "
                "the other sites end the run without it"
            )
        return "every other site had ended" if self.others_ended(site) else ""

    def others_ended(self, site: SiteState) -> bool:
        """Whether every site but ``site`` has ended, none to be started again."""
        others = [s for s in self.sites.values() if s is not site]
        return all(
            s.status in ("finished", "left", "failed", "lost") and s.restart_at is None
            for s in others
        )

    def isthmus_link_bytes(self) -> dict[str, int]:
        """Payload bytes over each pair of sites, both ways, as the sites counted them
        at their last round (exists without an emulator too)."""
        names = [s.name for s in self.job.sites]
        return {
            f"{a}<->{b}": self.sites[a].wan_bytes_sent_to.get(b, 0)
            + self.sites[b].wan_bytes_sent_to.get(a, 0)
            for i, a in enumerate(names)
            for b in names[i + 1 :]
        }


def apply_record(site: SiteState, record: dict[str, Any]) -> None:
    """What one of the site's records says of it: progress, state, rounds, evaluations,
    what it trains and the live settings it applied."""
    kind = record["kind"]
    # Only a joined site writes records: "joined" says so first, but any record does
    # (the built-in loop wrote none of that kind before it joined through the session).
    site.joined = True
    if kind == "step":
        now = record["t"]
        if site.last_step_t is not None and now > site.last_step_t:
            rate = (record["tokens"] - site.tokens) / (now - site.last_step_t)
            site.tokens_per_s = (
                rate if not site.tokens_per_s else 0.8 * site.tokens_per_s + 0.2 * rate
            )
        site.last_step_t = now
        site.step = record["step"]
        site.loss = record["loss"]
        site.tokens = record["tokens"]
        site.compute_s = record["compute_s"]
    elif kind == "state" and site.status not in ("failed", "lost"):
        site.status = record["state"]
    elif kind == "round":
        site.restarts_in_a_row = 0  # it trains: a later loss is churn, not a crash loop
        site.outer_steps = record["outer_steps"]
        site.wan_bytes_sent = record["wan_bytes_sent"]
        site.wan_bytes_sent_to = record["wan_bytes_sent_to"]
        site.last_round_step = record.get("step", site.last_round_step)
    elif kind == "eval":
        site.eval_loss = record["eval_loss"]
        site.eval_s += record.get("seconds") or 0.0
    elif kind == "start":
        site.ran.update(record.get("ran") or {})
    elif kind == "described":
        site.ran.update(record.get("fields") or {})
    elif kind == "config":
        change = {k: record.get(k) for k in ("round", "step", "settings")}
        if change not in site.live_changes:  # a restarted site replays none, but be sure
            site.live_changes.append(change)
