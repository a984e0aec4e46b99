"""The training performance model: step time, round time, utilisation and WAN bytes per strategy.

A scenario is the model size, the compute time of one inner step, the sites
and the links between them, the strategy's settings and the codec. The
exchange of ``n`` bytes has two parts:

* wire: what :mod:`isthmus.sim.cost` predicts for the better of the direct and
  ring all-reduce on those links, its bandwidth part divided by the engine's
  measured efficiency against that bound (a round ends when its result is in:
  the acknowledgements of its last chunks come back while the next work runs);
* in-site: with ``d`` data-parallel ranks per site, the hierarchical step's
  reduce-scatter before and all-gather after the WAN, over the site's fabric,
  2 (d - 1) / d of the float32 values at the fabric's bandwidth plus 2 (d - 1)
  latencies (counted with the wire: it is communication, not host work);
* copies: on GPU sites, the encoded bytes between the GPU and pinned host
  memory, chunk by chunk on the copy engines beside the sending: the wire part
  is the longer of the two;
* host: work in the training process: the codec's time, a fixed overhead per
  exchange, an overhead per peer site (the messages handled per peer), and
  for the DiLoCo family the outer step (pseudo-gradients, the outer
  optimizer on CPU copies) over the values exchanged. Host work never hides
  behind that process's compute, and on a shared machine (an emulated run)
  it runs ``host_contention`` times slower: processes per core, since every
  site does it at the same time or while the others compute.

Then, per strategy, with ``t`` the compute of one inner step, ``H`` the sync
interval, and ``W(n)`` and ``C(n)`` the wire and host parts:

* ``sync``: every step exchanges the gradient in buckets as the backward pass
  (a fraction ``b`` of ``t``) produces them; all but the last bucket's share
  of the backward pass can hide the wire: step = t + max(0, W(N) - h) + C(N)
  with h = b t (1 - bucket / N) (no overlap, or one bucket: h = 0);
* ``diloco``: a round is H steps, then a vote (a tiny exchange) and the
  exchange, which cross together (the first round's vote goes first):
  round = H t + late(H) + max(X(0), X(N)), X = W + C;
* ``streaming``: P fragments each exchange N / P, the wire overlapping tau
  inner steps: round = H t + P (max(0, late(H / P) + W(N / P) - tau t) + C(N / P));
* ``async``: the exchange overlaps the whole next round:
  round = H t + max(0, late(H) + W(N) - H t) + C(N).

Sync's step is t + late(1) + max(0, W(N) - h) + C(N): its last bucket waits
for the last site.

Given the run's length (``steps``), the figures cover the whole run as
``isthmus run`` measures it: the rounds that fit in it, and the final
synchronisation every run ends with (sync: one more exchange of the model;
DiLoCo and async: a last round for the steps since the previous one, if any,
and async's last send with only those steps to hide behind; streaming: every
fragment once more, blocking). A short run pays it over fewer steps.

Every round needs every site, so where sites compute at different speeds
the slowest one's ``t`` sets the rounds' pace (``slowest_step_s``) and a
typical site's counts as its compute. By gather, the others' contributions
reach the slowest site while it computes: half the second slowest's lead
(``runner_up_step_s``) hides the lateness and the wire first. Utilisation is
H t / round. ``sim`` imports nothing from ``intra`` or ``inter``: the scenario
holds plain numbers.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from isthmus.sim.cost import (
    ALGORITHM_COSTS,
    LOSSY_ALGORITHMS,
    LinkCost,
    LinkLookup,
    Regions,
    codec_work,
    predict,
    sent_share,
)

STRATEGIES = ("sync", "diloco", "streaming", "async")

CODEC_BYTES_PER_VALUE = {
    "none": 4.0,
    "fp16": 2.0,
    "bf16": 2.0,
    "int8": 1.0 + 4 / 256,
    "int4": 0.5 + 4 / 256,
    "int2": 0.25 + 4 / 256,
}
"""Wire bytes per float32 value (int8/int4/int2: one float32 scale per block of 256)."""

GPU_FLOPS = {"h100": 989e12, "h200": 989e12, "a100": 312e12, "b200": 2250e12, "cpu": 1e11}
"""Dense BF16 peak FLOP/s per accelerator (vendor data sheets; cpu: a rough core)."""


class ScenarioError(ValueError):
    """A scenario that cannot exist; ``field`` names the flag or job-file key."""

    def __init__(self, field_name: str, message: str) -> None:
        super().__init__(f"{field_name}: {message}")
        self.field = field_name


@dataclass(frozen=True, kw_only=True)
class Scenario:
    params: float
    """Parameters of the model (what crosses the WAN: 4 bytes each before the codec)."""
    step_s: float
    """Compute seconds of one inner step at a site (all its ranks in parallel)."""
    slowest_step_s: float | None = None
    """The slowest site's compute seconds per inner step, where sites differ (a
    site on older GPUs; in an emulated run, sites that share cores unevenly):
    every round waits for it, so it sets the pace, while the others' compute
    counts at ``step_s``. None: every site computes at ``step_s``."""
    runner_up_step_s: float | None = None
    """The second slowest site's compute seconds per inner step (None: ``step_s``).
    By gather every site sends its contribution as soon as it has it, so the others'
    arrive at the slowest site while it still computes: their lead hides the wire
    (see :func:`predict_run`)."""
    step_jitter_s: float = 0.0
    """Standard deviation of a site's compute per inner step, from step to step
    (measured by a calibration; a few percent of the step on dedicated GPUs, more
    where processes share cores): the last site to reach a synchronisation holds
    it up."""
    tokens_per_step: float
    """Tokens one inner step trains on, summed over every site."""
    sites: Sequence[str]
    links: Mapping[frozenset[str], LinkCost]
    uplink_bytes_per_s: Mapping[str, float] = field(default_factory=dict)
    regions: Regions | None = None
    """The job's regions and their shared long-haul capacity (two-level all-reduce)."""
    strategy: str = "diloco"
    sync_every: int = 50
    fragments: int = 2
    overlap_steps: int = 1
    codec: str = "none"
    codec_bytes_per_s: float = math.inf
    """Encode plus decode speed of the codec, bytes of float32 per second."""
    efficiency: float = 1.0
    """The engine's measured fraction of the all-reduce bound it reaches."""
    host_link_bytes_per_s: float = math.inf
    """GPU sites: the device-host copies of the encoded bytes (PCIe), on the copy
    engines beside the sending: an exchange's wire part takes the longer of the
    two. The CPU sites of an emulated run copy nothing."""
    exchange_overhead_s: float = 0.0
    """Fixed host seconds per exchange beyond the wire: start, vote, outer step, Python."""
    peer_overhead_s: float = 0.0
    """Host seconds per exchange for each peer site (the messages handled per peer)."""
    outer_step_s: float = 0.0
    """DiLoCo family: host seconds of the outer step over the whole model."""
    site_ranks: int = 1
    """Data-parallel ranks per site that share its WAN traffic (the hierarchical step)."""
    fabric_bytes_per_s: float = math.inf
    """In-site bandwidth per rank (NVLink or InfiniBand; Gloo over loopback here)."""
    fabric_latency_s: float = 0.0
    machine_bytes_per_s: float = math.inf
    """An emulated job, every site on one machine: the data-plane bytes per second that
    machine moves at the job's number of site processes (measured by ``isthmus sim
    --calibrate``). Each all-reduce phase lasts at least what all sites send in it at
    this rate (:mod:`isthmus.sim.cost`); unbounded for real sites."""
    host_contention: float = 1.0
    """How much slower host work runs: processes per core on a shared machine (an
    emulated run); 1 where every process has its own cores."""
    steps: int | None = None
    """The run's inner steps per site. Given, the prediction covers the whole run
    as ``isthmus run`` measures it: the rounds that fit in it and the final
    synchronisation every run ends with, which a short run pays over fewer steps.
    None: the steady state of a run without end."""
    host_hardware: str = "cpu"
    """Where the host work runs (``isthmus.sim.hardware``): what the codec, outer-step
    and overhead figures above were taken from; reported with the prediction."""
    model: str = ""
    """What the compute and parameters are of, as the prediction names it (the built-in
    model, a script's calibration run, or the flags given): no input to the model."""
    outer_overlaps_backward: bool = False
    """The DiLoCo family's exchange may overlap the backward pass of the step that
    ends its round, as sync's gradient buckets do. Isthmus starts it after that
    step (False); published simulators (Douillard et al.'s, behind the Streaming
    DiLoCo paper's tables) let it overlap, and the published comparison uses
    their convention to reproduce them."""
    backward_fraction: float = 2 / 3
    """Share of a step's compute that Sync's bucketed exchange can hide behind."""
    sync_overlap: bool = True
    bucket_bytes: float = 25 * 2**20
    """Sync's bucket size (its ``bucket_mb``): the last bucket starts after backward."""

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise ScenarioError("strategy", f"use one of {', '.join(STRATEGIES)}")
        if not (self.params > 0):
            raise ScenarioError("params", f"must be > 0, got {self.params}")
        if not (self.step_s > 0):
            raise ScenarioError("step_s", f"compute time per step must be > 0, got {self.step_s}")
        if self.slowest_step_s is not None and not (self.slowest_step_s >= self.step_s):
            raise ScenarioError(
                "slowest_step_s",
                f"must be >= step_s ({self.step_s}), got {self.slowest_step_s}",
            )
        if self.runner_up_step_s is not None and not (0 < self.runner_up_step_s <= self.pace_s):
            raise ScenarioError(
                "runner_up_step_s",
                f"must be in (0, the slowest site's {self.pace_s}], got {self.runner_up_step_s}",
            )
        if not (0 <= self.step_jitter_s < math.inf):
            raise ScenarioError(
                "step_jitter_ms", f"must be >= 0 and finite, got {self.step_jitter_s * 1e3} ms"
            )
        if self.sync_every < 1:
            raise ScenarioError("sync_every", f"must be >= 1, got {self.sync_every}")
        if self.steps is not None and self.steps < 1:
            raise ScenarioError("steps", f"must be >= 1, got {self.steps}")
        if self.fragments < 1 or self.fragments > self.sync_every:
            raise ScenarioError("fragments", f"must be in [1, sync_every], got {self.fragments}")
        if self.codec not in CODEC_BYTES_PER_VALUE:
            raise ScenarioError("codec", f"use one of {', '.join(CODEC_BYTES_PER_VALUE)}")
        if self.site_ranks < 1:
            raise ScenarioError("site_ranks", f"must be >= 1, got {self.site_ranks}")
        if not (self.fabric_bytes_per_s > 0):
            raise ScenarioError("fabric_gbit", f"must be > 0, got {self.fabric_bytes_per_s}")
        if not (self.host_contention >= 1):
            raise ScenarioError(
                "host_contention", f"must be >= 1 (processes per core), got {self.host_contention}"
            )
        if not (self.machine_bytes_per_s > 0):
            raise ScenarioError(
                "machine_mbyte_s", f"must be > 0 MB/s, got {self.machine_bytes_per_s / 1e6:g}"
            )
        if not (0 < self.efficiency <= 1):
            raise ScenarioError("efficiency", f"must be in (0, 1], got {self.efficiency}")
        for pair, cost in self.links.items():
            if not (cost.bandwidth_bytes_per_s > 0):
                raise ScenarioError(
                    "bandwidth_mbit", f"link {'<->'.join(sorted(pair))} has no bandwidth"
                )

    @property
    def pace_s(self) -> float:
        """Compute seconds per inner step of the slowest site: the rounds' pace."""
        return self.step_s if self.slowest_step_s is None else self.slowest_step_s

    @property
    def runner_up_s(self) -> float:
        """Compute seconds per inner step of the second slowest site."""
        return self.step_s if self.runner_up_step_s is None else self.runner_up_step_s

    def lead_s(self, steps: float) -> float:
        """How long before the slowest site the second slowest finishes ``steps`` inner
        steps after they last met."""
        return steps * max(0.0, self.pace_s - self.runner_up_s)

    def late_s(self, steps: float) -> float:
        """Expected seconds the last site reaches a synchronisation after the average
        one, ``steps`` inner steps after the sites last met."""
        return self.step_jitter_s * math.sqrt(steps) * expected_largest_normal(len(self.sites))

    def link(self, a: str, b: str) -> LinkCost:
        return self._ordered_links[(a, b)]

    @functools.cached_property
    def _ordered_links(self) -> dict[tuple[str, str], LinkCost]:
        """``links`` by ordered pair: the cost functions look a link up for every
        pair of sites, millions of times at 256 sites, and building a frozenset
        for each lookup was most of ``isthmus sim``'s time there."""
        ordered: dict[tuple[str, str], LinkCost] = {}
        for pair, cost in self.links.items():
            a, b = (*pair, *pair)[:2]  # a one-site "pair" is (a, a)
            ordered[(a, b)] = ordered[(b, a)] = cost
        return ordered

    @property
    def wan_bytes(self) -> float:
        """Bytes of one full exchange of the model, as encoded."""
        return self.params * CODEC_BYTES_PER_VALUE[self.codec]


