"""The runs of the performance model's validation (``perf_model_validation.py``):
each a job file's sites, links and strategy, grouped into the sets kept apart
(docs/performance-model.md, "Validation")."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Case:
    sites: int
    bandwidth_mbit: float
    rtt_ms: float
    strategy: str
    sync_every: int
    steps: int
    ranks: tuple[int, ...] = ()
    """Ranks of each site (default: one each)."""
    links: tuple[tuple[int, int, float, float, float], ...] = ()
    """Links that differ from the default: (site, site, Mbit/s, RTT ms, jitter ms)."""

    @property
    def site_ranks(self) -> tuple[int, ...]:
        return self.ranks or (1,) * self.sites

    @property
    def name(self) -> str:
        h = f", H={self.sync_every}" if self.strategy != "sync" else ""
        ranks = f" ({'+'.join(map(str, self.site_ranks))} ranks)" if self.ranks else ""
        links = "" if not self.links else f", {len(self.links)} uneven link(s)"
        jitter = any(link[4] for link in self.links)
        return (
            f"{self.sites} sites{ranks}, {self.bandwidth_mbit:g} Mbit/s, {self.rtt_ms:g} ms"
            f"{links}{' with jitter' if jitter else ''}, {self.strategy}{h}, {self.steps} steps"
        )


CALIBRATIONS = (Case(2, 1000, 1, "diloco", 10, 60), Case(4, 1000, 1, "diloco", 10, 60))
FIT = [
    Case(2, 100, 40, "sync", 10, 40),
    Case(2, 100, 40, "diloco", 20, 120),
    Case(3, 200, 80, "diloco", 20, 120),
    Case(3, 20, 80, "diloco", 20, 120),
    Case(3, 20, 80, "streaming", 20, 120),
    Case(4, 20, 60, "sync", 10, 20),
    Case(4, 100, 60, "streaming", 20, 120),
]
UNEVEN = ((0, 1, 100, 120, 0), (0, 2, 300, 160, 0), (1, 2, 200, 140, 5))
"""The new user's job of the issue: 100-300 Mbit/s at 120-160 ms, jitter on one."""
DIAGNOSED = [
    Case(3, 200, 140, "diloco", 50, 300, ranks=(2, 1, 1), links=UNEVEN),
    Case(3, 200, 140, "diloco", 50, 120, ranks=(2, 1, 1), links=UNEVEN),
    Case(2, 100, 40, "sync", 10, 40, ranks=(2, 2)),
    Case(2, 50, 80, "diloco", 20, 120, ranks=(2, 2)),
    Case(2, 200, 60, "streaming", 20, 120, ranks=(2, 1)),
    Case(3, 20, 100, "async", 20, 120, ranks=(2, 1, 1)),
    Case(2, 30, 150, "diloco", 10, 120, ranks=(1, 2)),
    Case(2, 20, 80, "sync", 10, 30, ranks=(2, 1)),
    Case(3, 100, 60, "streaming", 30, 300, links=((0, 1, 20, 40, 0), (1, 2, 300, 200, 0))),
    Case(2, 10, 200, "diloco", 30, 300, links=((0, 1, 10, 200, 10),)),
    Case(4, 50, 30, "async", 10, 120),
    Case(3, 100, 60, "sync", 10, 40, links=((0, 2, 100, 60, 3),)),
    Case(2, 100, 300, "streaming", 40, 120),
]
"""The first held-out set. Its runs showed what the model and the measurements
missed (uneven links, the engine's efficiency, a multi-rank site's per-step
collective outside compute), so it was used to change them: no longer held out.
Kept as the diagnosis set, its runs predicted again with every change."""
SECOND_DIAGNOSIS = [
    Case(2, 150, 90, "diloco", 25, 200, ranks=(2, 1)),
    Case(
        3,
        120,
        100,
        "streaming",
        20,
        120,
        ranks=(1, 1, 2),
        links=((0, 1, 50, 50, 0), (1, 2, 250, 180, 0)),
    ),
    Case(2, 40, 120, "async", 15, 120, ranks=(2, 2)),
    Case(3, 150, 50, "sync", 10, 40, ranks=(2, 1, 1)),
    Case(2, 80, 250, "streaming", 30, 240, ranks=(1, 2), links=((0, 1, 80, 250, 8),)),
    Case(4, 100, 70, "diloco", 20, 120, ranks=(2, 1, 1, 1)),
    Case(2, 15, 110, "diloco", 15, 120),
    Case(3, 200, 150, "async", 25, 200, links=((0, 2, 15, 60, 0),)),
    Case(4, 60, 90, "streaming", 20, 120, links=((1, 3, 60, 90, 4),)),
    Case(2, 80, 35, "sync", 10, 30, ranks=(2, 2)),
    Case(2, 250, 280, "sync", 10, 60),
    Case(3, 120, 60, "diloco", 40, 240, ranks=(1, 2, 1), links=((1, 2, 25, 200, 0),)),
    Case(2, 100, 40, "async", 10, 120, ranks=(2, 1)),
]
"""The second held-out set, chosen after the changes above. Its async and long DiLoCo
runs computed up to 1.9x slower than calibrations that synchronised every 10 steps,
and a 2+2-rank sync run came out 19% fast of its prediction from its own compute:
they found that the calibration must run at the job's own interval (the sites' duty
cycle on shared cores) and that the in-site fabric constant was a rank's wait, not
Gloo's speed. So it was used to change them: no longer held out."""
THIRD_DIAGNOSIS = [
    Case(2, 120, 70, "diloco", 30, 240, ranks=(2, 1)),
    Case(3, 90, 110, "streaming", 24, 120, ranks=(2, 1, 1), links=((0, 2, 40, 70, 0),)),
    Case(2, 60, 160, "async", 20, 120, ranks=(1, 2)),
    Case(2, 200, 30, "sync", 10, 40, ranks=(2, 1)),
    Case(3, 50, 140, "diloco", 15, 120, links=((0, 1, 25, 90, 6),)),
    Case(4, 150, 45, "async", 20, 160),
    Case(2, 300, 120, "streaming", 40, 240, ranks=(2, 2)),
    Case(3, 80, 80, "sync", 10, 30, links=((1, 2, 40, 120, 4),)),
    Case(2, 25, 60, "diloco", 20, 120, ranks=(2, 2)),
    Case(3, 180, 200, "async", 30, 180, ranks=(1, 1, 2), links=((0, 1, 60, 100, 0),)),
    Case(4, 120, 50, "streaming", 16, 120, ranks=(1, 1, 1, 2)),
    Case(2, 40, 90, "sync", 10, 30),
    Case(3, 70, 130, "diloco", 50, 300, ranks=(2, 1, 1), links=((0, 1, 200, 150, 3),)),
]
"""The third held-out set, chosen after the changes above. Run again once an emulated
job's all-reduce took gather where it is faster (one trip), its 2+1-rank DiLoCo run
came out 11.7% faster than predicted: by gather the others' contributions reach the
slowest site while it still computes, and their lead hides the wire. The model took
that from it (the runner-up's pace): no longer held out."""
HELD_OUT = [
    Case(2, 80, 100, "diloco", 25, 200, ranks=(1, 2)),
    Case(3, 150, 120, "diloco", 20, 160, ranks=(1, 2, 1), links=((0, 1, 60, 180, 0),)),
    Case(4, 20, 30, "diloco", 15, 120, ranks=(1, 1, 2, 1)),
    Case(2, 100, 200, "streaming", 30, 180, ranks=(2, 1)),
    Case(3, 60, 80, "streaming", 20, 120, links=((1, 2, 30, 150, 5),)),
    Case(4, 200, 60, "streaming", 24, 144, ranks=(2, 1, 1, 1)),
    Case(2, 50, 120, "async", 25, 200, ranks=(2, 1)),
    Case(3, 100, 90, "async", 15, 120, ranks=(1, 2, 2)),
    Case(4, 80, 40, "async", 20, 160, links=((0, 3, 40, 100, 3),)),
    Case(2, 150, 50, "sync", 10, 40, ranks=(1, 2)),
    Case(3, 60, 100, "sync", 10, 30, ranks=(2, 1, 1)),
    Case(4, 300, 30, "sync", 10, 30),
    Case(3, 120, 150, "diloco", 40, 240, links=((0, 2, 200, 220, 2),)),
]
"""The held-out set: chosen after every change above, before any of its runs, and
never used to make one."""
SETS = {
    "fit": FIT,
    "diagnosis": DIAGNOSED,
    "diagnosis-2": SECOND_DIAGNOSIS,
    "diagnosis-3": THIRD_DIAGNOSIS,
    "held-out": HELD_OUT,
}
