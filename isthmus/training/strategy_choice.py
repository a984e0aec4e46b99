"""The job's ``train.strategy`` with its settings, as one strategy object.

What ``site.strategy(model, optimizer)`` builds: the same classes a script may
build itself (``isthmus.DiLoCo(site, ...)``), with every setting from the job
file's ``train:`` section.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from isthmus.inter.join import SiteRuntime
from isthmus.inter.strategies import AsyncDiLoCo, DiLoCo, Strategy, StreamingDiLoCo, Sync
from isthmus.job.settings import TrainSettings


def outer_device(settings: TrainSettings, model: nn.Module) -> torch.device:
    """Where the DiLoCo family keeps its outer state: beside the model
    (``outer_state: device``) or in host memory (``host``, pinned when the model is
    on a GPU, so each round's copies run at full PCIe speed)."""
    first = next(model.parameters(), None)
    if settings.outer_state == "host" or first is None:
        return torch.device("cpu")
    return first.device


def strategy_from_settings(
    settings: TrainSettings,
    site: SiteRuntime,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    tokens_per_step: int,
    stage_group: dist.ProcessGroup | None = None,
) -> Strategy:
    common: dict[str, Any] = {
        "codec": settings.codec,
        "error_feedback": settings.error_feedback,
        "tokens_per_step": tokens_per_step,
    }
    if settings.strategy == "sync":
        return Sync(
            site,
            model,
            optimizer,
            **common,
            rejoin_timeout_s=settings.rejoin_timeout_s,
            max_grad_norm=settings.grad_clip or None,
            stage_group=stage_group,
        )
    outer: dict[str, Any] = {
        "outer_device": outer_device(settings, model),
        "sync_every": settings.sync_every,
        "outer_lr": settings.outer_lr,
        "outer_momentum": settings.outer_momentum,
    }
    if settings.strategy == "diloco":
        return DiLoCo(
            site,
            model,
            optimizer,
            **outer,
            **common,
            round_seconds=settings.round_seconds,
            rejoin_timeout_s=settings.rejoin_timeout_s,
        )
    if settings.strategy == "async":
        return AsyncDiLoCo(
            site,
            model,
            optimizer,
            **outer,
            **common,
            rejoin_timeout_s=settings.rejoin_timeout_s,
            late_contributions=settings.late_contributions,
            staleness_weight=settings.staleness_weight,
        )
    return StreamingDiLoCo(
        site,
        model,
        optimizer,
        **outer,
        **common,
        rejoin_timeout_s=settings.rejoin_timeout_s,
        fragments=settings.fragments,
        overlap_steps=settings.overlap_steps,
        alpha=settings.alpha,
        merge=settings.merge,
    )