@dataclass(frozen=True)
class Prediction:
    strategy: str
    step_s: float
    """Mean wall seconds per inner step, exchanges included."""
    round_s: float
    """Wall seconds per sync interval (one step for sync)."""
    exchange_s: float
    """Seconds one exchange of the whole model takes (wire, codec, overhead)."""
    exposed_s: float
    """Seconds per round the compute waits: for exchanges, and for the last site."""
    utilization: float
    wan_bytes_per_token: float
    """Bytes sent over the WAN, all sites, per token trained."""
    algorithm: str

    def seconds_to_tokens(self, tokens: float, tokens_per_step: float) -> float:
        return tokens / tokens_per_step * self.step_s

    def to_dict(self) -> dict[str, float | str]:
        return {
            "strategy": self.strategy,
            "step_s": self.step_s,
            "round_s": self.round_s,
            "exchange_s": self.exchange_s,
            "exposed_s": self.exposed_s,
            "utilization": self.utilization,
            "wan_bytes_per_token": self.wan_bytes_per_token,
            "algorithm": self.algorithm,
        }


@dataclass(frozen=True)
class ExchangeCost:
    """One all-reduce across the sites, in its two parts."""

    wire_s: float
    """Network time: transfer at the engine's efficiency, and latencies."""
    host_s: float
    """Host work in the training process: codec, fixed and per-peer overheads."""
    algorithm: str

    @property
    def seconds(self) -> float:
        return self.wire_s + self.host_s


