"""Train the built-in model across the sites of a job with DiLoCo: run it once per site.

    python -m isthmus.deploy.examples.diloco_train JOB.yaml SITE [--steps 60] [--sync-every 20]
        [--strategy diloco|streaming|async|sync] [--fragments 2 --overlap-steps 1 --alpha 0.5]
        [--merge mix|eager]

Every site trains the same initial model on its own shard of the built-in
data; every ``--sync-every`` steps the sites average their pseudo-gradients
and take an outer step. At the end it prints (and writes with ``--out``) the
outer steps, the WAN bytes, the held-out loss and a digest of the global
parameters, which is the same on every site. Sites here are one rank each;
multi-rank sites run the same code under torchrun with their model sharded
(see docs/sites.md).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import time
from pathlib import Path
from typing import Any

import torch

import isthmus
from isthmus.inter.allocator import keep_freed_memory
from isthmus.intra.data import Dataset, ShardSpec, stdlib_corpus
from isthmus.intra.model import GPT, config_for, lm_loss
from isthmus.intra.schedule import SCHEDULES, learning_rate_at
from isthmus.training.site_errors import run_site_main


@torch.no_grad()
def parse_schedule(text: str) -> list[tuple[int, int | None]]:
    """'5:100,10:200,50' -> [(5, 100), (10, 200), (50, None)]."""
    schedule: list[tuple[int, int | None]] = []
    try:
        for part in text.split(","):
            h, _, until = part.partition(":")
            schedule.append((int(h), int(until) if until else None))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r}: write H:UNTIL pairs and a last H, e.g. 5:100,10:200,50"
        ) from None
    if schedule[-1][1] is not None or any(u is None for _, u in schedule[:-1]):
        raise argparse.ArgumentTypeError(f"{text!r}: only the last H goes without :UNTIL")
    return schedule


def sync_every_at(schedule: list[tuple[int, int | None]], step: int) -> int:
    for h, until in schedule:
        if until is None or step < until:
            return h
    raise AssertionError("the last entry has no end")


def evaluate(model: torch.nn.Module, data: Dataset, batches: int = 8) -> float:
    losses = [lm_loss(model(x), y).item() for x, y in data.eval_batches(16, batches)]
    return sum(losses) / len(losses)


class _NoSync:
    """No synchronisation: what a strategy's throughput is compared with."""

    outer_steps = wan_bytes_sent = wan_bytes_received = 0

    def __enter__(self) -> _NoSync:
        return self

    def __exit__(self, *exc: object) -> None:
        pass


def add_recipe_arguments(
    parser: argparse.ArgumentParser, schedule_flag: str = "--lr-schedule"
) -> None:
    """The inner recipe's choices this example, the convergence benchmark and its
    trials share: the learning-rate schedule after the warm-up (``args.lr_schedule``)
    and AdamW's second beta (``args.beta2``)."""
    parser.add_argument(
        schedule_flag,
        dest="lr_schedule",
        choices=SCHEDULES,
        default="cosine",
        help="after the warm-up: cosine decay to 10%% (default), the peak held "
        "(constant), or held then decayed linearly over the last fifth (wsd)",
    )
    parser.add_argument("--beta2", type=_beta, default=0.999, help="AdamW's second beta")


def _beta(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number in [0, 1), got {text!r}") from None
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"must be in [0, 1), got {text}")
    return value


