"""What a rank of ``isthmus run`` records as it trains, beyond each step: the
membership views it entered and the state it pulled, the spans the strategy held
the loop, and each round's WAN counters (the run's ``records`` files, which the
launcher reads)."""

from __future__ import annotations

from typing import Any

import torch

from isthmus.inter.join import SiteRuntime
from isthmus.inter.strategies import Strategy
from isthmus.intra import collectives
from isthmus.training.records import RecordWriter


def site_mean(loss: float | None, site: SiteRuntime) -> float:
    """The step's loss averaged over the site's ranks that compute one (with
    pipeline stages, only the last does)."""
    if site.site.ranks == 1:
        return float("nan") if loss is None else float(loss)
    both = collectives.all_reduce_values(
        [0.0 if loss is None else float(loss), 0.0 if loss is None else 1.0],
        device=site.device,
        dtype=torch.float32,
        where="round_records.site_mean",
    )
    return float(both[0] / both[1]) if both[1] else float("nan")


def write_views(
    records: RecordWriter, site: SiteRuntime, strategy: Strategy, seen: tuple[int, int], step: int
) -> tuple[int, int]:
    """Record the membership views this site entered and the state it pulled, since
    ``seen`` (counts of each)."""
    if site.membership is None:
        return seen
    views, pulls = seen
    history = site.membership.history
    for view in history[views:]:
        records.write(
            "view",
            step=step,
            epoch=view.epoch,
            members=list(view.members),
            start_round=view.start_round,
            catch_up=list(view.catch_up),
            donor=view.donor,
            reason=view.reason,
        )
    caught_up = strategy.member.caught_up
    for pull in caught_up[pulls:]:
        records.write(
            "catch_up",
            step=step,
            round=pull.rounds,
            view=pull.view,
            donor=pull.donor,
            bytes=pull.bytes,
            seconds=pull.seconds,
            resumed=pull.resumed,
        )
    return len(history), len(caught_up)


def write_blocked(records: RecordWriter, strategy: Strategy) -> None:
    """Report the spans the strategy blocked the loop, and forget them."""
    for span in strategy.blocked:
        records.write("blocked", what=span.kind, started=span.started, seconds=span.seconds)
    strategy.blocked.clear()


def write_round(
    records: RecordWriter, strategy: Strategy, site: SiteRuntime, step: int
) -> dict[str, Any]:
    """The site's WAN counters (every rank's, summed: a collective) as a round record."""
    peers = [n for n in site.names if n != site.name]
    sent_to = site.endpoint.bytes_sent_to()
    counts = [
        strategy.wan_bytes_sent,
        strategy.wan_bytes_received,
        *(sent_to.get(p, 0) for p in peers),
    ]
    values = [float(v) for v in counts]
    if site.site.ranks > 1:
        # float64: byte counts stay exact to 2^53
        values = collectives.all_reduce_values(
            values, device=site.device, where="round_records.write_round"
        ).tolist()
    totals = {
        "wan_bytes_sent": int(values[0]),
        "wan_bytes_received": int(values[1]),
        "wan_bytes_sent_to": {p: int(v) for p, v in zip(peers, values[2:], strict=True)},
        # Which all-reduce the rounds took (``auto`` picks one per round, by size).
        "all_reduce_rounds": site.endpoint.rounds_by_algorithm(),
    }
    records.write("round", step=step, outer_steps=strategy.outer_steps, **totals)
    return totals
