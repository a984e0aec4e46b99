"""Sealing a round: which sites' contributions count, and with what weights.

Before anyone applies an outer update, every site must agree on the round's
participants and weights (tokens seen), or their global parameters drift
apart. The seal is a vote carried by the all-reduce itself: each site writes
its token count into its own slots of a small vector and zeros elsewhere; the
average over the sites, times their number, is every site's count. The engine
gives every site bitwise-identical results, so every site reads the same
decision, with no extra protocol and no leader.

A site with no tokens this round does not take part in the data round (the
engine needs weights > 0). A site that cannot be reached fails the vote by its
deadline; excluding it and going on is the failure handling's job (a later
issue), which will build on this same step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from isthmus.inter.hierarchical import HierarchicalStep, StepReport

_BASE = 1 << 12
_PARTS = 4
"""Counts travel as four float32 digits in base 2^12: each digit times a site's
rank count (up to 1024) stays below 2^22, exact through the averages (float32
integers are exact to 2^24), and counts up to 2^48."""


@dataclass(frozen=True)
class Seal:
    round: int
    participants: list[str]
    weights: dict[str, float]
    report: StepReport
    """What the vote itself cost (its bytes count as WAN traffic too)."""


def seal_round(
    step: HierarchicalStep,
    *,
    round: int,
    sites: Sequence[str],
    me: str,
    tokens: int,
    dp_size: int = 1,
) -> Seal:
    """The round's participants and weights, identical on every site.

    ``tokens``: what this rank trained on since the last seal. Every rank of the
    site calls it; the site's count is the sum over its data-parallel ranks.
    ``round`` must be a round number of its own (not a data round's)."""
    if not 0 <= tokens < _BASE**_PARTS:
        raise ValueError(f"tokens must be in [0, 2^48), got {tokens}")
    if dp_size > 1024:
        raise ValueError(f"a site of {dp_size} data-parallel ranks is more than the vote carries")
    vote = torch.zeros(_PARTS * len(sites))
    i = list(sites).index(me)
    # Each rank votes its count times the site's size: the in-site average is
    # then the site's sum.
    for digit in range(_PARTS):
        vote[_PARTS * i + digit] = float((tokens // _BASE**digit) % _BASE * dp_size)
    report = step.average(
        [vote],
        round=round,
        participants=list(sites),
        weights={s: 1.0 for s in sites},
        in_site_reduce=dp_size > 1,
    )
    digits = (vote * len(sites)).round().long().view(-1, _PARTS).tolist()
    totals = {
        s: sum(d * _BASE**k for k, d in enumerate(row))
        for s, row in zip(sites, digits, strict=True)
    }
    participants = [s for s in sites if totals[s] > 0]
    return Seal(round, participants, {s: float(totals[s]) for s in participants}, report)
