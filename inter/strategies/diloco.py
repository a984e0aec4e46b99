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

from isthmus.inter.codecs import Codec
from isthmus.inter.commit import Seal, seal_round
from isthmus.inter.join import SiteRuntime, runtime_of
from isthmus.inter.membership import View
from isthmus.inter.strategies.base import validated
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
        sync_every: int = 50,
        outer_lr: float = 1.0,
        outer_momentum: float = 0.0,
        codec: str | Codec = "none",
        error_feedback: bool = False,
        tokens_per_step: int = 1,
        outer_device: str = "cpu",
        round_seconds: float | None = None,
        rejoin_timeout_s: float = 600.0,
    ) -> None:
        site = runtime_of(site)  # isthmus.join() gives a Site that holds one
        validated(
            "diloco",
            codec,
            sync_every=sync_every,
            outer_lr=outer_lr,
            outer_momentum=outer_momentum,
            error_feedback=error_feedback,
            round_seconds=round_seconds,
        )
        self.round_seconds = round_seconds
        self.training_over = False
        """True once a site has said, in a round's seal, that it stopped training."""
        self.last_seal: Seal | None = None
        self._steps_at_round = 0
        self._tokens = 0
        self._round_clock = time.perf_counter()
        super().__init__(
            site,
            model,
            inner_optimizer,
            sync_every=sync_every,
            outer_lr=outer_lr,
            outer_momentum=outer_momentum,
            codec=codec,
            tokens_per_step=tokens_per_step,
            outer_device=outer_device,
            error_feedback=error_feedback,
        )
        self.member = self._hold_member_rounds(rejoin_timeout_s)

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
        return {**super().state_dict(), "tokens": self._tokens}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self._tokens = int(state["tokens"])
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
        part with nothing (see :meth:`_count_round`)."""
        site = self.site
        with self._blocking("waiting"):
            seal = seal_round(
                site.step,
                round=site.next_round(),
                sites=members,
                me=site.name,
                tokens=tokens,
                dp_size=site.layout.dp,
                refuse=bad > 0,
                last=last,
                abort=abort,
            )
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
            for s in members
            if s not in seal.participants
        }
        if left_out:
            log.warning(
                "site %s: seal %d: left out of the round: %s", site.name, seal.round, left_out
            )
        if not seal.participants:
            # Nothing to average (every site took the same decision): start the
            # next round from the global parameters as they were.
            with self.member.lock:
                self.outer.reset_model()
                self._count_round(stepped=False, caught_up=caught_up)
            return
        with self._blocking("syncing"):
            # Left out: sent, but not counted (weight 0). Zeros in place of the
            # values, which a round run again may still need.
            sent = (
                deltas if site.name in seal.participants else [torch.zeros_like(d) for d in deltas]
            )
            pending = self._exchange(sent, seal.weights, vector="model", participants=members)
            report = pending.wait(abort=abort)
            with self.member.lock:
                self.outer.step(sent)
                self._count_round(stepped=True, caught_up=caught_up)
        self._account(report)

    def _count_round(self, *, stepped: bool, caught_up: bool) -> None:
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
        }

    def _load_global_state(self, state: dict[str, Any], donor: str) -> None:
        self._load_outer_state(state, donor)
        self.inner_steps = int(state["inner_steps"])
        self._steps_at_round = self.inner_steps
        self.sync_every = int(state["sync_every"])
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
