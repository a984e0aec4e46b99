"""The online H controller: moves a running job's ``sync_every`` toward its target
utilisation, from what the sites report on the control plane.

It is a control-plane client like ``isthmus watch``: it reads each site's
per-round metrics (compute seconds and inner steps of the round, and the
seconds the strategy held the loop: the exposed exchange), and when the H that
reaches ``tune.target_utilization`` differs enough from the current one it
publishes ``sync_every`` on the config topic, for a round every site is still
ahead of, so all of them switch at the same round (the config topic's own
guarantee). It decides from rounds that ran with the current H only, at most
once per ``tune.online_every_rounds`` such rounds, and moves only by 20% or more:
one noisy round on a shared link does not make the job oscillate.

``isthmus run`` runs it in the launcher when the job file says ``tune: {online:
true}``; nothing in it is specific to one machine.
"""

from __future__ import annotations

import logging
import statistics
import time
from dataclasses import dataclass
from typing import Any

from isthmus.inter.control_plane import Broker, ControlPlane
from isthmus.job.file import Job
from isthmus.sim.tuner import sync_every_for

log = logging.getLogger("isthmus.tune")

HYSTERESIS = 0.2
"""Relative change of H below which the controller leaves it alone."""
AHEAD_ROUNDS = 2
"""The new H takes effect this many rounds after the furthest site's last round."""


@dataclass(frozen=True)
class Decision:
    """One change the controller published, and the measurements behind it."""

    t: float
    round: int
    """The latest round every site had reported."""
    from_round: int
    sync_every_from: int
    sync_every_to: int
    step_s: float
    exposed_s: float
    measured_utilization: float
    predicted_utilization: float
    link_mbit_s: float | None
    """Payload throughput of the exchanges (bytes a site sent in a round over the
    seconds the round was held for them), median over sites."""

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


