"""AsyncDiLoCo: DiLoCo whose exchange hides behind the next round's compute.

Round k's pseudo-gradient leaves in the background at the end of round k and
is applied at the end of round k + 1 (delayed Nesterov), with the local
progress made meanwhile kept on top of the new global parameters: on a slow
link the training never waits for the exchange, at the price of one round of
staleness. A site that missed a round may carry its lost pseudo-gradient into
its next contribution (``late_contributions``).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from isthmus.inter.hierarchical import PendingAverage, StepReport
from isthmus.inter.join import SiteRuntime, runtime_of
from isthmus.inter.member_rounds import EarlyExchange
from isthmus.inter.membership import View
from isthmus.inter.state_transfer import StateUnavailable
from isthmus.inter.strategies.base import configure, settings_doc, static_weights
from isthmus.inter.strategies.local_steps import LocalSteps
from isthmus.proto import wire_pb2

log = logging.getLogger(__name__)


class AsyncDiLoCo(LocalSteps):
    """DiLoCo whose exchange hides behind the next round's compute.

    At the end of round k the pseudo-gradient leaves in the background and the
    site keeps training; at the end of round k + 1 the averaged pseudo-gradient
    of round k is applied to the global parameters (one round late: delayed
    Nesterov), and the local progress made meanwhile is kept on top of them
    (``local = global + (local - local at the send)``), so no compute is lost.
    The global parameters stay bitwise identical on every site.

    With a membership (``site.membership``), each exchange is a round (see
    :mod:`isthmus.inter.member_rounds`) that starts under the view holding for
    it; if that view is replaced or a member is lost while it is in flight, it
    is run again when it is due, from the pseudo-gradient this site sent. A site
    that catches up pulls the outer state and the step at which the others sent
    the round, takes part in it at once with nothing of its own, and trains on
    from that step.

    A site that missed a round (``round_deadline_s`` passed and the others went
    on without it) had sent a pseudo-gradient that no one applied. With
    ``late_contributions="drop"`` it is lost; with ``"stale"`` the site adds it,
    times ``staleness_weight``, to its next contribution, so its compute still
    counts, one round late and damped. Either way the global parameters stay the
    same everywhere: a contribution is only ever this site's own vector in an
    average that every member computes alike.
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
        settings, codec = configure("async", settings, site)
        site = runtime_of(site)  # isthmus.join() gives a Site that holds one
        self.late_contributions = settings.late_contributions
        self.staleness_weight = float(settings.staleness_weight)
        self.late_contributions_applied = 0
        """Late pseudo-gradients this site added to a later contribution."""
        self._late: list[torch.Tensor] | None = None
        """This site's pseudo-gradient of a round it missed, until its next send."""
        self._flight: _AsyncExchange | None = None
        super().__init__(
            site,
            model,
            inner_optimizer,
            settings=settings,
            codec=codec,
            tokens_per_step=tokens_per_step,
        )
        self.weights = static_weights(self.layouts, tokens_per_step)
        self._sent_at = 0
        """The inner step at which the exchange in flight was sent."""
        self._resume: dict[str, Any] | None = None
        """The exchange a checkpoint caught in flight, to send again (see
        :meth:`load_state_dict`)."""
        self.member = self._hold_member_rounds(settings.rejoin_timeout_s)

    def state_dict(self) -> dict[str, Any]:
        """Also the exchange in flight: the pseudo-gradient sent, the local
        parameters at the send, and the site's round counter and error feedback as
        they were before it (a resumed run sends it again from there); and a missed
        round's pseudo-gradient still to be carried (``late_contributions="stale"``)."""
        state = {**super().state_dict(), "sent_at": self._sent_at}
        if self._late is not None:
            state["late"] = self._late
        if self._flight is not None:
            state["site"] = self._flight.site_state
            state["in_flight"] = {"sent": self._flight.sent, "anchor": self._flight.anchor}
        elif self._resume is not None:
            # Loaded and not sent again yet (that is at the next step): the site's
            # state is already the one from before it.
            state["in_flight"] = self._resume
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Go on from :meth:`state_dict`; the exchange it caught in flight is sent again
        at the next step, with the values and round number it had."""
        super().load_state_dict(state)
        self._sent_at = int(state["sent_at"])
        self._resume = state.get("in_flight")
        self._late = state.get("late")

    def _after_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self.inner_steps += 1
        if self._resume is not None:
            resumed, self._resume = self._resume, None
            self._send(resumed)
        if self._round_due():
            if self._complete():
                return  # caught up: this site now stands where the others sent the round
            self._send()

    def _send(self, resumed: dict[str, Any] | None = None) -> None:
        """Send this round's pseudo-gradient in the background (under the view that
        holds for it, entered first), or the one a checkpoint caught in flight."""
        view = None
        if self.member.membership is not None:
            view, _ = self.member.open_round()  # a site that caught up has the global model
        site_state = self.site.state_dict(copy=False)
        with self._blocking("syncing"):  # host work on the training thread
            if resumed is None:
                deltas = self.outer.pseudo_gradients()
                anchor = [p.detach().clone() for p in self.params]
                if self._late is not None:
                    for d, late in zip(deltas, self._late, strict=True):
                        d.add_(late.to(d.device, d.dtype), alpha=self.staleness_weight)
                    self._late = None
                    self.late_contributions_applied += 1
                    log.info(
                        "site %s: round %d carries this site's missed round's "
                        "pseudo-gradient at weight %g",
                        self.site.name,
                        self.member.rounds,
                        self.staleness_weight,
                    )
            else:
                # Back from a checkpoint in host memory: onto the devices they left.
                deltas = [d.to(self.outer.device) for d in resumed["sent"]]
                anchor = [
                    a.to(p.device) for a, p in zip(resumed["anchor"], self.params, strict=True)
                ]
            pending = self._exchange_in_view(deltas, self.weights, vector="model", view=view)
        with self.member.lock:
            self._flight = _AsyncExchange(
                deltas,
                anchor,
                EarlyExchange(pending, view.epoch if view is not None else 0),
                site_state,
            )
            if resumed is None:
                self._sent_at = self.inner_steps

    @torch.no_grad()
    def _complete(self) -> bool:
        """Apply the exchange in flight, if any; returns whether this site caught up
        meanwhile (then it stands at the step the others sent the round at)."""
        flight = self._flight
        if flight is None:
            return False

        def apply(report: StepReport, caught_up: bool) -> None:
            self._account(report)
            with self.member.lock:
                self._flight = None
                if caught_up:  # the model is the pulled global one
                    self.outer.step(flight.sent)
                else:
                    self.outer.step(flight.sent, reset=False)
                    for p, g, a in zip(
                        self.params, self.outer.global_params, flight.anchor, strict=True
                    ):
                        p.add_(g.to(p.device, p.dtype) - a)  # local = global + progress since
                self.outer_steps += 1
                self.member.rounds += 1

        def restart(view: View, caught_up: bool) -> PendingAverage:
            if caught_up and flight.own:  # the others' round, with nothing of this site's
                if self.late_contributions == "stale":
                    self._late = flight.sent
                    log.warning(
                        "site %s: missed round %d; its pseudo-gradient (norm %.6g) goes into "
                        "its next contribution at weight %g (late_contributions: stale)",
                        self.site.name,
                        self.member.rounds,
                        math.sqrt(sum(float(t.double().square().sum()) for t in flight.sent)),
                        self.staleness_weight,
                    )
                flight.sent = self.outer.pseudo_gradients()
                flight.own = False
            return self._exchange_in_view(flight.sent, self.weights, vector="model", view=view)

        return self.member.complete(flight.early, restart, apply)

    def _global_state(self) -> dict[str, Any]:
        if self._flight is None:
            # Between applying a round and sending the next (a site that caught up
            # sends it a round's steps later): not the state of a round's start.
            raise StateUnavailable(
                wire_pb2.STATE_NOT_READY,
                f"site {self.site.name} has not sent round {self.member.rounds} yet",
            )
        return {
            "outer_steps": self.outer_steps,
            "sent_at": self._sent_at,
            "sync_every": self.sync_every,
            "outer": self.outer.state_dict(),
        }

    def _load_global_state(self, state: dict[str, Any], donor: str) -> None:
        self._load_outer_state(state, donor)
        self.inner_steps = self._sent_at = int(state["sent_at"])
        self.sync_every = int(state["sync_every"])

    def rejoin(self) -> int:
        """For a site that (re)starts while the others train: wait to be admitted, pull
        the global state, and take part in the round it was admitted at (with nothing
        of its own to send). Returns the inner step to train on from: where the others
        sent that round."""
        self._send()
        self._complete()
        return self.inner_steps

    def finish(self) -> None:
        """Apply what is in flight, then one synchronous round for the steps taken
        since the last send, so every site ends with the same, global, parameters."""
        self._complete()
        if self.round_steps == 0:
            # No steps since the last send: the model is the global one, up to
            # the rounding of global + (local - anchor); make it exact.
            self.outer.reset_model()
            return
        with self._blocking("syncing"):
            deltas = self.outer.pseudo_gradients()
        if self.member.membership is None:
            with self._blocking("syncing"):
                self._account(self._exchange(deltas, self.weights, vector="final").wait())
                self.outer.step(deltas)
            self.outer_steps += 1
            return
        self._final_round(deltas, None, self.weights)


@dataclass
class _AsyncExchange:
    sent: list[torch.Tensor]
    """This site's pseudo-gradient (the average, once completed)."""
    anchor: list[torch.Tensor]
    """The local parameters when it was sent."""
    early: EarlyExchange
    site_state: dict[str, Any]
    """The site's round counter and error feedback before it was sent: a checkpoint
    that catches it in flight goes back to them."""
    own: bool = True
    """Whether ``sent`` is still this site's own pseudo-gradient (not the zeros of a
    site that caught up and takes part with nothing of its own)."""


AsyncDiLoCo.__doc__ = (AsyncDiLoCo.__doc__ or "") + settings_doc("async")
