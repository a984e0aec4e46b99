"""An example of a user's own model and data, plugged in by import path.

    python -m site_worker --job JOB.yaml --site a --out DIR \\
        --model isthmus.deploy.examples.custom_model:model \\
        --data isthmus.deploy.examples.custom_model:data

The model is a small residual MLP regressor; its plan says which modules are
its blocks (FSDP units) and how to split them across tensor-parallel ranks.
The data is a fixed random linear problem, each data-parallel rank of each
site drawing its own batches, deterministically.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from isthmus.intra.parallelize import ModelPlan
from isthmus.intra.plugins import DataContext

WIDTH = 64


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(WIDTH, 4 * WIDTH)
        self.down = nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


class Regressor(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleDict({str(i): Block() for i in range(2)})
        self.head = nn.Linear(WIDTH, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks.values():
            x = block(x)
        return self.head(x).squeeze(-1)


def model() -> nn.Module:
    torch.manual_seed(0)  # every rank of every site starts from the same weights
    m = Regressor()
    m.isthmus_plan = ModelPlan(  # type: ignore[assignment]
        blocks=lambda module: module.blocks,
        tp_plan={"up": ColwiseParallel, "down": RowwiseParallel},
    )
    m.isthmus_loss = nn.functional.mse_loss  # type: ignore[assignment]
    return m


def data(context: DataContext) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    truth = torch.randn(WIDTH, generator=torch.Generator().manual_seed(context.seed))
    shard = sum(context.ranks_per_site[: context.site_index]) + context.dp_rank
    # Held-out samples come from a stream no training rank draws from.
    stream = -1 if context.split == "eval" else shard
    generator = torch.Generator().manual_seed(context.seed * 1000 + stream + 1)
    while True:
        x = torch.randn(context.batch_size, WIDTH, generator=generator)
        yield x, x @ truth / WIDTH**0.5  # targets of unit variance
