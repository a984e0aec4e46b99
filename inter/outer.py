"""DiLoCo's outer optimizer: the global parameters and their update by the averaged pseudo-gradient.

Every site keeps a copy of the global parameters (on CPU by default: they are
touched once per round, and GPU memory is for training). After H inner steps,
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
        self.global_params = [
            p.detach().to(self.device, dtype=torch.float32, copy=True) for p in self.params
        ]
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

    def pseudo_gradients(self) -> list[torch.Tensor]:
        """``global - local`` for every parameter, float32, on the outer device."""
        return [
            g - p.detach().to(self.device, dtype=torch.float32)
            for g, p in zip(self.global_params, self.params, strict=True)
        ]

    @torch.no_grad()
    def step(self, averaged: Sequence[torch.Tensor]) -> None:
        """Apply the averaged pseudo-gradient; reset the model to the new global parameters."""
        for g, delta in zip(self.global_params, averaged, strict=True):
            g.grad = delta
        self.optimizer.step()
        for g in self.global_params:
            g.grad = None
        self.reset_model()

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
