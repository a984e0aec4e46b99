"""One rank of a site in the hierarchical step's check: gradients averaged across sites every step.

The sites issue's minimal training loop (the strategies come later): every
rank builds the built-in model from the same seed (or the user's, by import
path) in the site's layout, reads its own shard of the data, and after every
backward pass averages its gradients with the hierarchical step (in-site
reduce-scatter, cross-site all-reduce per lane, in-site all-gather), weighted
by tokens, then takes an SGD step (with momentum, so checkpoints carry
optimizer state). The result must equal one process training on the union of
every rank's batches (:func:`reference_training`). Each rank writes a JSON
report (its WAN share, in-site and WAN seconds) and the parameters it holds,
whole (:func:`load_site_parameters` merges a site's).

Run under torchrun or :mod:`isthmus.intra.launch` (one-rank sites need neither)::

    python -m site_worker --job JOB.yaml --site a --out DIR
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from isthmus.inter.allocator import keep_freed_memory
from isthmus.inter.join import start_site
from isthmus.intra.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from isthmus.intra.data import Dataset, ShardSpec, stdlib_corpus
from isthmus.intra.gradients import clip_grad_norm
from isthmus.intra.model import GPT, config_for, lm_loss
from isthmus.intra.parallelize import GPT_PLAN, ModelPlan, SiteModel
from isthmus.intra.plugins import DataContext, load_callable, load_model
from isthmus.job.addressing import load_state
from isthmus.job.file import Job, load_job
from isthmus.training.site_errors import run_site_main

Batch = tuple[torch.Tensor, torch.Tensor]
LossFunction = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

MOMENTUM = 0.9
"""SGD with momentum: a checkpoint must carry optimizer state for resume to be exact."""


@dataclass(frozen=True)
class Recipe:
    """What to train on what: the built-in GPT and corpus, or a user's own by
    import path (see :mod:`isthmus.intra.plugins`)."""

    seed: int = 0
    size: str = "tiny"
    corpus_bytes: int | None = None
    batch: int = 4
    model_import: str | None = None
    data_import: str | None = None
    iid: bool = True
    """Built-in data: every shard a uniform sample, or each site its own part of the corpus."""

    def model(self) -> tuple[nn.Module, ModelPlan | None, LossFunction]:
        if self.model_import:
            model = load_model(self.model_import)
            return (
                model,
                getattr(model, "isthmus_plan", None),
                getattr(model, "isthmus_loss", lm_loss),
            )
        torch.manual_seed(self.seed)
        return GPT(config_for(self.size)), GPT_PLAN, lm_loss

    def batches(self, job: Job, site_index: int, dp_rank: int) -> Iterator[Batch]:
        """The batches of one data-parallel rank of one site."""
        dps = tuple(s.layout.dp for s in job.sites)
        if self.data_import:
            context = DataContext.for_rank(
                [s.name for s in job.sites],
                dps,
                site_index,
                dp_rank,
                batch_size=self.batch,
                seed=self.seed,
            )
            return iter(load_callable(self.data_import, "data")(context))
        data = _dataset(self.corpus_bytes, config_for(self.size).seq_len)
        spec = ShardSpec(site_index, dps, dp_rank, iid=self.iid, seed=self.seed)
        return data.batches(spec, self.batch)


@functools.cache
def _dataset(corpus_bytes: int | None, seq_len: int) -> Dataset:
    """Read once per process: the reference opens a stream for every rank of every site."""
    return Dataset(stdlib_corpus(corpus_bytes), seq_len)


def reference_training(
    job: Job, recipe: Recipe, *, steps: int, lr: float, grad_clip: float = 0.0
) -> nn.Module:
    """One process, one model, every rank's batch of each step in one mean loss;
    ``grad_clip``: torch's own clipping of that one gradient."""
    model, _, loss_fn = recipe.model()
    streams = [
        recipe.batches(job, i, r) for i, site in enumerate(job.sites) for r in range(site.layout.dp)
    ]
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=MOMENTUM)
    for _ in range(steps):
        pairs = [next(s) for s in streams]
        x = torch.cat([p[0] for p in pairs])
        y = torch.cat([p[1] for p in pairs])
        optimizer.zero_grad()
        loss_fn(model(x), y).backward()
        if grad_clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        optimizer.step()
    return model