def exchange_cost(scenario: Scenario, nbytes: float, *, outer: float = 0.0) -> ExchangeCost:
    """One all-reduce of ``nbytes`` (encoded) across the sites; ``outer``: the share
    of the model whose outer step follows it (DiLoCo family)."""
    sites = list(scenario.sites)
    if len(sites) < 2:
        return ExchangeCost(0.0, 0.0, "none")
    regions = scenario.regions
    costs = predict(nbytes, sites, scenario.link, scenario.uplink_bytes_per_s, regions=regions)
    if scenario.codec != "none":  # as the engine's auto
        costs = {name: t for name, t in costs.items() if name in LOSSY_ALGORITHMS}
    algorithm = min(costs, key=lambda name: (costs[name], name != "direct"))
    raw_bytes = nbytes / CODEC_BYTES_PER_VALUE[scenario.codec] * 4
    codec_s = 0.0
    if scenario.codec != "none":  # gather decodes every other site's whole contribution
        codec_s = raw_bytes / scenario.codec_bytes_per_s * codec_work(algorithm, len(sites))
    wire_s = all_reduce_seconds(scenario, nbytes, algorithm)
    # What one site sends (and receives): 2 (S-1)/S of the bytes, (S-1) with gather.
    copies_s = sent_share(algorithm, len(sites)) * nbytes / scenario.host_link_bytes_per_s
    wire_s = max(wire_s, copies_s)
    d = scenario.site_ranks
    if d > 1:
        wire_s += 2 * (d - 1) / d * raw_bytes / scenario.fabric_bytes_per_s
        wire_s += 2 * (d - 1) * scenario.fabric_latency_s
    host_s = (
        codec_s
        + scenario.exchange_overhead_s
        + scenario.peer_overhead_s * (len(sites) - 1)
        + scenario.outer_step_s * outer
    )
    return ExchangeCost(wire_s, host_s * scenario.host_contention, algorithm)


