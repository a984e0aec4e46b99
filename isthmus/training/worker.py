"""The built-in training loop: the built-in model and data, trained through the public API.

``isthmus run JOB`` (no command of the user's) starts it once per rank, as it
would start a user's script (:mod:`isthmus.training.environment`)::

    python -m isthmus.training.worker            # job, site, run directory from the environment
    python -m isthmus.training.worker RUN_DIR SITE [--rejoin | --resume-round N]

It is one user of ``isthmus.join()`` / ``site.strategy()`` / ``site.steps()`` /
``site.log()`` like any script: those do the run's part (membership, live
settings, checkpoints, records, the final synchronisation and
``result.json``). What is the built-in loop's own: the model's parallel plan
(tensor, pipeline, FSDP through :class:`~isthmus.intra.parallelize.SiteModel`),
the learning-rate schedule and gradient clipping, the replicas' gradient
average where no DDP/FSDP does it, and held-out evaluation.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

import isthmus
from isthmus.inter.allocator import keep_freed_memory
from isthmus.intra.gradients import average_replica_gradients, clip_gradients
from isthmus.intra.parallelize import SiteModel
from isthmus.intra.site_adamw import SiteAdamW
from isthmus.job.file import load_job
from isthmus.job.settings import TrainSettings
from isthmus.job.tune import LIVE_SYNC_EVERY
from isthmus.training.environment import LaunchEnvironment
from isthmus.training.rank_setup import (
    build_model,
    builtin_dataset,
    evaluate,
    held_out_batches,
    inner_optimizer,
    learning_rate,
    to_device,
    train_batches,
)
from isthmus.training.site import Site, Stopped
from isthmus.training.site_errors import run_site_main


def train() -> int:
    keep_freed_memory()  # this process's own choice, before its first large allocation
    # The model first: a job whose model cannot be built fails on every site at once,
    # before any site waits on the others' handshake.
    job = load_job(LaunchEnvironment.from_environ().job)
    # On the meta device: each rank allocates only its part, on its own device.
    model, plan, loss_fn = build_model(job, on_meta=True)
    site = isthmus.join()
    site.builtin_loop = True
    site.describe(model=job.model, data=job.data)
    settings = job.train
    part = SiteModel(
        model,
        site.layout,
        site.rank,
        loss_fn=loss_fn,
        plan=plan,
        device=site.device,
        seed=job.seed,
        precision=settings.precision,
        compile_blocks=settings.compile,
    )
    dataset = builtin_dataset(job, model)
    held_out = held_out_batches(job, model, dataset)
    optimizer = inner_optimizer(settings, part.parameters())
    tokens_per_step = next(train_batches(job, settings, site.runtime, dataset))[1].numel()
    # Replicas in a site average their gradients over the fast fabric before every
    # inner step; FSDP does it itself, and Sync includes it in its exchange.
    # Replicas (not FSDP's shards) also share the held-out batches between them.
    eval_replicas = site.runtime.dp_group if site.layout.dp > 1 and not part.sharded else None
    replicas = eval_replicas if settings.strategy != "sync" else None

    with site.strategy(
        part.model, optimizer, tokens_per_step=tokens_per_step, stage_group=part.stage_group
    ) as run:
        batches, next_batch = None, -1
        for step in site.steps():
            if step != next_batch:  # the start, or after pulling the others' state
                batches = train_batches(job, run.settings, site.runtime, dataset, step)
            assert batches is not None
            x, y = to_device(next(batches), site.device)
            next_batch = step + 1
            rounds = run.strategy.outer_steps
            loss = _forward_backward(part, optimizer, run.settings, site, step, x, y, replicas)
            optimizer.step()  # the strategy's rounds run inside this call
            logged: dict[str, float | torch.Tensor] = {"tokens": y.numel()}
            if loss is not None:
                # Unread: on a GPU, site.log reads it once the device has it, with no
                # wait on the step's work (the step's record is written then).
                logged["loss"] = loss
            round_ended = run.strategy.outer_steps != rounds
            if _eval_due(run.settings, step + 1, round_ended) and site.layout.pp == 1:
                started = time.perf_counter()  # a pipeline stage is not a model
                logged["eval_loss"] = evaluate(
                    part.model, held_out, loss_fn, settings.precision, eval_replicas
                )
                logged["eval_seconds"] = time.perf_counter() - started
            site.log(**logged)

    if run.final_state is not None:  # rank 0, after the final synchronisation
        final, _, _ = build_model(job)
        final.load_state_dict(run.final_state)
        site.log(eval_loss=evaluate(final, held_out, loss_fn))
    return 0


def _forward_backward(
    part: SiteModel,
    optimizer: torch.optim.Optimizer,
    settings: TrainSettings,
    site: Site,
    step: int,
    x: torch.Tensor,
    y: torch.Tensor,
    replicas: dist.ProcessGroup | None,
) -> torch.Tensor | None:
    """One inner step up to the optimizer's: this rank's loss (None on a pipeline
    stage that computes none), its gradients averaged over the site's replicas
    (``replicas``: where the loop does it) and clipped by the whole model's norm.

    Nothing here reads a value back from the device: on a GPU the host goes on
    queueing the optimizer's step and the next batch while the backward pass
    runs, as a plain PyTorch loop does (the loss stays a tensor, the clipping
    decides on the device)."""
    for group in optimizer.param_groups:
        group["lr"] = learning_rate(settings, step)
    optimizer.zero_grad()
    # SiteAdamW needs the gradient's noise only where its site's batch is a share
    # of the averaged step's (the strategy said so): a lone site takes it whole.
    halves = isinstance(optimizer, SiteAdamW) and optimizer.batch_share < 1.0
    # Halves of equal size, so that the mean of their means is the batch's mean
    # (an odd batch goes whole, and that step keeps the noise measured before).
    if halves and site.layout.pp == 1 and len(x) >= 2 and len(x) % 2 == 0:
        rank_loss = _halves_forward_backward(part, optimizer, site, x, y, replicas)
    else:
        rank_loss = part.forward_backward(x, y)
        if replicas is not None:  # DDP-style buckets: one all-reduce per ~25 MB, not per tensor
            average_replica_gradients(part.parameters(), replicas, device=site.device)
    if settings.grad_clip and settings.strategy != "sync":  # sync clips the average
        clip_gradients(part.parameters(), settings.grad_clip, part.stage_group)
    return rank_loss


def _halves_forward_backward(
    part: SiteModel,
    optimizer: SiteAdamW,
    site: Site,
    x: torch.Tensor,
    y: torch.Tensor,
    replicas: dist.ProcessGroup | None,
) -> torch.Tensor | None:
    """The batch's gradient as the mean of its two halves', each recorded by
    SiteAdamW: their difference is its measure of the gradient's noise. Replicas
    average after each half, so that every replica records the same gradients and
    their optimizers stay identical (twice the in-site all-reduces of one pass).
    A pipeline's stages run their own micro-batches: they take the batch whole."""
    half = len(x) // 2
    losses = []
    for part_of in (slice(0, half), slice(half, None)):
        losses.append(part.forward_backward(x[part_of], y[part_of]))
        if replicas is not None:
            average_replica_gradients(part.parameters(), replicas, device=site.device)
        optimizer.record_micro_batch()
    for p in part.parameters():
        if p.grad is not None:
            p.grad.div_(2)  # the two halves' sum: their mean
    first, second = losses
    return None if first is None or second is None else (first + second) / 2


