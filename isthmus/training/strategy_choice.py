"""The job's ``train.strategy`` with its settings, as one strategy object.

What ``site.strategy(model, optimizer)`` builds: the same classes a script may
build itself (``isthmus.DiLoCo(site, ...)``), given the settings their class
takes (:func:`isthmus.job.settings.strategy_keys`) from the job file's
``train:`` section. One settings model, so both front doors build the same run.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from isthmus.inter.join import SiteRuntime
from isthmus.inter.strategies import AsyncDiLoCo, DiLoCo, Strategy, StreamingDiLoCo, Sync
from isthmus.job.settings import TrainSettings

CLASSES: dict[str, type[Strategy]] = {
    "sync": Sync,
    "diloco": DiLoCo,
    "streaming": StreamingDiLoCo,
    "async": AsyncDiLoCo,
}


def strategy_from_settings(
    settings: TrainSettings,
    site: SiteRuntime,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    tokens_per_step: int,
    stage_group: dist.ProcessGroup | None = None,
) -> Strategy:
    extra = {"stage_group": stage_group} if settings.strategy == "sync" else {}
    return CLASSES[settings.strategy](
        site,
        model,
        optimizer,
        tokens_per_step=tokens_per_step,
        **extra,
        **settings.strategy_kwargs(),
    )