def all_reduce_seconds(scenario: Scenario, nbytes: float, algorithm: str) -> float:
    """One all-reduce of ``nbytes`` by ``algorithm`` on the scenario's links: every
    link's (and shared capacity's) rate times the engine's efficiency, its latency
    as it is. Where one machine runs every site (an emulated job,
    ``machine_bytes_per_s``), each phase also lasts the bytes every site sends in it
    over that machine's measured rate, which already holds the engine's own losses."""
    sites = list(scenario.sites)
    efficiency = scenario.efficiency

    def link(a: str, b: str) -> LinkCost:
        cost = scenario.link(a, b)
        return LinkCost(cost.bandwidth_bytes_per_s * efficiency, cost.one_way_s)

    uplinks = {site: rate * efficiency for site, rate in scenario.uplink_bytes_per_s.items()}
    regions = scenario.regions
    if regions is not None:
        capped = {r: rate * efficiency for r, rate in regions.egress_bytes_per_s.items()}
        regions = Regions(regions.of, capped)
    cost = ALGORITHM_COSTS[algorithm]
    return cost(nbytes, sites, link, uplinks, regions, scenario.machine_bytes_per_s)


def exchange_seconds(scenario: Scenario, nbytes: float) -> tuple[float, str]:
    """One all-reduce of ``nbytes`` (encoded) across the sites, and the algorithm."""
    cost = exchange_cost(scenario, nbytes)
    return cost.seconds, cost.algorithm


