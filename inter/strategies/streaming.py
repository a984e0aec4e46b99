"""Streaming DiLoCo: DiLoCo in fragments that sync at staggered steps, overlapped.

The model is cut into ``fragments`` parts (strided over its numbered blocks,
:mod:`isthmus.inter.fragments`); each part's exchange starts at its own offset
in the round and overlaps ``overlap_steps`` inner steps, so the link carries a
fraction of the model at a time and the training seldom waits on it. The
averaged fragment is merged into the local parameters: mixed with them by a
factor (``merge: mix``, the paper's), or, ``merge: eager``, taken as the new
global parameters plus the progress the site made while it was on the wire.

With one fragment this is DiLoCo with its exchange overlapped: up to a whole
round (``overlap_steps == sync_every``) the sites train on while the average
travels, and never wait for a wire that is faster than a round.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from isthmus.inter.fragments import assign_fragments, count_blocks
from isthmus.inter.hierarchical import PendingAverage, StepReport
from isthmus.inter.join import SiteRuntime, runtime_of
from isthmus.inter.member_rounds import EarlyExchange
from isthmus.inter.membership import View
from isthmus.inter.strategies.base import configure, settings_doc, static_weights
from isthmus.inter.strategies.local_steps import LocalSteps
from isthmus.job.setting_groups import sync_offsets
from isthmus.job.settings import SettingError


class StreamingDiLoCo(LocalSteps):
    """Streaming DiLoCo (Douillard et al., 2025): DiLoCo in ``fragments`` parts that
    sync at staggered steps, each exchange overlapping ``overlap_steps`` inner steps,
    the result merged into the local parameters as ``merge`` says:

    - ``mix``: ``local = alpha * local + (1 - alpha) * global`` (the paper's);
    - ``eager``: ``local = global + (local - sent)``, where ``sent`` is the
      fragment as it stood when its exchange started. The steps the site took
      meanwhile went on from its own result (its pseudo-gradient standing in for
      the average, an eager update); when the average arrives it replaces that
      stand-in and the progress since is kept, to be sent in the next round.
      It costs one copy of the fragment while its exchange is in flight.

    Lower-precision codecs (e.g. ``int4``) suit it: values are decoded and
    accumulated in float32. All sites take the same number of inner steps between
    exchanges, so the weights come from the layout (tokens per step times ranks).

    With a membership (``site.membership``), each fragment's exchange is a round
    (see :mod:`isthmus.inter.member_rounds`): it starts under the view that holds
    for it and, if that view is replaced or a member is lost while it is in
    flight, it is run again when it is due, from the pseudo-gradient this site
    sent. The schedule fixes at which step round ``r`` starts, so a site that
    catches up needs only the outer state and the round count.
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
        # The general rules first (the checks below rely on them), then what only a
        # strategy holding the model can check.
        settings, codec = configure("streaming", settings, site)
        site = runtime_of(site)  # isthmus.join() gives a Site that holds one
        sync_every, fragments = settings.sync_every, settings.fragments
        overlap_steps = settings.overlap_steps
        self.fragments = fragments
        names = [n for n, p in model.named_parameters() if p.requires_grad]
        blocks = count_blocks(names)
        if fragments > max(1, blocks):
            raise SettingError(
                "fragments",
                f"{fragments} fragments, but the model has {blocks} layers (numbered blocks); "
                f"use fragments <= {max(1, blocks)}",
            )
        super().__init__(
            site,
            model,
            inner_optimizer,
            settings=settings,
            codec=codec,
            tokens_per_step=tokens_per_step,
        )
        self.overlap_steps = overlap_steps
        self.alpha = float(settings.alpha)
        self.merge = settings.merge
        assignment = assign_fragments(names, fragments)
        self.members = [[i for i, f in enumerate(assignment) if f == p] for p in range(fragments)]
        self.offsets = sync_offsets(sync_every, fragments)
        self.weights = static_weights(self.layouts, tokens_per_step)
        self._in_flight: list[_FragmentExchange] = []
        """At most one: an exchange ends before the next one starts."""
        self._started_at = [0] * fragments
        """The inner step at which each fragment's last exchange started."""
        self._resume: dict[str, Any] | None = None
        """An exchange a checkpoint caught in flight, to start again (see
        :meth:`load_state_dict`)."""
        self.member = self._hold_member_rounds(settings.rejoin_timeout_s)

    def state_dict(self) -> dict[str, Any]:
        """Also what is in flight: the fragment's pseudo-gradient, and the site's
        round counter and error feedback as they were when it started (a resumed
        run starts it again from there)."""
        state = {**super().state_dict(), "started_at": list(self._started_at)}
        for flight in self._in_flight:
            state["site"] = flight.site_state
            state["in_flight"] = {
                "fragment": flight.fragment,
                "due": flight.due,
                "sent": flight.sent,
                "anchor": flight.anchor,
            }
        if self._resume is not None:
            # Loaded and not started again yet (that is at the next step): the site's
            # state is already the one from before it.
            state["in_flight"] = self._resume
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Go on from :meth:`state_dict`; an exchange it caught in flight starts again
        at the next step, with the values and round number it had."""
        super().load_state_dict(state)
        self._started_at = [int(step) for step in state["started_at"]]
        self._resume = state.get("in_flight")

    def round_start(self, rounds: int) -> tuple[int, int]:
        """``(fragment, inner step)`` at which round ``rounds`` (counted from 0) starts:
        fragments take turns in order, each at its offset in every period."""
        period, fragment = divmod(rounds, self.fragments)
        return fragment, period * self.sync_every + self.offsets[fragment]

    def _after_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self.inner_steps += 1
        if self._resume is not None:
            resumed, self._resume = self._resume, None
            self._start(int(resumed["fragment"]), resumed)
        for flight in list(self._in_flight):
            if flight.due <= self.inner_steps and self._complete(flight):
                return  # caught up: this site now stands where that round started
        position = (self.inner_steps - 1) % self.sync_every + 1
        for fragment, offset in enumerate(self.offsets):
            if offset == position and self._start(fragment):
                return

    def _start(self, fragment: int, resumed: dict[str, Any] | None = None) -> bool:
        """Start the fragment's exchange (and complete it at once without overlap),
        or the one a checkpoint caught in flight (``resumed``). Returns whether this
        site caught up (its step changed)."""
        view = None
        if self.member.membership is not None:
            view, _ = self.member.open_round()
            # A site that caught up to the round goes on with its fragment and step.
            fragment = self.member.rounds % self.fragments
        site_state = self.site.state_dict(copy=False)
        with self._blocking("syncing"):  # host work on the training thread
            if resumed is None:
                self._started_at[fragment] = self.inner_steps
                deltas = self.outer.pseudo_gradients(self.members[fragment])
                due = self.inner_steps + self.overlap_steps
                anchor = self._anchor(fragment)
            else:
                # From a checkpoint in host memory: back onto the outer state's device.
                deltas = [d.to(self.outer.device) for d in resumed["sent"]]
                due = int(resumed["due"])
                saved = resumed.get("anchor")
                anchor = None
                if saved is not None:
                    members = self.members[fragment]
                    devices = [self.params[i].device for i in members]
                    anchor = [a.to(d) for a, d in zip(saved, devices, strict=True)]
            pending = self._exchange_in_view(
                deltas, self.weights, vector=f"fragment{fragment}", view=view
            )
        flight = _FragmentExchange(
            due,
            fragment,
            deltas,
            EarlyExchange(pending, view.epoch if view is not None else 0),
            site_state,
            anchor,
        )
        if self.overlap_steps == 0:
            return self._complete(flight)
        self._in_flight.append(flight)
        return False

    def _complete(self, flight: _FragmentExchange) -> bool:
        """Wait for the fragment's exchange and merge it; returns whether this site
        caught up meanwhile (then it stands at the step the round started)."""
        self._in_flight = [f for f in self._in_flight if f is not flight]

        def apply(report: StepReport, caught_up: bool) -> None:
            self._account(report)
            members = self.members[flight.fragment]
            with self.member.lock:
                if flight.anchor is not None and not caught_up:
                    self.outer.step(flight.sent, members, keep_since=flight.anchor)
                elif flight.anchor is not None:
                    # The model is the pulled global one, with nothing of its own since.
                    self.outer.step(flight.sent, members)
                else:
                    self.outer.step(flight.sent, members, mix=self.alpha)
                self.outer_steps += 1
                self.member.rounds += 1

        def restart(view: View, caught_up: bool) -> PendingAverage:
            if caught_up:
                # The pulled state may be a round or more past this flight's: the
                # round to run is the next one of the schedule, with nothing of this
                # site's (its model is the pulled global one).
                flight.fragment = self.member.rounds % self.fragments
                flight.sent = self.outer.pseudo_gradients(self.members[flight.fragment])
            return self._exchange_in_view(
                flight.sent, self.weights, vector=f"fragment{flight.fragment}", view=view
            )

        return self.member.complete(flight.early, restart, apply)

    def _anchor(self, fragment: int) -> list[torch.Tensor] | None:
        """With ``merge: eager``, the fragment's parameters as its exchange starts (the
        local progress made after it is kept when the average is applied)."""
        if self.merge != "eager":
            return None
        return [self.params[i].detach().clone() for i in self.members[fragment]]

    def _global_state(self) -> dict[str, Any]:
        return {"outer_steps": self.outer_steps, "outer": self.outer.state_dict()}

    def _load_global_state(self, state: dict[str, Any], donor: str) -> None:
        self._load_outer_state(state, donor)
        _, self.inner_steps = self.round_start(self.member.rounds)
        for earlier in range(
            max(0, self.member.rounds - self.fragments + 1), self.member.rounds + 1
        ):
            fragment, step = self.round_start(earlier)
            self._started_at[fragment] = step

    def rejoin(self) -> int:
        """For a site that (re)starts while the others train: wait to be admitted, pull
        the global state, and start the round it was admitted at (with nothing of its
        own to send). Returns the inner step to train on from, the same as the others'."""
        self._start(0)
        return self.inner_steps

    def finish(self) -> None:
        """Complete what is in flight, then one exchange of every parameter (no
        mixing), so every site ends with the same, global, parameters."""
        for flight in list(self._in_flight):
            self._complete(flight)
        # A fragment exchanged at the last step with no mixing (or eager: no progress
        # since to keep) already holds the global parameters exactly: leave it (an
        # outer step on its zero pseudo-gradient would still move it, by momentum).
        # Every other one is exchanged once more and reset to the global parameters.
        done = {
            f
            for f, step in enumerate(self._started_at)
            if step == self.inner_steps and (self.alpha == 0 or self.merge == "eager")
        }
        everything = [i for f, members in enumerate(self.members) if f not in done for i in members]
        if not everything:
            return
        with self._blocking("syncing"):
            deltas = self.outer.pseudo_gradients(everything)
        if self.member.membership is None:
            with self._blocking("syncing"):
                self._account(self._exchange(deltas, self.weights, vector="final").wait())
                self.outer.step(deltas, everything)
            return
        self._final_round(deltas, everything, self.weights)


@dataclass
class _FragmentExchange:
    due: int
    """The inner step at which it is completed."""
    fragment: int
    sent: list[torch.Tensor]
    """This site's pseudo-gradient of the fragment (the average, once completed)."""
    early: EarlyExchange
    site_state: dict[str, Any]
    """The site's round counter and error feedback before it started: a checkpoint
    that catches it in flight goes back to them."""
    anchor: list[torch.Tensor] | None = None
    """``merge: eager``: the fragment's parameters when it started."""


StreamingDiLoCo.__doc__ = (StreamingDiLoCo.__doc__ or "") + settings_doc("streaming")