def run(args: argparse.Namespace) -> dict[str, object]:
    job = load_job(args.job)
    state = load_state(args.state) if args.state else None
    recipe = Recipe(
        seed=args.seed,
        size=args.size,
        corpus_bytes=args.corpus_bytes,
        batch=args.batch,
        model_import=args.model,
        data_import=args.data,
        iid=not args.non_iid,
    )
    model, plan, loss_fn = recipe.model()
    # The whole model's shapes: what every site must agree on, whatever its layout.
    named = [(n, p.shape) for n, p in model.named_parameters()]
    site = start_site(job, args.site, parameters=named, state=state)
    if isinstance(model, GPT):
        site.layout.check_model(model.config, where=f"sites[{site.site_index}]")
    part = SiteModel(
        model,
        site.layout,
        site.rank,
        loss_fn=loss_fn,
        plan=plan,
        microbatches=args.microbatches,
    )
    params = part.parameters()
    stream = recipe.batches(job, site.site_index, site.dp_rank)
    participants = [s.name for s in job.sites]
    optimizer = torch.optim.SGD(params, lr=args.lr, momentum=MOMENTUM)
    checkpoints = Path(args.checkpoint_dir, args.site) if args.checkpoint_dir else None
    start = 0
    if checkpoints is not None and (latest := latest_checkpoint(checkpoints)) is not None:
        start = load_checkpoint(latest, part.model, optimizer)["step"]
        for _ in range(start):  # batches are a fixed sequence: skip those trained on
            next(stream)
    reports, losses, norms = [], [], []
    try:
        for step in range(start, args.steps):
            x, y = next(stream)
            # Weights: the targets each rank averaged over (tokens, for text);
            # every rank of every site takes batches of the same shape.
            tokens_per_rank = y.numel()
            weights = {s.name: float(s.layout.dp * tokens_per_rank) for s in job.sites}
            optimizer.zero_grad()
            losses.append(part.step(x, y))
            # With FSDP the site's gradients are already averaged over its
            # data-parallel ranks (sharded DTensors); otherwise the step's
            # in-site reduce-scatter averages each replica's own gradients.
            reports.append(
                site.step.average(
                    [p.grad for p in params],  # type: ignore[misc]
                    round=step,
                    participants=participants,
                    weights=weights,
                    rank_weight=float(tokens_per_rank),
                    in_site_reduce=not part.sharded,
                )
            )
            if args.grad_clip:
                norms.append(clip_grad_norm(params, args.grad_clip, part.stage_group))
            optimizer.step()
            if checkpoints is not None and (step + 1) % args.checkpoint_every == 0:
                save_checkpoint(checkpoints, step + 1, part.model, optimizer)
        # Sharded parameters are gathered (a collective on every rank); each rank
        # saves what it holds: its pipeline stage's layers, whole.
        final = {
            k: v.full_tensor() if isinstance(v, DTensor) else v
            for k, v in part.model.state_dict().items()
        }
    finally:
        site.close()
    torch.save(final, Path(args.out) / f"{args.site}-r{site.rank}.pt")
    return {
        "site": args.site,
        "rank": site.rank,
        "dp_rank": site.dp_rank,
        "lanes": list(site.step.my_lanes),
        "wan_values": reports[-1].wan_values if reports else 0,
        "wan_bytes_sent": sum(r.wan_bytes_sent for r in reports),
        "in_site_s": statistics.median(r.in_site_s for r in reports) if reports else 0.0,
        "wan_s": statistics.median(r.wan_s for r in reports) if reports else 0.0,
        "losses": losses,
        "grad_norms": norms,
    }


def load_site_parameters(folder: Path, site: str) -> dict[str, torch.Tensor]:
    """A site's whole model, merged from what each of its ranks saved."""
    merged: dict[str, torch.Tensor] = {}
    for path in sorted(folder.glob(f"{site}-r*.pt")):
        merged.update(torch.load(path, weights_only=True))
    return merged


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python benchmarks/site_worker.py")
    parser.add_argument("--job", required=True)
    parser.add_argument("--site", required=True)
    parser.add_argument("--out", required=True, help="folder for reports and parameters")
    parser.add_argument("--state", help="the emulator's state file, when run through it")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--size", default="tiny")
    parser.add_argument("--corpus-bytes", type=int, default=None)
    parser.add_argument("--model", help="your own model: package.module:function")
    parser.add_argument("--data", help="your own data: package.module:function")
    parser.add_argument(
        "--non-iid", action="store_true", help="built-in data: each site its own part of it"
    )
    parser.add_argument("--microbatches", type=int, default=2, help="per step, with pp > 1")
    parser.add_argument(
        "--grad-clip", type=float, default=0.0, help="clip the averaged gradient's norm; 0: never"
    )
    parser.add_argument("--checkpoint-dir", help="checkpoint each site under DIR/SITE; resume")
    parser.add_argument("--checkpoint-every", type=int, default=1, metavar="STEPS")
    args = parser.parse_args(argv)
    keep_freed_memory()  # this process carries chunks: reuse their buffers (see allocator)
    report = run(args)
    Path(args.out, f"{args.site}-{report['rank']}.json").write_text(json.dumps(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(run_site_main(main, "site_worker"))
