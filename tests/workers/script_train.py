"""A user's own training script, as small as one gets: a two-layer MLP on a
regression task, trained through ``isthmus.join()`` and the job's strategy.

Knobs for the tests (environment):
- ``SCRIPT_SEED_BY_SITE=1``: each site initialises its model with its own seed
  (Isthmus must still start every site from one model);
- ``SCRIPT_WIDE_SITE=NAME``: that site builds a wider hidden layer (a model whose
  shapes differ: refused at the start);
- ``SCRIPT_STEP_SLEEP_S``: seconds to sleep each step (a slower site);
- ``SCRIPT_SGD=1``: SGD (lr 0.05, momentum 0.9) instead of AdamW, and the script
  describes itself (``site.describe(model="mlp-8-32-1", data="sin of sums")``);
- ``SCRIPT_LOG=nan``: log a loss that is not a number and no tokens.
"""

import os
import time

import torch
from torch import nn

import isthmus


def batch(step: int, site: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(site * 100_003 + rank * 1_009 + step)
    x = torch.randn(16, 8, generator=generator)
    return x, x.sum(dim=1, keepdim=True).sin()


def main() -> None:
    site = isthmus.join()
    wide = os.environ.get("SCRIPT_WIDE_SITE") == site.name
    torch.manual_seed(site.site_index if os.environ.get("SCRIPT_SEED_BY_SITE") else 0)
    model = nn.Sequential(
        nn.Linear(8, 48 if wide else 32), nn.Tanh(), nn.Linear(48 if wide else 32, 1)
    )
    if os.environ.get("SCRIPT_SGD"):
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        site.describe(model="mlp-8-32-1", data="sin of sums")
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    nan = os.environ.get("SCRIPT_LOG") == "nan"
    pause = float(os.environ.get("SCRIPT_STEP_SLEEP_S", "0"))
    with site.strategy(model, optimizer):
        for step in site.steps():
            x, y = batch(step, site.site_index, site.dp_rank)
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            site.log(loss=float("nan")) if nan else site.log(loss=loss.item(), tokens=len(x))
            if pause:
                time.sleep(pause)


if __name__ == "__main__":
    main()