def _overlapped(cost: ExchangeCost, hidden_s: float, late_s: float = 0.0) -> float:
    """Seconds an exchange holds the compute when its wire, started ``late_s`` after
    this site's by the last site, overlaps ``hidden_s`` of compute: what is left
    beyond that, and all of its host work."""
    return max(0.0, late_s + cost.wire_s - hidden_s) + cost.host_s


def _slack(s: Scenario, cost: ExchangeCost, steps: float) -> float:
    """What a round's exchange may hide behind at the slowest site, beyond its own
    compute: by gather, half the lead of the second slowest. The period of lockstep
    rounds is the longest cycle of work and sends among the sites, per round: the
    slowest site's compute alone, or its compute, its contribution's trip to the
    runner-up, the runner-up's compute and the trip back, over two rounds. Direct
    returns each slice through its owner after the last contribution: no slack."""
    return s.lead_s(steps) / 2 if cost.algorithm == "gather" else 0.0


def _waited(cost: ExchangeCost, hidden_s: float, late_s: float, slack_s: float) -> float:
    """Seconds a lockstep exchange holds the compute: the last site's lateness, then
    the wire beyond ``hidden_s`` of compute and its host work (:func:`_overlapped`);
    ``slack_s`` (:func:`_slack`) absorbs the lateness first, then hides wire."""
    spare = max(0.0, slack_s - late_s)
    return max(0.0, late_s - slack_s) + _overlapped(cost, hidden_s + spare)


@functools.cache
def expected_largest_normal(count: int) -> float:
    """The expected largest of ``count`` independent standard normal values:
    the integral of x count phi(x) Phi(x)^(count - 1) (0 for one value)."""
    if count < 2:
        return 0.0
    step, total = 1e-3, 0.0
    for i in range(-10_000, 10_001):
        x = i * step
        density = math.exp(-x * x / 2) / math.sqrt(2 * math.pi)
        below = 0.5 * (1 + math.erf(x / math.sqrt(2)))
        total += x * count * density * below ** (count - 1)
    return total * step