def backward_in_halves(
    model: torch.nn.Module, inner: isthmus.SiteAdamW, x: torch.Tensor, y: torch.Tensor
) -> None:
    """The batch's gradient as two halves' mean, each half recorded: what tells
    SiteAdamW the gradient's noise."""
    half = len(x) // 2
    for part in (slice(0, half), slice(half, None)):
        (lm_loss(model(x[part]), y[part]) / 2).backward()
        inner.record_micro_batch()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m isthmus.deploy.examples.diloco_train")
    parser.add_argument("job")
    parser.add_argument("site")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--sync-every", type=int, default=20)
    parser.add_argument(
        "--strategy",
        choices=("diloco", "streaming", "async", "sync", "none"),
        default="diloco",
        help="none: every site trains alone (the baseline of throughput comparisons)",
    )
    parser.add_argument(
        "--sync-every-schedule",
        type=parse_schedule,
        help="H that grows: 'H1:UNTIL1,H2:UNTIL2,...,HLAST', e.g. 5:100,10:200,50 "
        "(H=5 until step 100, then 10 until 200, then 50)",
    )
    parser.add_argument("--fragments", type=int, default=2, help="streaming")
    parser.add_argument("--overlap-steps", type=int, default=0, help="streaming")
    parser.add_argument("--alpha", type=float, default=0.5, help="streaming")
    parser.add_argument(
        "--merge", choices=["mix", "eager"], default="mix", help="streaming: see train.merge"
    )
    parser.add_argument("--bucket-mb", type=float, default=25.0, help="sync")
    parser.add_argument("--no-overlap", action="store_true", help="sync: average after backward")
    # The DiLoCo paper's outer Nesterov and float32 by default: the convergence
    # benchmarks name their configurations against it. A job file's defaults are
    # the measured recipe instead (plain averaging, int2+zstd: docs/job-file.md).
    parser.add_argument("--outer-lr", type=float, default=0.7, help="the DiLoCo paper's 0.7")
    parser.add_argument("--outer-momentum", type=float, default=0.9, help="Nesterov; 0: none")
    parser.add_argument("--codec", default="none")
    parser.add_argument("--error-feedback", action="store_true", help="with a lossy codec")
    parser.add_argument(
        "--inner",
        choices=("adamw", "site-adamw", "sgd"),
        default="adamw",
        help="site-adamw: AdamW with its second moment corrected to the sites' averaged "
        "batch (isthmus.SiteAdamW), each batch taken as two halves",
    )
    parser.add_argument("--lr", type=float, default=3e-3, help="inner learning rate")
    parser.add_argument(
        "--grad-clip",
        type=float,
        default=1.0,
        help="clip the gradient to this norm before every inner step (sync: the average); 0: never",
    )
    parser.add_argument(
        "--warmup-steps", type=int, default=0, help="linear warm-up, then --lr-schedule"
    )
    add_recipe_arguments(parser)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--corpus-bytes", type=int, default=None)
    parser.add_argument("--threads", type=int, help="torch threads (several sites on one machine)")
    parser.add_argument("--eval-batches", type=int, default=8, help="of 16 held-out windows")
    parser.add_argument("--out", help="write the report as JSON, and the parameters beside it")
    args = parser.parse_args(argv)

    if args.threads:
        torch.set_num_threads(args.threads)
    keep_freed_memory()  # a process of its own that carries chunks: reuse their buffers
    site = isthmus.join(args.job, site=args.site)
    torch.manual_seed(args.seed)  # the same initial model on every site
    model = GPT(config_for("tiny"))
    data = Dataset(stdlib_corpus(args.corpus_bytes), model.config.seq_len)
    dps = tuple(s.layout.dp for s in site.job.sites)
    shard = ShardSpec(site.site_index, dps, site.dp_rank, seed=args.seed)
    batches = data.batches(shard, args.batch)
    if args.inner == "adamw":
        inner: torch.optim.Optimizer = torch.optim.AdamW(
            model.parameters(), lr=args.lr, betas=(0.9, args.beta2)
        )
    elif args.inner == "site-adamw":
        inner = isthmus.SiteAdamW(model.parameters(), lr=args.lr, betas=(0.9, args.beta2))
    else:
        inner = torch.optim.SGD(model.parameters(), lr=args.lr)
    tokens = args.batch * model.config.seq_len
    outer = {"sync_every": args.sync_every, "outer_lr": args.outer_lr}
    outer["outer_momentum"] = args.outer_momentum
    common = {"codec": args.codec, "error_feedback": args.error_feedback, "tokens_per_step": tokens}
    strategy: Any
    if args.strategy == "none":
        strategy = _NoSync()
    elif args.strategy == "diloco":
        strategy = isthmus.DiLoCo(site, model, inner, **outer, **common)
    elif args.strategy == "streaming":
        streaming = {"fragments": args.fragments, "overlap_steps": args.overlap_steps}
        strategy = isthmus.StreamingDiLoCo(
            site, model, inner, **outer, **streaming, alpha=args.alpha, merge=args.merge, **common
        )
    elif args.strategy == "async":
        strategy = isthmus.AsyncDiLoCo(site, model, inner, **outer, **common)
    else:
        overlap = {"bucket_mb": args.bucket_mb, "overlap": not args.no_overlap}
        clip = {"grad_clip": args.grad_clip}
        strategy = isthmus.Sync(site, model, inner, **overlap, **clip, **common)
    with site, strategy:
        started = time.perf_counter()
        for step in range(args.steps):
            if args.warmup_steps:
                for group in inner.param_groups:
                    group["lr"] = learning_rate_at(
                        args.lr_schedule, args.lr, step, args.warmup_steps, args.steps
                    )
            if args.sync_every_schedule:
                strategy.sync_every = sync_every_at(args.sync_every_schedule, step)
            x, y = next(batches)
            if isinstance(inner, isthmus.SiteAdamW):
                backward_in_halves(model, inner, x, y)
            else:
                lm_loss(model(x), y).backward()
            if args.grad_clip and args.strategy != "sync":  # Sync clips the average
                torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
            inner.step()  # every sync_every steps the round runs here
            inner.zero_grad()
        train_s = time.perf_counter() - started
    digest = hashlib.sha256()
    for p in model.parameters():
        digest.update(p.detach().numpy().tobytes())
    report = {
        "site": args.site,
        "strategy": args.strategy,
        "outer_steps": strategy.outer_steps,
        "wan_bytes_sent": strategy.wan_bytes_sent,
        "wan_bytes_received": strategy.wan_bytes_received,
        "eval_loss": evaluate(model, data, args.eval_batches),
        "train_seconds": train_s,
        "tokens_per_s": args.steps * tokens / train_s,
        "param_sha256": digest.hexdigest(),
    }
    print(json.dumps(report))
    if args.out:
        Path(args.out).write_text(json.dumps(report))
        torch.save(model.state_dict(), Path(args.out).with_suffix(".pt"))
    return 0


if __name__ == "__main__":
    raise SystemExit(run_site_main(main, "diloco_train"))