class OnlineTuner:
    def __init__(self, broker: Broker, job: Job) -> None:
        self.job = job
        self.tune = job.tune
        self.strategy = job.train.strategy
        self.sync_every = job.train.sync_every
        self.sites = [s.name for s in job.sites]
        self.plane = ControlPlane(broker, job.name, None, settings=job.train)
        self.decisions: list[Decision] = []
        self._rounds: dict[int, dict[str, dict[str, Any]]] = {}
        """Round -> site -> its metrics for that round (rounds at the current H only)."""
        self._sent_before: dict[str, tuple[int, float]] = {}
        self._last_round = 0
        self._pending_from: int | None = None
        """The round from which our last change applies, until every site is past it."""

    def start(self, wait_s: float) -> OnlineTuner:
        self.plane.start(wait_s=wait_s)
        return self

    def close(self) -> None:
        self.plane.close()

    def poll(self) -> Decision | None:
        """Take in the newest metrics; publish and return a decision when one is due."""
        self._follow_outside_changes()
        for site, metrics in list(self.plane.metrics.items()):
            if site not in self.sites or not isinstance(metrics.get("round"), int):
                continue
            if metrics.get("sync_every") != self.sync_every or metrics["round"] <= 1:
                continue  # the first round starts cold; others ran with an older H
            self._rounds.setdefault(metrics["round"], {})[site] = metrics
        complete = sorted(r for r, seen in self._rounds.items() if len(seen) == len(self.sites))
        fresh = [r for r in complete if r > self._last_round]
        if len(fresh) < self.tune.online_every_rounds:
            return None
        rounds = [self._rounds[r] for r in fresh]
        self._last_round = fresh[-1]
        for r in [r for r in self._rounds if r <= self._last_round]:
            del self._rounds[r]
        return self._decide(fresh[-1], rounds)

    def _follow_outside_changes(self) -> None:
        """When every site runs an H this controller did not set (``isthmus config set``
        by an operator), take it as the current H instead of waiting for rounds at the
        old one forever."""
        latest = [m for site, m in self.plane.metrics.items() if site in self.sites]
        if len(latest) < len(self.sites):
            return
        if self._pending_from is not None:
            if min(m["round"] for m in latest) < self._pending_from:
                return  # our own change is not in effect everywhere yet
            self._pending_from = None
        running = {m.get("sync_every") for m in latest}
        if len(running) == 1 and isinstance(h := running.pop(), int) and h != self.sync_every:
            log.info("online tuner: the sites run sync_every %d (set from outside)", h)
            self.sync_every = h
            self._rounds.clear()

    def _decide(self, latest: int, rounds: list[dict[str, dict[str, Any]]]) -> Decision | None:
        per_site = [m for by_site in rounds for m in by_site.values()]
        usable = [m for m in per_site if m.get("round_steps") and m.get("compute_s") is not None]
        if not usable:
            return None
        step_s = statistics.median(m["compute_s"] / m["round_steps"] for m in usable)
        exposed_s = statistics.median(m.get("blocked_s") or 0.0 for m in usable)
        compute = self.sync_every * step_s
        measured = compute / (compute + exposed_s) if compute + exposed_s > 0 else 1.0
        wanted = sync_every_for(
            self.strategy,
            sync_every=self.sync_every,
            step_s=step_s,
            exposed_s=exposed_s,
            target=self.tune.target_utilization,
            low=self.tune.min_sync_every,
            high=self.tune.max_sync_every,
        )
        if abs(wanted - self.sync_every) < HYSTERESIS * self.sync_every:
            return None
        furthest = max(
            [*(m["round"] for m in self.plane.metrics.values()), latest]
            + [int(s.get("round", 0)) for s in self.plane.peers.values()]
        )
        from_round = furthest + AHEAD_ROUNDS
        try:
            self.plane.publish_config({"sync_every": wanted}, from_round)
        except ConnectionError as exc:
            log.warning("online tuner: %s; H stays %d", exc, self.sync_every)
            return None
        predicted = self._predicted_utilization(wanted, step_s, exposed_s)
        decision = Decision(
            t=time.time(),
            round=latest,
            from_round=from_round,
            sync_every_from=self.sync_every,
            sync_every_to=wanted,
            step_s=step_s,
            exposed_s=exposed_s,
            measured_utilization=measured,
            predicted_utilization=predicted,
            link_mbit_s=self._throughput(rounds),
        )
        log.info(
            "online tuner: sync_every %d -> %d from round %d (measured utilisation %.0f%%, "
            "%.3f s exposed per round, %.1f ms per step; predicted %.0f%%)",
            self.sync_every,
            wanted,
            from_round,
            100 * measured,
            exposed_s,
            1e3 * step_s,
            100 * predicted,
        )
        if predicted < self.tune.target_utilization and wanted == self.tune.max_sync_every:
            log.warning(
                "online tuner: the target utilisation %.0f%% needs an H above "
                "tune.max_sync_every (%d); running at %d (predicted %.0f%%); raise "
                "max_sync_every to reach it",
                100 * self.tune.target_utilization,
                self.tune.max_sync_every,
                wanted,
                100 * predicted,
            )
        self.decisions.append(decision)
        self.sync_every = wanted
        self._pending_from = from_round
        self._rounds.clear()
        return decision

    def _predicted_utilization(self, h: int, step_s: float, exposed_s: float) -> float:
        compute = h * step_s
        if self.strategy == "diloco":
            return compute / (compute + exposed_s)
        exchange = exposed_s + self.sync_every * step_s if exposed_s > 0 else 0.0
        return compute / max(compute, exchange) if compute > 0 else 1.0

    def _throughput(self, rounds: list[dict[str, dict[str, Any]]]) -> float | None:
        rates = []
        for by_site in rounds:
            for site, m in by_site.items():
                sent = m.get("wan_bytes_sent")
                before = self._sent_before.get(site)
                if isinstance(sent, int | float):
                    if before is not None and m["round"] == before[0] + 1 and m.get("blocked_s"):
                        rates.append((sent - before[1]) * 8 / 1e6 / m["blocked_s"])
                    self._sent_before[site] = (m["round"], float(sent))
        return statistics.median(rates) if rates else None
