"""The sync strategies: how often and how sites agree on the model.

The user keeps their own training loop; a strategy hooks the optimizer:

* :class:`Sync` averages gradients across sites before every optimizer step
  (the hierarchical all-reduce), so every site takes the same step;
* :class:`DiLoCo` lets every site take ``sync_every`` inner steps, then seals
  the round (participants and weights), averages the pseudo-gradients
  (global minus local parameters) and applies the outer optimizer; the model
  is reset to the new global parameters, bitwise identical on every site.

Round numbers come from the site (one counter per site, advanced identically
everywhere), so strategies can be switched between rounds.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from isthmus.inter.codecs import Codec, parse_codec
from isthmus.inter.commit import Seal, seal_round
from isthmus.inter.hierarchical import StepReport
from isthmus.inter.join import SiteRuntime
from isthmus.inter.outer import OuterOptimizer
from isthmus.inter.settings import SettingError


def _codec(value: str | Codec) -> Codec:
    if isinstance(value, Codec):
        return value
    try:
        return parse_codec(value)
    except ValueError as exc:
        raise SettingError("codec", str(exc)) from None


def _positive_int(name: str, value: Any) -> int:
    if not (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
        raise SettingError(name, f"must be an integer >= 1, got {value!r}")
    return value


class Strategy:
    """What every strategy shares: the site, the hooks, and the counters."""

    def __init__(
        self,
        site: SiteRuntime,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        codec: str | Codec,
        tokens_per_step: int,
    ) -> None:
        self.site = site
        self.model = model
        self.optimizer = optimizer
        self.codec = _codec(codec)
        self.tokens_per_step = _positive_int("tokens_per_step", tokens_per_step)
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.inner_steps = 0
        self.outer_steps = 0
        self.wan_bytes_sent = 0
        self.wan_bytes_received = 0
        self.last_report: StepReport | None = None
        self._hooks: list[Any] = []
        site.set_codec(self.codec)

    def _account(self, report: StepReport) -> None:
        self.wan_bytes_sent += report.wan_bytes_sent
        self.wan_bytes_received += report.wan_bytes_received
        self.last_report = report

    def close(self) -> None:
        """Unhook from the optimizer (the site stays joined)."""
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()

    def __enter__(self) -> Strategy:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        try:
            if exc_type is None:
                self.finish()
        finally:
            self.close()

    def finish(self) -> None:
        """Bring every site to the same parameters at the end of training."""


class Sync(Strategy):
    """Average gradients across sites before every optimizer step.

    Weights are each site's tokens per step (``tokens_per_step`` times its
    data-parallel ranks), fixed by the job's layout, so no seal is needed per
    step. Gradients of FSDP or tensor-parallel models (DTensors) are already
    averaged inside the site; plain gradients of several ranks are averaged
    in the site first (see :mod:`isthmus.inter.hierarchical`).
    """

    def __init__(
        self,
        site: SiteRuntime,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        codec: str | Codec = "none",
        tokens_per_step: int = 1,
    ) -> None:
        super().__init__(site, model, optimizer, codec=codec, tokens_per_step=tokens_per_step)
        self.weights = {s.name: float(tokens_per_step * s.layout.dp) for s in site.job.sites}
        self._hooks.append(optimizer.register_step_pre_hook(self._before_step))

    def _before_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        grads = []
        for p in self.params:
            if p.grad is None:  # every site must send the same vector
                p.grad = torch.zeros_like(p)
            grads.append(p.grad)
        report = self.site.step.average(
            grads,
            round=self.site.next_round(),
            participants=self.site.names,
            weights=self.weights,
            in_site_reduce=not any(isinstance(g, DTensor) for g in grads),
        )
        self._account(report)
        self.inner_steps += 1
        self.outer_steps += 1


class DiLoCo(Strategy):
    """Local SGD across sites (Douillard et al., 2023): ``sync_every`` inner steps,
    then an outer step on the averaged pseudo-gradient."""

    def __init__(
        self,
        site: SiteRuntime,
        model: nn.Module,
        inner_optimizer: torch.optim.Optimizer,
        *,
        sync_every: int = 50,
        outer_lr: float = 0.7,
        outer_momentum: float = 0.9,
        codec: str | Codec = "none",
        tokens_per_step: int = 1,
        outer_device: str = "cpu",
    ) -> None:
        self.sync_every = _positive_int("sync_every", sync_every)
        if not (isinstance(outer_lr, int | float) and math.isfinite(outer_lr) and outer_lr > 0):
            raise SettingError("outer_lr", f"must be a number > 0, got {outer_lr!r}")
        if not (isinstance(outer_momentum, int | float) and 0 <= outer_momentum < 1):
            raise SettingError("outer_momentum", f"must be in [0, 1), got {outer_momentum!r}")
        super().__init__(site, model, inner_optimizer, codec=codec, tokens_per_step=tokens_per_step)
        self.outer = OuterOptimizer(
            self.params, lr=outer_lr, momentum=outer_momentum, device=outer_device
        )
        self.last_seal: Seal | None = None
        self._tokens = 0
        self._hooks.append(inner_optimizer.register_step_post_hook(self._after_step))

    def _after_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self.inner_steps += 1
        self._tokens += self.tokens_per_step
        if self.inner_steps % self.sync_every == 0:
            self.sync()

    def add_tokens(self, count: int) -> None:
        """Count tokens beyond ``tokens_per_step`` (batches of varying size)."""
        self._tokens += count

    def sync(self) -> None:
        """Run one round now: seal, average the pseudo-gradients, outer step."""
        site = self.site
        seal = seal_round(
            site.step,
            round=site.next_round(),
            sites=site.names,
            me=site.name,
            tokens=self._tokens,
            dp_size=site.layout.dp,
        )
        if seal.participants != site.names:
            idle = sorted(set(site.names) - set(seal.participants))
            raise RuntimeError(
                f"round {seal.round}: sites {idle} trained on no tokens since the last round; "
                "every site must take inner steps between rounds"
            )
        deltas = self.outer.pseudo_gradients()
        report = site.step.average(
            deltas,
            round=site.next_round(),
            participants=seal.participants,
            weights=seal.weights,
            # The site's ranks hold one model (FSDP, or one rank): no in-site average.
            in_site_reduce=False,
        )
        self.outer.step(deltas)
        self._account(seal.report)
        self._account(report)
        self.last_seal = seal
        self._tokens = 0
        self.outer_steps += 1

    def finish(self) -> None:
        if self._tokens:
            self.sync()

    @property
    def global_parameters(self) -> Sequence[torch.Tensor]:
        return self.outer.global_params
