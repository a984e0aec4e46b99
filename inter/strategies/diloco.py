"""DiLoCo across sites: local steps, then an outer step on the averaged pseudo-gradient.

Each round is sealed first (:mod:`isthmus.inter.commit`): every site says how
many tokens it trained on and whether its pseudo-gradient is finite, and the
seal fixes who takes part and with what weight, the same on every site. So a
site with NaN/Inf values or no tokens is left out of the average by all alike,
and rounds may be time-budgeted (``round_seconds``): a slow site takes fewer
steps instead of holding the others up.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from isthmus.inter.commit import PendingSeal, Seal, start_seal
from isthmus.inter.hierarchical import PendingAverage
from isthmus.inter.join import SiteRuntime, runtime_of
from isthmus.inter.membership import View
from isthmus.inter.strategies.base import configure, settings_doc
from isthmus.inter.strategies.local_steps import LocalSteps
from isthmus.intra import collectives

log = logging.getLogger(__name__)


class DiLoCo(LocalSteps):
    """Local SGD across sites (Douillard et al., 2023): ``sync_every`` inner steps,
    then an outer step on the averaged pseudo-gradient.

    With ``round_seconds``, a round also ends once that much time has passed
    since the last one (``sync_every`` is then the most steps a round takes): a
    slow site takes fewer steps instead of holding the others up, and each
    site's contribution is weighted by the tokens it trained on (the ranks of a
    site agree on the step with a one-value all-reduce per step). Sites then end
    their loops at different steps, so the seal carries who is done: when one
    site's loop ends (leaving the ``with`` block runs its last round), every
    other site learns it at that round and :attr:`training_over` turns True;
    stop the loop then::

        for x, y in loader:
            ...
            inner_optimizer.step()
            if diloco.training_over:
                break
    """

    def __init__(
        self,
        site: SiteRuntime,
        model: nn.Module,
        inner_optimizer: torch.optim.Optimizer,
        *,
        tokens_per_step: int = 1,
        **settings: Any,
    ) -> None:
        settings, codec = configure("diloco", settings, site)
        site = runtime_of(site)  # isthmus.join() gives a Site that holds one
        self.round_seconds = settings.round_seconds
        self.training_over = False
        """True once a site has said, in a round's seal, that it stopped training."""
        self.last_seal: Seal | None = None
        self._scale_tokens: int | None = None
        """The scale the sites send their data at beside the round's vote; None
        until a round has completed (that round's vote goes first)."""
        self._steps_at_round = 0
        self._tokens = 0
        self._round_clock = time.perf_counter()
        super().__init__(
            site,
            model,
            inner_optimizer,
            settings=settings,
            codec=codec,
            tokens_per_step=tokens_per_step,
        )
        self.member = self._hold_member_rounds(settings.rejoin_timeout_s)

    def __enter__(self) -> DiLoCo:
        self._round_clock = time.perf_counter()  # the first round starts with training
        return self

    def _after_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self.inner_steps += 1
        self._tokens += self.tokens_per_step
        if self._round_due():
            self.sync()

    def _round_due(self) -> bool:
        if super()._round_due():
            return True
        if self.round_seconds is None:
            return False
        over = time.perf_counter() - self._round_clock >= self.round_seconds
        if self.site.layout.size > 1:
            # Every rank of the site must end the round at the same step, and their
            # clocks differ: the site ends it when its first rank's time is up (a
            # one-value all-reduce per step over the fast fabric).
            flag = collectives.all_reduce_values(
                [1.0 if over else 0.0],
                op=dist.ReduceOp.MAX,
                device=self.site.device,
                where="diloco.round_seconds",
            )
            over = bool(flag.item())
        if not over:
            return False
        self.round_steps = 0
        return True

    def add_tokens(self, count: int) -> None:
        """Count tokens beyond ``tokens_per_step`` (batches of varying size)."""
        self._tokens += count

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "tokens": self._tokens, "scale_tokens": self._scale_tokens}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self._tokens = int(state["tokens"])
        # A checkpoint from before the scale was kept: the first round votes alone.
        self._scale_tokens = state.get("scale_tokens")
        # What a catching-up site pulls from this one: the step count at the last
        # round. Left at 0, a site resumed from a checkpoint and asked to give the
        # state before completing a round here sent step 0, and its puller went on
        # that many steps behind the others (and ended on another model).
        self._steps_at_round = self.inner_steps - self.round_steps
        self._round_clock = time.perf_counter()

    def sync(self, *, last: bool = False) -> None:
        """Run one round now: seal, average the pseudo-gradients, outer step.
        ``last``: this site stops training after it (``finish`` says so).

        A site whose pseudo-gradient is not finite (on any of its ranks) refuses
        its contribution, and a site with no tokens since the last round has
        none: the seal leaves both out, on every site alike, and they take the
        round's average like the others. If no site has a contribution, the
        global parameters stay as they were.

        With a membership (``site.membership``, which ``isthmus run`` sets up over
        the control plane), the round runs among the members of the view that
        holds for it: a site lost mid-round makes the others run it again
        without it, and a site that rejoins or fell behind pulls the global
        state from a member first (see :mod:`isthmus.inter.membership`)."""
        site = self.site
        if self.training_over:
            seal = self.last_seal
            assert seal is not None
            raise RuntimeError(
                f"site {site.name}: training is over (sites {seal.finished} stopped at seal "
                f"{seal.round}) and the other sites have left; end the training loop when "
                "training_over is True"
            )
        with self._blocking("syncing"):
            deltas = self.outer.pseudo_gradients()
            bad = _nonfinite(deltas)
        if self.member.membership is None:
            self._round(list(self.layouts), deltas, bad, self._tokens, last)
        else:
            self._round_as_member(deltas, bad, last)
        self._tokens = 0
        self._round_clock = time.perf_counter()

    def _round(
        self,
        members: Sequence[str],
        deltas: list[torch.Tensor],
        bad: int,
        tokens: int,
        last: bool,
        abort: Callable[[], bool] | None = None,
        caught_up: bool = False,
    ) -> None:
        """One round among ``members``: seal, average, outer step. With ``abort``,
        raises :class:`RoundAborted` when it says so, before anything is applied.
        ``caught_up``: this site pulled the global state for this round and takes
        part with nothing (see :meth:`_count_round`).

        Once the sites share a scale (from the first round on, see
        :meth:`_count_round`), the data go beside the vote instead of after it: each
        site sends its pseudo-gradient times its tokens over the scale, and the
        mean the engine returns becomes the token-weighted average once the seal
        says the total. On long links that saves a round trip a round: the vote and
        the data each take one."""
        scale = self._scale_tokens  # the same on every member: global state
        if scale is None:
            # No scale shared yet: the vote alone, waited for, before any data leave.
            seal = self._seal_waited(self._start_vote(members, tokens, bad, last), bad, abort)
            self._apply(members, seal, deltas, None, abort, caught_up)
            return
        site_tokens, refusing = self._site_counts(tokens, bad > 0)
        contributes = site_tokens > 0 and not refusing
        vote = self._start_vote(members, tokens, bad, last, scale)
        # Left out: zeros, and no error feedback (what the codec lost last time
        # waits for a round the site counts in).
        sent = deltas if contributes else [torch.zeros_like(d) for d in deltas]
        data = self._exchange(
            sent,
            {s: 1.0 for s in members},
            vector="model" if contributes else None,
            participants=members,
            scale=site_tokens / scale if contributes else 1.0,
        )
        try:
            seal = self._seal_waited(vote, bad, abort)
        except BaseException:
            data.discard()
            raise
        self._apply(members, seal, sent, data, abort, caught_up)

    def _site_counts(self, tokens: int, refuse: bool) -> tuple[int, bool]:
        """The site's tokens since the last round and whether any of its ranks
        refuses, on every rank of the site (what the vote will say of it)."""
        if self.site.layout.dp == 1:
            return tokens, refuse
        counts = collectives.all_reduce_values(
            [float(tokens), 1.0 if refuse else 0.0],
            group=self.site.step.dp_group,
            device=self.site.device,
            where="diloco.site_counts",
        )
        return int(counts[0].item()), counts[1].item() > 0

    def _start_vote(
        self, members: Sequence[str], tokens: int, bad: int, last: bool, scale: int = 0
    ) -> PendingSeal:
        """Start the round's vote (``scale``: the data's, when they go beside it)."""
        site = self.site
        return start_seal(
            site.step,
            round=site.next_round(),
            sites=members,
            me=site.name,
            tokens=tokens,
            dp_size=site.layout.dp,
            refuse=bad > 0,
            last=last,
            scale_tokens=scale,
        )

    def _seal_waited(self, vote: PendingSeal, bad: int, abort: Callable[[], bool] | None) -> Seal:
        site = self.site
        with self._blocking("waiting"):
            seal = vote.wait(abort)
        self._account(seal.report)
        self.last_seal = seal
        self.training_over = bool(seal.finished)
        if bad:
            log.warning(
                "site %s: seal %d: this rank's pseudo-gradient holds %d NaN/Inf values; the "
                "site's contribution is left out and its model reset to the global one",
                site.name,
                seal.round,
                bad,
            )
        left_out = {
            s: "refused its contribution (NaN/Inf)" if s in seal.refused else "trained no tokens"
            for s in seal.weights
            if s not in seal.participants
        }
        if left_out:
            log.warning(
                "site %s: seal %d: left out of the round: %s", site.name, seal.round, left_out
            )
        return seal

    def _apply(
        self,
        members: Sequence[str],
        seal: Seal,
        sent: list[torch.Tensor],
        beside: PendingAverage | None,
        abort: Callable[[], bool] | None,
        caught_up: bool,
    ) -> None:
        """Finish the round the seal decided: the data round ``beside`` the vote
        (values scaled by the shared scale), or, where there was none or the
        participants' scales differ, a data round of its own weighted by the seal;
        then the outer step."""
        site = self.site
        if beside is not None:
            with self._blocking("syncing"):
                report = beside.wait(abort=abort)
            self._account(report)
        if beside is None and any(seal.scale_tokens.values()):
            # The others sent the round's data beside the vote, which this site
            # cannot join: its state came without their scale (from an older
            # Isthmus, or a bug). Averaging apart would part the models silently.
            raise RuntimeError(
                f"site {site.name}: seal {seal.round}: the other sites sent the round's "
                f"data beside the vote (scales {seal.scale_tokens}) but this site holds "
                "no scale; restart every site from the same checkpoint or version"
            )
        if not seal.participants:
            # Nothing to average (every site took the same decision): start the
            # next round from the global parameters as they were.
            with self.member.lock:
                self.outer.reset_model()
                self._count_round(seal, stepped=False, caught_up=caught_up)
            return
        shared = seal.shared_scale()
        if beside is not None and shared is not None:
            # The engine's mean over the members of tokens/scale times the values:
            # times the members' count and the scale over the total, the weighted
            # average (the same arithmetic on every site: bitwise-identical results).
            factor = len(members) * shared / seal.total
            for t in sent:
                t.mul_(factor)
        else:
            if beside is not None:
                log.warning(
                    "site %s: seal %d: the sites sent their data at different scales "
                    "(%s); averaging the round again with the seal's weights",
                    site.name,
                    seal.round,
                    seal.scale_tokens,
                )
                # The round beside the vote wrote its mean over the values: take
                # them again, in place (nothing was applied; the model is as it
                # was), so that a round run again after this one fails sends them
                # and not that mean. (What the codec lost in the discarded round
                # stays kept for error feedback: one round's rounding, once.)
                for t, fresh in zip(sent, self.outer.pseudo_gradients(), strict=True):
                    t.copy_(fresh)
            if site.name not in seal.participants:
                # Left out: sent, but not counted (weight 0). Zeros in place of the
                # values, which a round run again may still need.
                sent = [torch.zeros_like(d) for d in sent]
            with self._blocking("syncing"):
                pending = self._exchange(sent, seal.weights, vector="model", participants=members)
                report = pending.wait(abort=abort)
            self._account(report)
        with self.member.lock:
            self.outer.step(sent)
            self._count_round(seal, stepped=True, caught_up=caught_up)

    def _count_round(self, seal: Seal, *, stepped: bool, caught_up: bool) -> None:
        """Under the state lock: a round is complete. A site that caught up for it took
        part with nothing while the others trained the round's steps: it goes on from
        their step. That step is counted here, under the lock, with the round: a site
        may pull this one's state as soon as the round is counted (it is the donor of
        the next view), and it must get the others' step. Counted after the lock was
        let go, a site that caught up from a donor which had itself just caught up
        went on a round's steps behind everyone, trained one round more than they did
        and waited alone for it at the end."""
        if caught_up:
            self.inner_steps += self.sync_every
        if seal.participants:
            # The scale the next round's data go at, beside its vote: the
            # participants' mean count, which every member reads from this seal
            # (and a site that catches up pulls with the state), so the sites'
            # values leave near their own size (fp16 keeps its range) and share it.
            self._scale_tokens = max(1, round(seal.total / len(seal.participants)))
            if self.site.name in seal.participants:
                self._set_batch_share(seal.weights[self.site.name] / seal.total)
        self.outer_steps += stepped
        self.member.rounds += 1
        self._steps_at_round = self.inner_steps

    # -- membership: site loss, rejoin, quorum ---------------------------------------
    def _round_as_member(self, deltas: list[torch.Tensor], bad: int, last: bool) -> None:
        """The round under the membership view that holds for it (see
        :mod:`isthmus.inter.member_rounds`); a site that catches up takes part with
        nothing (zero pseudo-gradient, no tokens)."""
        tokens = self._tokens

        def attempt(view: View, caught_up: bool) -> None:
            if caught_up:  # the model is the pulled global one: zeros
                self._round(
                    view.members,
                    self.outer.pseudo_gradients(),
                    0,
                    0,
                    last,
                    abort=self.member.abandoned(),
                    caught_up=True,
                )
            else:
                self._round(view.members, deltas, bad, tokens, last, abort=self.member.abandoned())

        self.member.as_member(attempt)
        self.member.report_done()

    def _global_state(self) -> dict[str, Any]:
        return {
            "outer_steps": self.outer_steps,
            "inner_steps": self._steps_at_round,
            "sync_every": self.sync_every,
            "outer": self.outer.state_dict(),
            "scale_tokens": self._scale_tokens,
        }

    def _load_global_state(self, state: dict[str, Any], donor: str) -> None:
        self._load_outer_state(state, donor)
        self.inner_steps = int(state["inner_steps"])
        self._steps_at_round = self.inner_steps
        self.sync_every = int(state["sync_every"])
        self._scale_tokens = state.get("scale_tokens")
        self._tokens = 0

    def rejoin(self) -> int:
        """For a site that (re)starts while the others train: wait to be admitted,
        pull the global state, and take part in the round it was admitted at (with
        nothing of its own to contribute). Returns the inner step to train on from,
        the same as the other sites'."""
        self._tokens = 0
        deltas = self.outer.pseudo_gradients()
        self._round_as_member([d.zero_() for d in deltas], 0, False)
        self._round_clock = time.perf_counter()
        return self.inner_steps

    def finish(self) -> None:
        """The last round, for the steps since the previous one. With time-budgeted
        rounds it always runs: it tells the other sites that training is over."""
        if self.training_over:
            return  # the round that said so was the last one
        if self._tokens or self.round_seconds is not None:
            self.sync(last=True)


def _nonfinite(tensors: Sequence[torch.Tensor]) -> int:
    """How many values of ``tensors`` are NaN or infinite."""
    return sum(int(t.numel() - torch.isfinite(t).sum()) for t in tensors)


DiLoCo.__doc__ = (DiLoCo.__doc__ or "") + settings_doc("diloco")
