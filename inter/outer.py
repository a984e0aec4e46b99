"""DiLoCo's outer optimizer: the global parameters and their update by the averaged pseudo-gradient.

Every site keeps a copy of the global parameters, beside the model or in
pinned host memory (``train.outer_state``: host memory is for models whose two
extra float32 copies, parameters and momentum, do not fit on the GPU). After H inner steps,
the pseudo-gradient is ``global - local``; once it is averaged across sites,
SGD with Nesterov momentum (the DiLoCo paper's outer optimizer: lr 0.7,
momentum 0.9) updates the global parameters, and the model is reset to them.
Every site applies the same averaged pseudo-gradient with the same arithmetic,
so the global parameters stay bitwise identical across sites.

Parameters may be FSDP or tensor-parallel DTensors: the copies keep their
placements, and everything here is local to each shard.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn


def outer_device(outer_state: str, model: nn.Module) -> torch.device:
    """Where the DiLoCo family keeps its outer state (``train.outer_state``): beside
    the model (``device``) or in host memory (``host``, pinned when the model is on a
    GPU, so each round's copies run at full PCIe speed)."""
    first = next(model.parameters(), None)
    if outer_state == "host" or first is None:
        return torch.device("cpu")
    return first.device


class OuterOptimizer:
    def __init__(
        self,
        params: Sequence[torch.Tensor],
        *,
        lr: float,
        momentum: float,
        nesterov: bool = True,
        device: str | torch.device = "cpu",
    ) -> None:
        self.params = list(params)
        self.device = torch.device(device)
        # Host copies of a GPU model are pinned: each round copies the model to
        # and from them, and pageable memory would halve that copy's speed.
        pin = self.device.type == "cpu" and any(p.device.type == "cuda" for p in self.params)
        self.global_params = [
            p.detach().to(self.device, dtype=torch.float32, copy=True) for p in self.params
        ]
        if pin:
            self.global_params = [g.pin_memory() for g in self.global_params]
        self.optimizer = torch.optim.SGD(
            self.global_params,
            lr=lr,
            momentum=momentum,
            nesterov=nesterov and momentum > 0,
        )

    @property
    def lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    @lr.setter
    def lr(self, value: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = value

    def pseudo_gradients(self, indices: Sequence[int] | None = None) -> list[torch.Tensor]:
        """``global - local`` for the parameters at ``indices`` (all by default),
        float32, on the outer device."""
        indices = range(len(self.params)) if indices is None else indices
        return [
            self.global_params[i] - self.params[i].detach().to(self.device, dtype=torch.float32)
            for i in indices
        ]

    @torch.no_grad()
    def step(
        self,
        averaged: Sequence[torch.Tensor],
        indices: Sequence[int] | None = None,
        *,
        mix: float = 0.0,
        reset: bool = True,
        keep_since: Sequence[torch.Tensor] | None = None,
    ) -> None:
        """Apply the averaged pseudo-gradient of the parameters at ``indices`` (all by
        default) to the global parameters. With ``reset``, those model parameters
        become ``mix * local + (1 - mix) * global`` (``mix`` 0: DiLoCo's reset); with
        ``keep_since`` (the parameters as they were when the pseudo-gradient was
        taken, one per index), ``global + (local - keep_since)``: the global
        parameters plus the local progress made since."""
        indices = range(len(self.global_params)) if indices is None else indices
        for i, delta in zip(indices, averaged, strict=True):
            self.global_params[i].grad = delta
        # SGD skips parameters without a gradient: their momentum stays as it was.
        self.optimizer.step()
        for i in indices:
            self.global_params[i].grad = None
        if keep_since is not None:
            for i, since in zip(indices, keep_since, strict=True):
                p, g = self.params[i], self.global_params[i].to(self.params[i].device)
                # This order leaves a site that made no progress exactly at global.
                p.sub_(since).add_(g.to(p.dtype))
        elif reset:
            for i in indices:
                p, g = self.params[i], self.global_params[i].to(self.params[i].device)
                if mix:
                    p.mul_(mix).add_(g.to(p.dtype), alpha=1 - mix)
                else:
                    p.copy_(g.to(p.dtype))

    @torch.no_grad()
    def reset_model(self) -> None:
        for p, g in zip(self.params, self.global_params, strict=True):
            p.copy_(g.to(p.device, dtype=p.dtype))

    def state_dict(self) -> dict[str, Any]:
        return {
            "global": [g.clone() for g in self.global_params],
            "optimizer": self.optimizer.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        with torch.no_grad():
            for g, saved in zip(self.global_params, state["global"], strict=True):
                g.copy_(saved)
        self.optimizer.load_state_dict(state["optimizer"])
