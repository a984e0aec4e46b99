"""What the DiLoCo family shares: local steps between exchanges, and the outer optimizer.

DiLoCo, Streaming DiLoCo and AsyncDiLoCo all let every site take
``sync_every`` inner steps on its own, then average the pseudo-gradient
(global minus local parameters) across sites and step the outer optimizer
(:class:`~isthmus.inter.outer.OuterOptimizer`, which this class holds). They
differ in when the exchange runs and when its result is applied, which is each
subclass's ``_after_step`` hook. Their global state, what a catching-up site
pulls, is the outer optimizer's state and the round count.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from isthmus.inter.codecs import Codec
from isthmus.inter.hierarchical import PendingAverage, StepReport
from isthmus.inter.join import SiteRuntime, runtime_of
from isthmus.inter.member_rounds import EarlyExchange, shapes_match
from isthmus.inter.membership import View
from isthmus.inter.outer import OuterOptimizer, outer_device
from isthmus.inter.strategies.base import Strategy, static_weights


class LocalSteps(Strategy):
    """``sync_every`` inner steps between exchanges, the outer optimizer
    (:attr:`outer`), a hook after every inner step (``_after_step``), and the outer
    state as the global state of the membership rounds. The settings are checked
    by the subclass (:func:`~isthmus.inter.strategies.base.validated`)."""

    def __init__(
        self,
        site: SiteRuntime,
        model: nn.Module,
        inner_optimizer: torch.optim.Optimizer,
        *,
        settings: Any,
        codec: str | Codec,
        tokens_per_step: int,
    ) -> None:
        site = runtime_of(site)  # isthmus.join() gives a Site that holds one
        super().__init__(
            site,
            model,
            inner_optimizer,
            codec=codec,
            tokens_per_step=tokens_per_step,
            error_feedback=settings.error_feedback,
        )
        self.sync_every = settings.sync_every
        self.round_steps = 0
        """Inner steps since the last exchange started: a round ends after exactly
        ``sync_every`` of them, also when ``sync_every`` changes mid-run."""
        self.outer = OuterOptimizer(
            self.params,
            lr=settings.outer_lr,
            momentum=settings.outer_momentum,
            device=outer_device(settings.outer_state, model),
        )
        self._hooks.append(inner_optimizer.register_step_post_hook(self._after_step))
        # Until a round says otherwise, every site takes its data-parallel share;
        # closing gives the optimizer back as it came (another strategy may follow).
        self._share_before = getattr(inner_optimizer, "batch_share", None)
        weights = static_weights(self.layouts, tokens_per_step)
        self._set_batch_share(weights[self.site.name] / sum(weights.values()))

    def close(self) -> None:
        if self._share_before is not None:
            self._set_batch_share(self._share_before)
        super().close()

    def _set_batch_share(self, share: float) -> None:
        """Tell an inner optimizer that corrects its second moment to the sites'
        averaged batch (:class:`~isthmus.intra.site_adamw.SiteAdamW`) this site's
        share of that batch; other optimizers have nothing to be told."""
        if hasattr(self.optimizer, "batch_share"):
            self.optimizer.batch_share = share

    def _after_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        raise NotImplementedError

    def _round_due(self) -> bool:
        """Count an inner step; True when it ends the round."""
        self.round_steps += 1
        if self.round_steps < self.sync_every:
            return False
        self.round_steps = 0
        return True

    @property
    def global_parameters(self) -> Sequence[torch.Tensor]:
        return self.outer.global_params

    def _load_outer_state(self, state: dict[str, Any], donor: str) -> None:
        """Take in a donor's outer state and round counters; the model becomes the
        global one (see :meth:`Strategy._load_global_state`)."""
        shapes_match(
            self.site.name,
            donor,
            iter(self.outer.global_params),
            state.get("outer", {}).get("global"),
        )
        self.outer.load_state_dict(state["outer"])
        self.outer.reset_model()
        self.member.rounds = int(state["rounds"])
        self.outer_steps = int(state["outer_steps"])
        self.round_steps = 0

    def _state_bytes(self) -> int:
        # Parameters and momentum, float32.
        return sum(g.numel() for g in self.outer.global_params) * 4 * 2

    def state_dict(self) -> dict[str, Any]:
        state = {
            **super().state_dict(),
            "outer": self.outer.state_dict(),
            "round_steps": self.round_steps,
            "sync_every": self.sync_every,
        }
        share = getattr(self.optimizer, "batch_share", None)
        if share is not None:  # the last seal's, which a resumed run goes on with
            state["batch_share"] = share
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.outer.load_state_dict(state["outer"])
        self.round_steps = int(state["round_steps"])
        self.sync_every = int(state["sync_every"])
        if "batch_share" in state:
            self._set_batch_share(float(state["batch_share"]))

    # -- for the overlapped two (streaming, async) -------------------------------------
    def _final_round(
        self,
        deltas: list[torch.Tensor],
        indices: Sequence[int] | None,
        weights: dict[str, float],
    ) -> None:
        """The closing exchange of ``indices`` (all parameters by default) as a round
        under the membership, every model reset to the global parameters after it."""
        sent = deltas

        def restart(view: View, caught_up: bool) -> PendingAverage:
            nonlocal sent
            if caught_up:  # the model is the pulled global one: nothing of its own
                sent = self.outer.pseudo_gradients(indices)
            return self._exchange_in_view(sent, weights, vector="final", view=view)

        def apply(report: StepReport, caught_up: bool) -> None:
            self._account(report)
            with self.member.lock:
                self.outer.step(sent, indices)
                self.outer_steps += 1
                self.member.rounds += 1

        self.member.complete(EarlyExchange(None, epoch=-1), restart, apply)