def _eval_due(settings: TrainSettings, steps: int, round_ended: bool) -> bool:
    """Held-out loss every sync_every steps (after DiLoCo's round: the global model),
    whatever the strategy, so runs compare at the same points; where sync_every can
    change live, after every round; or as train.eval_every says."""
    if settings.eval_every is not None:
        return settings.eval_every > 0 and steps % settings.eval_every == 0
    if settings.strategy in LIVE_SYNC_EVERY or settings.round_seconds is not None:
        return round_ended
    return steps % settings.sync_every == 0


def train_until_stopped(
    run_dir: Path, site: str, resume_round: int | None = None, rejoin: bool = False
) -> int:
    """The built-in loop as ``site`` of the run in ``run_dir`` (what a launcher's
    environment would say), ending cleanly on SIGTERM (143)."""
    wan_state = run_dir / "wan.json"
    launch = LaunchEnvironment(
        job=run_dir / "job.yaml",
        site=site,
        run_dir=run_dir,
        wan_state=wan_state if wan_state.exists() else None,
        rejoin=rejoin,
        resume_round=resume_round,
    )
    os.environ.update(launch.to_environ())
    try:
        return train()
    except Stopped:
        return 143


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m isthmus.training.worker",
        description="The built-in training loop, one rank. Without arguments the job, "
        "site and run directory come from the launcher's environment.",
    )
    parser.add_argument("run_dir", type=Path, nargs="?")
    parser.add_argument("site", nargs="?")
    parser.add_argument(
        "--resume-round", type=int, help="go on from the sites' checkpoint after this round"
    )
    parser.add_argument(
        "--rejoin",
        action="store_true",
        help="the other sites are training: wait to be admitted, pull the global state "
        "from one of them, and train on",
    )
    args = parser.parse_args(argv)
    if args.run_dir is not None:
        if args.site is None:
            parser.error("SITE: name the site with the run directory")
        return train_until_stopped(args.run_dir, args.site, args.resume_round, args.rejoin)
    try:
        return train()
    except Stopped:
        return 143


def exit_without_teardown(code: int) -> None:
    """End the process now that the rank's work is done and written.

    Tearing down an interpreter that holds torch (thousands of modules, the
    process group, gRPC's core) costs 0.4-1.5 s of CPU per rank, and on a small
    machine every run's end waits for it. The atexit handlers still run (the
    site's own close is one), then the output is flushed and the process ends
    without the teardown: everything the rank owes the run directory was
    written and closed before ``main`` returned."""
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


if __name__ == "__main__":
    exit_without_teardown(run_site_main(main, "run_worker"))