def predict_run(scenario: Scenario) -> Prediction:
    # Every strategy's rounds need every site, so the slowest site's compute (pace)
    # sets the wall time; utilisation counts a typical site's compute (t) in it.
    s, t, h = scenario, scenario.step_s, scenario.sync_every
    pace = s.pace_s
    sites = len(s.sites)

    def sent_per_exchange(algorithm: str) -> float:
        """What every site together sends in one exchange of the whole model."""
        return sent_share(algorithm, sites) * s.wan_bytes * sites

    if s.strategy == "sync":
        full = exchange_cost(s, s.wan_bytes)
        model_bytes = 4 * s.params
        hideable = max(0.0, 1 - s.bucket_bytes / model_bytes) if s.sync_overlap else 0.0
        hidden = s.backward_fraction * pace * hideable
        exposed = _waited(full, hidden, s.late_s(1), _slack(s, full, 1))
        round_s = pace + exposed
        # The run ends with one more exchange of the whole model, not overlapped.
        step_s, utilization = _whole_run(s, round_s, 1, 0.0, full.seconds) or (
            round_s,
            t / round_s,
        )
        return Prediction(
            "sync",
            step_s,
            round_s,
            full.seconds,
            exposed,
            utilization,
            sent_per_exchange(full.algorithm) / s.tokens_per_step,
            full.algorithm,
        )
    compute = h * pace
    full = exchange_cost(s, s.wan_bytes, outer=1.0)
    algorithm = full.algorithm
    backward = s.backward_fraction * pace if s.outer_overlaps_backward else 0.0
    left = (s.steps or 0) % h  # steps after the last whole round
    if s.strategy == "diloco":
        vote_cost = exchange_cost(s, 64.0)
        vote = vote_cost.seconds
        # The data cross beside the vote: each takes its own round trip, at once.
        late, slack = s.late_s(h), _slack(s, full, h)
        exposed = max(_waited(vote_cost, 0.0, late, slack), _waited(full, backward, late, slack))
        # A last round for the steps since the previous one, if any; and the
        # first round's vote, which goes before its data (no shared scale yet).
        final = (s.late_s(left) + max(vote, full.seconds) if left else 0.0) + vote
        whole = _whole_run(s, pace, h, exposed, final)
    elif s.strategy == "async":
        exposed = _overlapped(full, compute + backward, s.late_s(h))
        # The last send has only the steps after it to hide behind, then a
        # synchronous round for those steps, if any.
        last = _overlapped(full, left * pace, s.late_s(max(left, 1))) - exposed
        whole = _whole_run(s, pace, h, exposed, last + (full.seconds if left else 0.0))
    else:  # streaming: the sites meet at every fragment's exchange
        part = exchange_cost(s, s.wan_bytes / s.fragments, outer=1 / s.fragments)
        algorithm = part.algorithm
        late = s.late_s(h / s.fragments)
        hidden = s.overlap_steps * pace + backward + _slack(s, part, h / s.fragments)
        per_fragment = _overlapped(part, hidden, late)
        exposed = s.fragments * per_fragment
        # Finishing: every fragment exchanged once more, blocking.
        every = max(1, h // s.fragments)
        whole = _whole_run(s, pace, every, per_fragment, late + full.seconds)
    round_s = compute + exposed
    step_s, utilization = whole or (round_s / h, h * t / round_s)
    return Prediction(
        s.strategy,
        step_s,
        round_s,
        full.seconds,
        exposed,
        utilization,
        sent_per_exchange(algorithm) / (h * s.tokens_per_step),
        algorithm,
    )


def _whole_run(
    s: Scenario, per_step_s: float, period: int, exposed_s: float, final_s: float
) -> tuple[float, float] | None:
    """Wall seconds per step and utilisation over a run of ``s.steps`` steps, each
    ``per_step_s`` long, with ``exposed_s`` waited every ``period`` steps and
    ``final_s`` at the end; None for the steady state (no ``s.steps``)."""
    if s.steps is None:
        return None
    wall = s.steps * per_step_s + s.steps // period * exposed_s + final_s
    return wall / s.steps, s.steps * s.step_s / wall


def uniform_links(
    sites: Sequence[str], *, bandwidth_mbit: float, rtt_ms: float
) -> dict[frozenset[str], LinkCost]:
    """Every pair of sites on the same link."""
    if bandwidth_mbit <= 0:
        raise ScenarioError("bandwidth_mbit", f"must be > 0, got {bandwidth_mbit}")
    if rtt_ms < 0:
        raise ScenarioError("rtt_ms", f"must be >= 0, got {rtt_ms}")
    cost = LinkCost.of(bandwidth_mbit=bandwidth_mbit, rtt_ms=rtt_ms)
    return {frozenset((a, b)): cost for i, a in enumerate(sites) for b in sites[i + 1 :]}


def step_seconds_from_flops(
    params: float, tokens_per_step_per_gpu: float, gpu: str, mfu: float
) -> float:
    """6 N FLOPs per token (forward and backward) at ``mfu`` of the GPU's peak."""
    try:
        peak = GPU_FLOPS[gpu]
    except KeyError:
        raise ScenarioError(
            "gpu", f"unknown GPU {gpu!r}; use one of {', '.join(GPU_FLOPS)}"
        ) from None
    if not (0 < mfu <= 1):
        raise ScenarioError("mfu", f"must be in (0, 1], got {mfu}")
    return 6 * params * tokens_per_step_per_gpu / (peak * mfu)


__all__ = [
    "CODEC_BYTES_PER_VALUE",
    "GPU_FLOPS",
    "STRATEGIES",
    "ExchangeCost",
    "LinkLookup",
    "Prediction",
    "Scenario",
    "ScenarioError",
    "exchange_cost",
    "exchange_seconds",
    "predict_run",
    "step_seconds_from_flops",
    "uniform_links",
]
