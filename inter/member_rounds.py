"""Rounds under membership views: what lets a strategy lose, regain and add sites.

A *round* is one exchange across sites and what is applied after it (an outer
step, an optimizer step); sites count the rounds they completed, the same
numbers everywhere. With a membership (``site.membership``, which ``isthmus
run`` and ``isthmus site`` set up over the control plane), every round runs
among the members of the view that holds for it (see
:mod:`isthmus.inter.membership`):

* a round that fails (a member lost, a deadline passed) is run again among the
  members of the next view, from the values this site had before it;
* a site named in a view's ``catch_up`` (a rejoin, a new site, a survivor that
  fell a round behind) first pulls the global state after ``start_round``
  rounds from the view's donor over gRPC
  (:mod:`isthmus.inter.state_transfer`), then takes part in that round with
  nothing of its own;
* every rank of a site agrees on the view, on each round's outcome and on every
  catch-up, so the ranks never part ways.

:class:`MemberRounds` is that machinery: an object every strategy holds (as
torchft's strategies hold a Manager), built in the strategy's ``__init__`` with
what only the strategy knows: what its global state is and how to take it in.
It is apart from the strategies because it is the same for all of them: how a
view is entered and agreed on by a site's ranks, how a failed round is run
again, how the state is pulled and served.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from isthmus.inter import newcomers
from isthmus.inter.allreduce import RoundError
from isthmus.inter.hierarchical import PendingAverage, RoundAborted, StepReport
from isthmus.inter.join import SiteRuntime
from isthmus.inter.membership import Membership, MembershipError, RunOver, View
from isthmus.inter.peer import PeerError
from isthmus.inter.state_transfer import (
    Fetched,
    StateGone,
    StateUnavailable,
    fetch_state,
    pack_state,
)
from isthmus.intra import collectives
from isthmus.job.layout import Layout
from isthmus.proto import wire_pb2

log = logging.getLogger(__name__)

PROBE_TIMEOUT_S = 3.0
"""How long a cut-off site waits for a member's handshake before it says it cannot
reach it."""
DONE_CHECK_S = 1.0
"""How often a site pulling the state checks whether the others are all done."""

ROUND_FAILURES = (RoundAborted, RoundError, PeerError, TimeoutError)
"""What a round that cannot finish under its view raises."""


@dataclass(frozen=True)
class CatchUp:
    """A pull of the global state from a peer, to enter a membership view."""

    view: int
    donor: str
    rounds: int
    """Rounds the pulled state is after."""
    bytes: int
    seconds: float
    resumed: int
    """Times the transfer went on from the last good byte (a broken stream, a bad part)."""


@dataclass
class EarlyExchange:
    """A round's exchange started before the round is completed (async,
    streaming), and the view it started under."""

    pending: PendingAverage | None
    epoch: int

    def take(self, view: View, caught_up: bool) -> PendingAverage | None:
        """The exchange, if the round is completed under the view it started under
        with this site's own values; else it is given up (once) and None returned."""
        pending, self.pending = self.pending, None
        if pending is not None and view.epoch == self.epoch and not caught_up:
            return pending
        if pending is not None:
            pending.discard()
        return None


Attempt = Callable[[View, bool], None]
"""Runs the round under a view: ``(view, caught_up)``; ``caught_up``: this site pulled
the global state for this round, so it has nothing of its own to send. Raises one of
:data:`ROUND_FAILURES` if the round cannot finish under that view."""


