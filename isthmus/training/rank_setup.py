"""What a rank of ``isthmus run`` sets up before its training loop: the job's model,
data, inner optimizer, learning rate and strategy; and what it evaluates and saves.

Apart from the loop (:mod:`isthmus.training.worker`) so the loop reads top to
bottom, and so ``isthmus eval`` builds the same model and held-out batches.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from isthmus.inter.join import SiteRuntime
from isthmus.intra import collectives
from isthmus.intra.data import Dataset, ShardSpec, load_corpus
from isthmus.intra.model import GPT, config_for, lm_loss
from isthmus.intra.parallelize import GPT_PLAN, ModelPlan, autocast, materialise
from isthmus.intra.plugins import DataContext, load_callable, load_model
from isthmus.intra.schedule import learning_rate_at
from isthmus.intra.site_adamw import SiteAdamW
from isthmus.job.file import Job
from isthmus.job.settings import TrainSettings

EVAL_BATCHES = 8
"""Held-out batches of 16 sequences (or samples) for each evaluation."""

Batch = tuple[torch.Tensor, torch.Tensor]


def build_model(
    job: Job, *, on_meta: bool = False
) -> tuple[nn.Module, ModelPlan | None, Callable[..., torch.Tensor]]:
    """The job's model, initialised from the job's seed: the same on every site.

    ``on_meta``: build it on the meta device, shapes without storage, so that a rank
    allocates only its own part once the site's layout has cut it down
    (:func:`materialise`); a 7B model then never sits whole in one rank's host memory.
    A user's function is called as it is, after the seed: it may build on the meta
    device itself when its model has a ``reset_parameters()``."""
    torch.manual_seed(job.seed)
    if ":" in job.model:
        model = load_model(job.model)
        plan = getattr(model, "isthmus_plan", None)
        return model, plan, getattr(model, "isthmus_loss", lm_loss)
    with torch.device("meta"):
        model = GPT(config_for(job.model))
    if not on_meta:
        materialise(model, torch.device("cpu"), job.seed)
    return model, GPT_PLAN, lm_loss


def to_device(batch: Batch, device: torch.device) -> Batch:
    """A batch on the rank's device: from pinned host memory with non-blocking copies
    on a GPU (the copy overlaps the work queued before it), unchanged on the CPU."""
    if device.type == "cpu":
        return batch
    x, y = batch
    return _pinned(x).to(device, non_blocking=True), _pinned(y).to(device, non_blocking=True)


def _pinned(tensor: torch.Tensor) -> torch.Tensor:
    """A compact copy of ``tensor`` in pinned memory. Compact matters: the built-in
    batches are strided views (inputs and targets: one window shifted by a token),
    ``pin_memory()`` keeps the strides, and copying a strided host tensor to a GPU
    goes through a compact pageable copy, and CUDA may make a transfer from pageable
    memory wait for the work queued on the stream: the host would stall each step
    until the previous one's optimizer step had run."""
    pinned = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    return pinned.copy_(tensor)


def builtin_dataset(job: Job, model: nn.Module) -> Dataset | None:
    """The held-out split and batches of the built-in data path (None for a user's
    data function, which brings its own batches)."""
    if ":" in job.data and not Path(job.data).exists():
        return None
    seq_len = model.config.seq_len if isinstance(model, GPT) else 64
    return Dataset(load_corpus(job.data), seq_len)


def learning_rate(settings: TrainSettings, step: int) -> float:
    """The inner learning rate at ``step``: warm-up, then ``settings.lr_schedule``."""
    return learning_rate_at(
        settings.lr_schedule, settings.inner_lr, step, settings.warmup_steps, settings.steps
    )


def inner_optimizer(
    settings: TrainSettings, parameters: Iterable[torch.Tensor]
) -> torch.optim.Optimizer:
    """The inner optimizer of ``isthmus run``: AdamW as the job's ``train:`` sets it,
    or with ``inner_optimizer: site_adamw`` SiteAdamW (diloco's default;
    its strategy tells it the site's share of the batch)."""
    settings_of = {
        "lr": learning_rate(settings, 0),
        "betas": (settings.inner_beta1, settings.inner_beta2),
        "weight_decay": settings.inner_weight_decay,
    }
    if settings.inner_optimizer == "site_adamw":
        return SiteAdamW(parameters, **settings_of)
    return torch.optim.AdamW(parameters, **settings_of)


def train_batches(
    job: Job, settings: TrainSettings, site: SiteRuntime, dataset: Dataset | None, start: int = 0
) -> Iterator[Batch]:
    """This rank's training batches from batch ``start`` on (a resumed run: a user's
    data function is read from its beginning and the batches before ``start`` dropped,
    so it must yield the same batches every time, as the built-in data does)."""
    if dataset is not None:
        dps = tuple(s.layout.dp for s in job.sites)
        shard = ShardSpec(site.site_index, dps, site.dp_rank, seed=job.seed)
        return dataset.batches(shard, settings.batch_size, start=start)
    context = data_context(job, site.site_index, site.dp_rank, settings.batch_size)
    return itertools.islice(load_callable(job.data, "data")(context), start, None)


def data_context(
    job: Job, site_index: int, dp_rank: int, batch_size: int, split: str = "train"
) -> DataContext:
    return DataContext.for_rank(
        [s.name for s in job.sites],
        [s.layout.dp for s in job.sites],
        site_index,
        dp_rank,
        batch_size=batch_size,
        seed=job.seed,
        split=split,
    )


def held_out_batches(job: Job, model: nn.Module, dataset: Dataset | None) -> list[Batch]:
    """The evaluation batches, the same on every site and at every evaluation: the
    built-in data's held-out split, or what the user's data function yields for
    ``split="eval"``."""
    if dataset is not None:
        return list(dataset.eval_batches(16, EVAL_BATCHES))
    context = data_context(job, 0, 0, 16, split="eval")
    return list(itertools.islice(load_callable(job.data, "data")(context), EVAL_BATCHES))


@torch.no_grad()
def evaluate(
    model: nn.Module,
    batches: list[Batch],
    loss_fn: Callable[..., torch.Tensor],
    precision: str = "fp32",
    replicas: dist.ProcessGroup | None = None,
) -> float:
    """Mean loss over ``batches``, on the model's device, in the training precision.

    ``replicas``: the site's data-parallel replicas of this model (the same
    parameters on every one of them). Each evaluates its share of the batches
    (``batches[i::n]``) and one all-reduce of (sum, count) gives every replica
    the mean over all of them: the site evaluates in 1/n of the time (and the
    CPU) it took when every replica evaluated every batch. The mean is the same
    within float64 rounding of the summation order."""
    parameter = next(model.parameters())
    device = parameter.device
    share = batches
    if replicas is not None:
        share = batches[dist.get_rank(replicas) :: dist.get_world_size(replicas)]
    total = 0.0
    with torch.no_grad(), autocast(device, precision):
        for batch in share:
            x, y = to_device(batch, device)
            total += float(loss_fn(model(x), y))
    if replicas is None:
        return total / len(batches)
    summed, count = collectives.all_reduce_values(
        [total, len(share)],
        device=collectives.device_of(parameter),
        where="setup.evaluate",
        group=replicas,
    ).tolist()
    return summed / count

