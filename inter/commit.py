"""Sealing a round: which sites' contributions count, and with what weights.

Before anyone applies an outer update, every site must agree on the round's
participants and weights (tokens seen), or their global parameters drift
apart. The seal is a vote carried by the all-reduce itself: each site writes
its token count into its own slots of a small vector and zeros elsewhere; the
average over the sites, times their number, is every site's count. The engine
gives every site bitwise-identical results, so every site reads the same
decision, with no extra protocol and no leader.

Besides its count, each site votes whether its contribution is usable: a rank
whose values are not finite (a diverged step, a bad batch) refuses its site's
contribution, and one refusing rank excludes its whole site, on every site
alike. A site with no tokens, or refused, is left out of the round: it still
takes part in the data round with weight 0 (sending zeros, receiving the
average), so it ends the round with the same global parameters as the others.
A site that cannot be reached fails the vote; the membership protocol
(:mod:`isthmus.inter.membership`) then decides a view without it, and the vote
runs again among that view's members.

The vote can run beside the data round instead of before it
(:func:`start_seal`): each site then sends its values already weighted by its
own count over a scale all sites share (``scale_tokens``), and the average
becomes the weighted one once the vote says the total. The vote carries each
site's scale so that a site which used another one is seen, never averaged in.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from isthmus.inter.hierarchical import HierarchicalStep, PendingAverage, StepReport

_BASE = 1 << 12
_PARTS = 4
"""Counts travel as four float32 digits in base 2^12: each digit times a site's
rank count (up to 1024) stays below 2^22, exact through the averages (float32
integers are exact to 2^24), and counts up to 2^48."""
_SLOTS = 2 * _PARTS + 2
"""Per site: the count's digits, the number of its ranks that refused, the
number that say this is their last round, and the digits of the scale its data
were sent at (0: sent unscaled, in a round of its own)."""


@dataclass(frozen=True)
class Seal:
    round: int
    participants: list[str]
    """Sites whose contributions count this round (tokens > 0, none refused)."""
    weights: dict[str, float]
    """Every site's weight, 0 for those left out."""
    refused: list[str]
    """Sites left out because one of their ranks refused its contribution."""
    finished: list[str]
    """Sites for which this is the last round: training is over for everyone."""
    report: StepReport
    """What the vote itself cost (its bytes count as WAN traffic too)."""
    scale_tokens: dict[str, int]
    """Every site's scale for a data round run beside the vote (see
    :func:`start_seal`); 0 where it sent none."""

    @property
    def total(self) -> float:
        """The participants' tokens: what a scaled average is divided by."""
        return sum(self.weights.values())

    def shared_scale(self) -> int | None:
        """The scale every participant sent its data at, or None where they differ
        (or sent unscaled): the data round beside the vote is then not the average,
        and the round's data must be averaged again with the seal's weights."""
        scales = {self.scale_tokens[s] for s in self.participants}
        if len(scales) != 1:
            return None
        (scale,) = scales
        return scale or None


def start_seal(
    step: HierarchicalStep,
    *,
    round: int,
    sites: Sequence[str],
    me: str,
    tokens: int,
    dp_size: int = 1,
    refuse: bool = False,
    last: bool = False,
    scale_tokens: int = 0,
) -> PendingSeal:
    """Start the vote that seals a round; :meth:`PendingSeal.wait` reads it.

    ``tokens``: what this rank trained on since the last seal. Every rank of the
    site calls it; the site's count is the sum over its data-parallel ranks.
    ``refuse``: this rank's contribution is unusable; its site is left out.
    ``last``: this site stops training after this round (its data or step budget
    is spent); every site learns it from the seal and stops too, so all take
    part in the same rounds even when their rounds hold different step counts.
    ``round`` must be a round number of its own (not a data round's).
    ``sites``: the round's members (all of the job's, or a membership view's).
    ``scale_tokens``: the scale this site's data round beside the vote was sent
    at (its values times its count over this scale), the same on every rank of
    the site; 0 when the data go in a round of their own after the vote."""
    if not 0 <= tokens < _BASE**_PARTS:
        raise ValueError(f"tokens must be in [0, 2^48), got {tokens}")
    if not 0 <= scale_tokens < _BASE**_PARTS:
        raise ValueError(f"scale_tokens must be in [0, 2^48), got {scale_tokens}")
    if dp_size > 1024:
        raise ValueError(f"a site of {dp_size} data-parallel ranks is more than the vote carries")
    vote = torch.zeros(_SLOTS * len(sites))
    i = list(sites).index(me)
    # Each rank votes its count times the site's size: the in-site average is
    # then the site's sum. The scale is the same on every rank: voted as it is.
    for digit in range(_PARTS):
        vote[_SLOTS * i + digit] = float((tokens // _BASE**digit) % _BASE * dp_size)
        vote[_SLOTS * i + _PARTS + 2 + digit] = float((scale_tokens // _BASE**digit) % _BASE)
    vote[_SLOTS * i + _PARTS] = float(dp_size if refuse else 0)
    vote[_SLOTS * i + _PARTS + 1] = float(dp_size if last else 0)
    pending = step.start(
        [vote],
        round=round,
        participants=list(sites),
        weights={s: 1.0 for s in sites},
        in_site_reduce=dp_size > 1,
        # Float32 whatever the job's codec: a lossy one would round the digits and
        # flags (int8 turned small digits into zeros; topk, whose levels are never
        # zero, turned zero flags into refusals).
        exact=True,
    )
    return PendingSeal(round, list(sites), vote, pending)


class PendingSeal:
    """A vote under way (:func:`start_seal`)."""

    def __init__(
        self, round: int, sites: list[str], vote: torch.Tensor, pending: PendingAverage
    ) -> None:
        self.round = round
        self._sites = sites
        self._vote = vote
        self._pending = pending

    def discard(self) -> None:
        """Give the vote up (every rank of the site alike)."""
        self._pending.discard()

    def wait(self, abort: Callable[[], bool] | None = None) -> Seal:
        """The seal, identical on every site. ``abort``: see
        :meth:`PendingAverage.wait`."""
        report = self._pending.wait(abort=abort)
        sites = self._sites
        slots = (self._vote * len(sites)).round().long().view(-1, _SLOTS).tolist()

        def number(digits: list[int]) -> int:
            return sum(d * _BASE**k for k, d in enumerate(digits))

        totals = {s: number(row[:_PARTS]) for s, row in zip(sites, slots, strict=True)}
        scales = {s: number(row[_PARTS + 2 :]) for s, row in zip(sites, slots, strict=True)}
        refused = [s for s, row in zip(sites, slots, strict=True) if row[_PARTS] > 0]
        finished = [s for s, row in zip(sites, slots, strict=True) if row[_PARTS + 1] > 0]
        participants = [s for s in sites if totals[s] > 0 and s not in refused]
        weights = {s: float(totals[s]) if s in participants else 0.0 for s in sites}
        return Seal(self.round, participants, weights, refused, finished, report, scales)