class MemberRounds:
    """The rounds of one strategy under membership views, held by the strategy.

    The strategy gives it what it cannot know itself: how to wait visibly
    (``blocking``, the strategy's span recorder) and its global state, to serve
    to a catching-up peer (``global_state``), to take in from a donor
    (``load_global_state``) and its size (``state_bytes``). ``rounds`` counts
    completed rounds; change it (and anything ``global_state`` reads) only under
    ``lock``, since the peer service serves the state from its own thread.
    Without a membership (``site.membership`` None) it only counts rounds.

    Build it last in a strategy's ``__init__``: from then on a peer may pull the
    strategy's state through it."""

    def __init__(
        self,
        site: SiteRuntime,
        *,
        layouts: Mapping[str, Layout],
        timeout_s: float,
        blocking: Callable[[str], AbstractContextManager[None]],
        global_state: Callable[[], dict[str, Any]],
        load_global_state: Callable[[dict[str, Any], str], None],
        state_bytes: Callable[[], int],
    ) -> None:
        self.site = site
        """This rank's runtime: the engine's round numbers, the peers, the loop."""
        self.membership: Membership | None = site.membership
        self._layouts = dict(layouts)
        """Every site's layout (the job's), for weights and for a donor's shares."""
        self._blocking = blocking
        self._global_state = global_state
        self._load_global_state = load_global_state
        self._state_bytes = state_bytes
        self.rounds = 0
        """Rounds completed: what membership views count."""
        self.caught_up: list[CatchUp] = []
        """Each time this site pulled the global state from a peer (a rejoin, a round
        it fell behind), newest last: for records."""
        self.timeout_s = timeout_s
        """How long a site waits for a usable membership view (quorum, readmission)
        before it gives up with :class:`MembershipError`."""
        self.leave_requested = False
        """Set (on any rank) to leave the run: at the next round this site asks the
        leader to let it go, and stops when the view without it begins."""
        self._leaving = False
        self.epoch = 0
        """The epoch of the last view this site entered."""
        self.lock = threading.Lock()
        self._served: tuple[int, str, bytes] | None = None
        self._newcomer_dp: dict[str, int] = {}
        """Sites taken in that the job file does not name -> their data-parallel ranks."""
        if self.membership is not None:
            site.endpoint.server.servicer.state_provider = self.state_after
            self.membership.probe = self._unreachable
            self.membership.take_in = self._take_in_site

    def state_dict(self) -> dict[str, Any]:
        """The round count and the view entered, for a checkpoint between rounds."""
        return {"rounds": self.rounds, "epoch": self.epoch}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.rounds = int(state["rounds"])
        self.epoch = int(state["epoch"])

    def forget_served(self) -> None:
        """(Lock held.) Drop the serialised state kept for peers: it is a round old."""
        self._served = None

    # -- a round under the view that holds for it ----------------------------------
    def as_member(self, attempt: Attempt, *, engine_rounds: int = 1) -> bool:
        """Run the round after ``self.rounds`` under the view that holds for it: run it
        again under the next view when it fails or is abandoned, after pulling the
        global state first where the view says so. ``engine_rounds``: how many
        engine rounds one attempt uses (the next view's numbers start above them).
        Returns whether this site caught up for this round. The caller counts the
        round and then calls :meth:`report_done`."""
        site = self.site
        membership = self.membership
        assert membership is not None
        self._leave_if_asked()
        caught_any = False
        while True:
            view, caught_up = self._enter_view()
            # Once caught up, this site's own values predate the pulled state: it sends
            # nothing of its own in any attempt of this round.
            caught_any = caught_any or caught_up
            membership.report(rounds=self.rounds, engine_round=site.engine_round + engine_rounds)
            rounds = self.rounds
            try:
                attempt(view, caught_any)
            except ROUND_FAILURES as exc:
                if isinstance(exc, RoundAborted) and membership.newer_view(rounds) is not None:
                    continue  # a newer view holds for this round: run it under that one
                # Failed here, or on another rank of this site (while the other sites
                # may have completed the round): ask the leader for a new view. The
                # site that did not deliver may itself be waiting on another, so
                # name only the members that do not answer a handshake now.
                others = [m for m in view.members if m != site.name]
                unreachable = self._unreachable(others)
                log.warning(
                    "site %s: round %d under view %d failed (%s); cannot reach %s; asking "
                    "for a new view",
                    site.name,
                    rounds,
                    view.epoch,
                    exc,
                    unreachable or "no one",
                )
                membership.report(phase="stuck", unreachable=unreachable)
                self._await_view_after(view, f"round {rounds} failed ({exc})")
                continue
            return caught_any

    def _leave_if_asked(self) -> None:
        membership = self.membership
        assert membership is not None
        if self._site_any(self.leave_requested) and not self._leaving:
            self._leaving = True
            membership.report(phase="leaving")
            log.warning("site %s: leaving the run at the next round, as asked", self.site.name)

    def open_round(self, *, engine_rounds: int = 1) -> tuple[View, bool]:
        """For a round whose exchange starts before it is completed (async,
        streaming): enter the view the round after ``self.rounds`` runs under,
        pulling the global state first where it says so (then this site's model
        is the pulled global one). Returns ``(view, caught_up)``; start the exchange
        under ``view`` and complete it with :meth:`complete`."""
        membership = self.membership
        assert membership is not None
        self._leave_if_asked()
        view, caught_up = self._enter_view()
        membership.report(rounds=self.rounds, engine_round=self.site.engine_round + engine_rounds)
        return view, caught_up

    def complete(
        self,
        early: EarlyExchange,
        restart: Callable[[View, bool], PendingAverage],
        apply: Callable[[StepReport, bool], None],
    ) -> bool:
        """Complete the round whose exchange ``early`` started under the view
        :meth:`open_round` gave: wait for it, unless a newer view holds for the
        round or it fails; then run it again with ``restart(view, caught_up)``
        under the next view (see :meth:`as_member`). ``apply(report, caught_up)``
        applies the average and counts the round. Returns whether this site caught
        up (pulled the state) while completing it. Without a membership it waits
        for the exchange and applies it."""
        if self.membership is None:
            assert early.pending is not None
            with self._blocking("syncing"):
                apply(early.pending.wait(), False)
            return False

        def attempt(view: View, caught_up: bool) -> None:
            pending = early.take(view, caught_up) or restart(view, caught_up)
            try:
                with self._blocking("syncing"):
                    report = pending.wait(abort=self.abandoned())
            except BaseException:
                pending.discard()
                raise
            apply(report, caught_up)

        caught_up = self.as_member(attempt)
        self.report_done()
        return caught_up

    def abandoned(self) -> Callable[[], bool]:
        """For :meth:`PendingAverage.wait`: whether the round under way (after
        ``self.rounds``, as now) must be run again under a newer view."""
        membership = self.membership
        assert membership is not None
        rounds = self.rounds
        return lambda: membership.newer_view(rounds) is not None

    def report_done(self) -> None:
        """Tell the others this site completed its rounds so far (after counting)."""
        membership = self.membership
        assert membership is not None
        membership.report(
            phase="leaving" if self._leaving else "training",
            rounds=self.rounds,
            engine_round=self.site.engine_round + 1,
            unreachable=(),
        )

    def weights(self, view: View, tokens_per_step: int) -> dict[str, float]:
        """Per-site weights, fixed by the layout, for a round under ``view``: tokens per
        step times the site's data-parallel ranks (a site added after the start as it
        describes itself), and 0 for a site that catches up at this round (it has
        nothing of its own to send). Every member derives the same from the view."""
        dp = {name: layout.dp for name, layout in self._layouts.items()} | self._newcomer_dp
        first = self.rounds == view.start_round
        weights = {
            m: 0.0 if first and m in view.catch_up else float(tokens_per_step * dp.get(m, 1))
            for m in view.members
        }
        if not any(weights.values()):  # only catching-up sites: zeros, any weights
            weights = dict.fromkeys(view.members, 1.0)
        return weights

    # -- entering views --------------------------------------------------------------
    def _agreed_view(self) -> View:
        """The view the next round runs under, the same on every rank of the site
        (each rank follows the views itself; one may have seen a new one first)."""
        membership = self.membership
        assert membership is not None
        while True:
            with self._blocking("waiting"):
                view = membership.view_for(
                    self.rounds, timeout_s=self.timeout_s, on_wait=self._say_waiting
                )
            if self.site.layout.size == 1:
                return view
            epochs = collectives.all_reduce_values(
                [-view.epoch, view.epoch],
                op=dist.ReduceOp.MAX,
                group=self.site.wait_group,
                device=self.site.device,
                dtype=torch.int64,
                where="member_rounds.view_epochs",
            )
            lowest, highest = -int(epochs[0]), int(epochs[1])
            if lowest == highest:
                return view
            if view.epoch < highest:
                membership.wait_for_newer(view.epoch, self.timeout_s)

    def _enter_view(self) -> tuple[View, bool]:
        """The view this round runs under, entered: a new one moves the engine to its
        round numbers, and first pulls the global state where it says to."""
        site = self.site
        membership = self.membership
        assert membership is not None
        caught_up = False
        while True:
            view = self._agreed_view()
            if view.epoch == self.epoch:
                return view, caught_up
            problem = ""
            try:
                if site.name in view.catch_up:
                    # The members send this view's rounds as soon as they get there:
                    # take them from now on, while the state comes.
                    if view.engine_round > site.engine_round:
                        site.skip_to_round(view.engine_round)
                    self._catch_up(view)
                    caught_up = True
                elif self.rounds > view.start_round:
                    problem = f"this site completed {self.rounds} rounds"
            except StateGone as exc:
                problem = str(exc)
            if self._site_any(bool(problem)):
                # The view was decided on stale reports: say how far this site (or its
                # donor) got, and let the leader decide again.
                log.warning(
                    "site %s: cannot enter view %d at round %d: %s; asking for a new one",
                    site.name,
                    view.epoch,
                    view.start_round,
                    problem or "another rank of this site could not",
                )
                membership.report(conflict=view.epoch, rounds=self.rounds)
                self._await_view_after(view, f"view {view.epoch} could not be entered")
                continue
            if view.engine_round > site.engine_round:
                site.skip_to_round(view.engine_round)
            self.epoch = view.epoch
            membership.report(conflict=None)
            return view, caught_up

    def _await_view_after(self, view: View, what: str) -> None:
        """Wait for the leader's next view after ``view``; raise if none comes."""
        membership = self.membership
        assert membership is not None
        with self._blocking("waiting"):
            if membership.wait_for_newer(view.epoch, self.timeout_s) is None:
                raise MembershipError(
                    f"site {self.site.name}: {what} and no new membership view came within "
                    f"{self.timeout_s:g} s"
                )

    def _unreachable(self, sites: Sequence[str]) -> list[str]:
        """Which of ``sites`` do not answer a handshake within ``PROBE_TIMEOUT_S``."""

        async def answers(name: str) -> bool:
            try:
                await asyncio.wait_for(self.site.client_for(name).hello(), PROBE_TIMEOUT_S)
            except (PeerError, TimeoutError):
                return False
            return True

        async def probe() -> list[bool]:
            return await asyncio.gather(*(answers(name) for name in sites))

        return [name for name, ok in zip(sites, self.site.loop.run(probe()), strict=True) if not ok]

    def _take_in_site(self, name: str, description: Any) -> str | None:
        """Make this rank ready to exchange with a site added to the job after it
        started (see :mod:`isthmus.inter.newcomers`); say why it cannot be."""
        site = self.site
        layout = site.layout
        new = newcomers.parse(name, description, tp=layout.tp, pp=layout.pp)
        if isinstance(new, str):
            return new
        lanes = new.lane_addresses(site.lanes, site.step.my_lanes, layout.coordinates(site.rank))
        if isinstance(lanes, str):
            return lanes
        site.loop.run(site.endpoint.add_site(name, lanes))
        self._newcomer_dp[name] = new.layout.dp
        return None

    def _site_any(self, flag: bool) -> bool:
        """Whether ``flag`` is set on any rank of the site (a collective when it has
        several)."""
        if self.site.layout.size == 1:
            return flag
        value = collectives.all_reduce_values(
            [int(flag)],
            op=dist.ReduceOp.MAX,
            group=self.site.wait_group,
            device=self.site.device,
            dtype=torch.int64,
            where="member_rounds.site_any",
        )
        return bool(value.item())

    def _say_waiting(self, why: str) -> None:
        log.warning("site %s: %s", self.site.name, why)

    # -- the global state, pulled and served ---------------------------------------
    def _catch_up(self, view: View) -> None:
        """Pull the global state after ``view.start_round`` rounds from the view's donor."""
        site = self.site
        assert view.donor is not None
        donor_layout = self._layouts[view.donor]
        if not state_transferable(donor_layout, site.layout):
            raise MembershipError(
                f"site {site.name}: the state is pulled rank by rank, from the donor's rank "
                f"that holds the same share of the model; the donor {view.donor} has "
                f"{donor_layout} and this site {site.layout}, which shard it differently. "
                f"Give the sites the same layout, or leave dp_shard at 1 on both"
            )
        with self._blocking("waiting"):
            fetched = site.loop.run(self._fetch_while_others_train(view))
        with self.lock:
            self._load_global_state(fetched.state, view.donor)
            self._served = None
        self.caught_up.append(
            CatchUp(
                view=view.epoch,
                donor=view.donor,
                rounds=self.rounds,
                bytes=fetched.bytes,
                seconds=fetched.seconds,
                resumed=fetched.resumed,
            )
        )
        log.info(
            "site %s: pulled the state after %d rounds from %s (%d bytes in %.2f s)",
            site.name,
            self.rounds,
            view.donor,
            fetched.bytes,
            fetched.seconds,
        )

    async def _fetch_while_others_train(self, view: View) -> Fetched:
        """The donor's state after ``view.start_round`` rounds; raises
        :class:`MembershipError` once every other site is done training, as no donor
        will get there then (a site let back in just as the others finish)."""
        membership = self.membership
        assert membership is not None and view.donor is not None
        expected = self._state_bytes()
        fetch = asyncio.ensure_future(
            fetch_state(
                self.site.client_for(view.donor),
                view.start_round,
                deadline_s=self.timeout_s,
                max_bytes=expected + (1 << 20) + expected // 10,
            )
        )
        try:
            while not (await asyncio.wait({fetch}, timeout=DONE_CHECK_S))[0]:
                if membership.others_done():
                    raise RunOver(
                        f"site {self.site.name}: every other site finished training before "
                        f"this site could pull the state after {view.start_round} rounds "
                        f"from {view.donor} (view {view.epoch} let it back in too late); "
                        f"it ends with the model it had after {self.rounds} rounds"
                    )
            return fetch.result()
        finally:
            fetch.cancel()

    def state_after(self, rounds: int) -> tuple[str, bytes]:
        """The global state after ``rounds`` rounds, serialised (what a catching-up
        peer pulls; see :mod:`isthmus.inter.state_transfer`). Called from the peer
        service's thread: the state only changes under the lock, and the round after
        this one cannot finish before the peer that asks for it has caught up."""
        with self.lock:
            if self.rounds < rounds:
                raise StateUnavailable(
                    wire_pb2.STATE_NOT_READY,
                    f"site {self.site.name} has completed {self.rounds} rounds, not {rounds} yet",
                )
            if self.rounds > rounds:
                raise StateUnavailable(
                    wire_pb2.STATE_GONE,
                    f"site {self.site.name} is past round {rounds} ({self.rounds} completed)",
                )
            if self._served is None or self._served[0] != rounds:
                digest, blob = pack_state({"rounds": self.rounds, **self._global_state()})
                self._served = (rounds, digest, blob)
            return self._served[1], self._served[2]


def state_transferable(donor: Layout, mine: Layout) -> bool:
    """Whether each rank of a site of layout ``mine`` finds its share of the global
    state on the donor rank it shares its first lane with. That rank has the same
    pipeline and tensor coordinates (equal across the job); its data-parallel index
    may differ, which matters only where the data-parallel ranks shard the state.
    So: the same layout, or replicas on both sides (a 2-rank site may feed a
    1-rank one)."""
    return donor == mine or (
        (donor.pp, donor.tp) == (mine.pp, mine.tp) and donor.dp_shard == mine.dp_shard == 1
    )


def shapes_match(site: str, donor: str, mine: Iterator[torch.Tensor], theirs: Any) -> None:
    """Raise :class:`MembershipError` unless the donor's tensors ``theirs`` have the
    shapes of this site's ``mine``."""
    ours = [tuple(t.shape) for t in mine]
    got = [tuple(t.shape) for t in theirs] if isinstance(theirs, list | tuple) else None
    if got != ours:
        raise MembershipError(
            f"site {site}: the state from {donor} has parameter shapes that differ from "
            "this site's model; every site must run the same model"
        )
