"""One rank of one site in ``isthmus run``: train with the job's strategy, report as it goes.

``isthmus run`` starts it once per rank, as torchrun would (RANK, WORLD_SIZE,
MASTER_ADDR/PORT), in the run directory it prepared::

    python -m isthmus.deploy.run.worker RUN_DIR SITE

It reads ``RUN_DIR/job.yaml`` (resolved: every setting filled in) and, when the
WAN is emulated, the emulator's state file ``RUN_DIR/wan.json``. Rank 0 of the
site appends telemetry to ``RUN_DIR/sites/SITE/metrics.jsonl`` (the record
kinds are in :mod:`isthmus.deploy.run.records`) and, at the end, writes
``result.json`` beside it; rank 0 of the job's first site also writes the
final model, ``RUN_DIR/model.safetensors``. Files appear whole or not at all.
With ``train.checkpoint_every``, every rank checkpoints after every that many
rounds into ``RUN_DIR/checkpoints/SITE/round-N/``; ``--resume-round N`` (which
``isthmus run --resume`` passes) goes on from there, bit for bit.
With a run that survives the loss of a site (two sites or more), SIGUSR1 (to any of
its ranks) makes the site leave at the next round: the others go on without
it, and it writes ``result.json`` with ``status: "left"``.
Rank 0 is also the site's control-plane client (:mod:`isthmus.deploy.run.control`):
status, metrics per round, live settings.

The set-up (model, data, optimizer, strategy) is :mod:`isthmus.deploy.run.setup`,
the records beyond each step :mod:`isthmus.deploy.run.round_records`.
"""

from __future__ import annotations

import argparse
import dataclasses
import signal
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from isthmus.deploy.jobfile import Job, load_job
from isthmus.deploy.run.control import SiteControl, apply_settings, membership_for
from isthmus.deploy.run.orphan import end_with_parent
from isthmus.deploy.run.records import RecordWriter, parameter_digest, write_json_atomic
from isthmus.deploy.run.round_records import site_mean, write_blocked, write_round, write_views
from isthmus.deploy.run.setup import (
    build_model,
    build_strategy,
    builtin_dataset,
    evaluate,
    full_state,
    held_out_batches,
    inner_optimizer,
    learning_rate,
    save_model,
    train_batches,
)
from isthmus.deploy.run.site_errors import run_site_main
from isthmus.inter.allocator import keep_freed_memory
from isthmus.inter.join import SiteRuntime, start_site
from isthmus.inter.membership import LeftTheRun
from isthmus.inter.strategies import AsyncDiLoCo, Blocked, Strategy
from isthmus.intra.checkpoint import checkpoint_path, load_checkpoint, load_extra, save_checkpoint
from isthmus.intra.gradients import clip_grad_norm
from isthmus.intra.parallelize import ModelPlan, SiteModel
from isthmus.intra.process_group import SiteError, launcher_rank
from isthmus.job.addressing import load_state, resolve
from isthmus.job.settings import TrainSettings
from isthmus.job.tune import LIVE_SYNC_EVERY


class _Stop(Exception):
    """SIGTERM: leave through the ``finally`` blocks (close the peer service)."""


def _on_sigterm(signum: int, frame: object) -> None:
    raise _Stop()


_leave_requested = False


def _on_sigusr1(signum: int, frame: object) -> None:
    """An operator asks this site to leave the run at the next round (the training
    loop passes it on: a signal handler must not take the membership's lock)."""
    global _leave_requested
    _leave_requested = True


def train(
    run_dir: Path, site_name: str, resume_round: int | None = None, rejoin: bool = False
) -> int:
    job = load_job(run_dir / "job.yaml")
    settings = job.train
    state_path = run_dir / "wan.json"
    state = load_state(state_path) if state_path.exists() else None
    model, plan, loss_fn = build_model(job)
    named = [(n, p.shape) for n, p in model.named_parameters()]
    membership = membership_for(job, run_dir, site_name, rejoining=rejoin)
    if rejoin and membership is None:
        raise SiteError(
            "--rejoin needs a run that can lose and regain sites: at least 2 sites and a "
            "control plane"
        )
    # The broker first: a site that cannot reach it stops at once, before its peers
    # wait on it (the address in its status is the one the others dial: on a real
    # network the advertised one, not 0.0.0.0).
    spec = job.site(site_name)
    dialled = None if state is not None else spec.dial_addresses()
    host, port = (dialled or resolve(job, site_name, state).listen)[0]
    rank, _ = launcher_rank()
    control = SiteControl(job, run_dir, site_name, rank, spec.ranks, f"{host}:{port}", membership)
    try:
        site = start_site(
            job,
            site_name,
            parameters=named,
            state=state,
            rejoining=rejoin,
            deadline_s=settings.round_deadline_s,
            collective_timeout_s=settings.collective_timeout_s,
            site_wait_s=settings.site_wait_s,
        )
    except BaseException:
        control.close(done=False)
        raise
    site.membership = membership
    leader = site.rank == 0  # rank 0 reports for the whole site
    records = RecordWriter(run_dir / "sites" / site_name / "metrics.jsonl", site_name, leader)
    done = False
    try:
        code = _train(
            job,
            settings,
            site,
            model,
            plan,
            loss_fn,
            records,
            control,
            run_dir,
            resume_round,
            rejoin,
        )
        done = True
        return code
    finally:
        control.close(done=done)
        records.close()
        site.close()


def _train(
    job: Job,
    settings: TrainSettings,
    site: SiteRuntime,
    model: nn.Module,
    plan: ModelPlan | None,
    loss_fn: Callable[..., torch.Tensor],
    records: RecordWriter,
    control: SiteControl,
    run_dir: Path,
    resume_round: int | None = None,
    rejoin: bool = False,
) -> int:
    leader = site.rank == 0
    part = SiteModel(model, site.layout, site.rank, loss_fn=loss_fn, plan=plan)
    dataset = builtin_dataset(job, model)
    held_out = held_out_batches(job, model, dataset)
    optimizer = inner_optimizer(settings, part.parameters())
    checkpoints = run_dir / "checkpoints" / site.name
    resumed: dict[str, Any] = {}
    if resume_round is not None:
        path = checkpoint_path(checkpoints, resume_round, "round")
        load_checkpoint(path, part.model, optimizer)
        resumed = load_extra(path)
        settings = dataclasses.replace(settings, **resumed["settings"])
    start_step = int(resumed.get("step", 0))
    batches = train_batches(job, settings, site, dataset, start_step)
    first = next(batches)
    tokens_per_step = first[1].numel()
    stage_group = part.stage_group
    strategy = build_strategy(settings, site, part.model, optimizer, tokens_per_step, stage_group)
    if resumed:
        strategy.load_state_dict(resumed["strategy"])
        torch.set_rng_state(resumed["rng"])
    # Replicas in a site average their gradients over the fast fabric before every
    # inner step; FSDP does it itself, and Sync includes it in its exchange.
    replicas = site.dp_group if (site.layout.dp > 1 and not part.sharded) else None
    if settings.strategy == "sync":
        replicas = None  # the loop leaves it to the exchange
    strategy.observer = lambda kind, start: records.write(
        "state", state=kind if start else "computing"
    )
    records.write("start", ranks=site.site.ranks, strategy=settings.strategy, steps=settings.steps)
    if resumed:
        records.write("resume", round=resume_round, step=start_step)
    if rejoin:
        start_step = _rejoin(strategy, records)
        batches = train_batches(job, settings, site, dataset, start_step)
        first = next(batches)
    # Views from the first on; pulls after the rejoin's own (recorded just above).
    views_seen = (0, len(strategy.member.caught_up))

    tokens = int(resumed.get("tokens", 0))
    compute_s = float(resumed.get("compute_s", 0.0))
    loss = float("nan")
    train_started = time.time() - float(resumed.get("wall_s", 0.0))
    outer_seen = strategy.outer_steps
    clock = _RoundClock(time.perf_counter(), tokens, compute_s, start_step)
    steps_done = start_step
    left = False
    step = start_step
    while step < settings.steps:
        if _leave_requested and not strategy.member.leave_requested:
            strategy.member.leave_requested = True  # acted on at the next round
            records.write("state", state="leaving")
        x, y = first if step == start_step else next(batches)
        step_started = time.perf_counter()
        rank_loss = _forward_backward(part, optimizer, settings, site, step, x, y, replicas)
        try:
            optimizer.step()  # the strategy's rounds run inside this call
        except LeftTheRun as exc:
            records.write("state", state="left", reason=str(exc))
            left = True
            break
        compute_s += time.perf_counter() - step_started - sum(b.seconds for b in strategy.blocked)
        tokens += y.numel() * site.layout.dp
        loss = site_mean(rank_loss, site)
        clock.add_blocked(strategy.blocked)
        write_blocked(records, strategy)
        records.write(
            "step",
            step=step + 1,
            loss=loss,
            tokens=tokens,
            compute_s=compute_s,
            lr=optimizer.param_groups[0]["lr"],
        )
        control.step(step + 1, strategy.outer_steps)
        views_seen = write_views(records, site, strategy, views_seen, step + 1)
        round_ended = strategy.outer_steps != outer_seen
        if round_ended:
            outer_seen = strategy.outer_steps
            totals = write_round(records, strategy, site, step + 1)
            changes = control.round_ended(
                outer_seen,
                step + 1,
                loss=loss,
                wan_bytes_sent=totals["wan_bytes_sent"],
                sync_every=settings.sync_every,
                **clock.metrics(tokens=tokens, compute_s=compute_s, step=step + 1),
            )
            clock = _RoundClock(time.perf_counter(), tokens, compute_s, step + 1)
            if changes:
                settings = apply_settings(changes, settings, strategy, site.name)
                records.write("config", round=outer_seen, step=step + 1, settings=changes)
        if _eval_due(settings, step + 1, round_ended) and site.layout.pp == 1:
            eval_started = time.perf_counter()
            eval_loss = evaluate(part.model, held_out, loss_fn)  # a stage is not a model
            records.write(
                "eval",
                step=step + 1,
                tokens=tokens,
                eval_loss=eval_loss,
                seconds=time.perf_counter() - eval_started,
            )
        steps_done = step + 1
        if getattr(strategy, "training_over", False):
            break  # time-budgeted rounds: a site has finished, so has everyone
        if (
            round_ended
            and settings.checkpoint_every
            and outer_seen % settings.checkpoint_every == 0
        ):
            progress = {
                "step": step + 1,
                "tokens": tokens,
                "compute_s": compute_s,
                "wall_s": time.time() - train_started,
            }
            _checkpoint(run_dir, site, part, optimizer, strategy, settings, records, progress)
        if strategy.inner_steps != step + 1:
            # This site fell behind (cut off, left out) and pulled the others' state:
            # go on from their step, with the batches of that step.
            step = start_step = steps_done = strategy.inner_steps
            batches = train_batches(job, settings, site, dataset, step)
            first = next(batches)
        else:
            step += 1

    if not left:
        # Every run ends with a final synchronisation: the same model on every site.
        records.write("state", state="syncing")
        strategy.finish()
    strategy.close()
    write_blocked(records, strategy)
    wall_s = time.time() - train_started
    totals = write_round(records, strategy, site, steps_done)
    full = full_state(part, site)  # a collective: every rank takes part
    if not leader:
        return 0
    assert full is not None
    result = {
        "status": "left" if left else "finished",
        "final_loss": loss,
        "tokens": tokens,
        "compute_seconds": compute_s,
        "wall_seconds": wall_s,
    }
    _write_result(
        job, run_dir, site, strategy, full, held_out, loss_fn, records, steps_done, result, totals
    )
    return 0


def _write_result(
    job: Job,
    run_dir: Path,
    site: SiteRuntime,
    strategy: Strategy,
    full: dict[str, torch.Tensor],
    held_out: Any,
    loss_fn: Callable[..., torch.Tensor],
    records: RecordWriter,
    steps_done: int,
    result: dict[str, Any],
    totals: dict[str, Any],
) -> None:
    """(Rank 0.) The final model's held-out loss, the model file (the job's first
    site), and the site's ``result.json``, with the digest that shows every site
    ended with the same model."""
    final, _, _ = build_model(job)
    final.load_state_dict(full)
    eval_loss = evaluate(final, held_out, loss_fn)
    records.write("eval", step=steps_done, tokens=result["tokens"], eval_loss=eval_loss, final=True)
    if site.site_index == 0:
        save_model(final, run_dir / "model.safetensors", job)
    result = {
        "status": result["status"],
        "final_loss": result["final_loss"],
        "eval_loss": eval_loss,
        "tokens": result["tokens"],
        "inner_steps": strategy.inner_steps,
        "outer_steps": strategy.outer_steps,
        "compute_seconds": result["compute_seconds"],
        "wall_seconds": result["wall_seconds"],
        "wan_bytes_sent": totals["wan_bytes_sent"],
        "wan_bytes_received": totals["wan_bytes_received"],
        "wan_bytes_sent_to": totals["wan_bytes_sent_to"],
        "param_sha256": parameter_digest(final),
    }
    if isinstance(strategy, AsyncDiLoCo):
        result["late_contributions_applied"] = strategy.late_contributions_applied
    write_json_atomic(run_dir / "sites" / site.name / "result.json", result)
    records.write("state", state=result["status"])


def _rejoin(strategy: Strategy, records: RecordWriter) -> int:
    """A restarted site: wait to be let in, pull the others' state, record where it
    came from; returns the inner step to train on from."""
    records.write("state", state="rejoining")
    start_step = strategy.rejoin()
    pulled = strategy.member.caught_up[-1]
    records.write(
        "rejoin",
        round=pulled.rounds,
        step=start_step,
        donor=pulled.donor,
        view=pulled.view,
        bytes=pulled.bytes,
        seconds=pulled.seconds,
        resumed=pulled.resumed,
    )
    return start_step


@dataclasses.dataclass
class _RoundClock:
    """Where the round under way began (time, tokens, compute, step) and how long the
    loop was blocked in it: the control plane's metrics when it ends."""

    started: float
    tokens: int
    compute_s: float
    step: int
    waiting_s: float = 0.0
    blocked_s: float = 0.0

    def add_blocked(self, blocked: Iterable[Blocked]) -> None:
        for span in blocked:
            self.blocked_s += span.seconds
            if span.kind == "waiting":
                self.waiting_s += span.seconds

    def metrics(self, *, tokens: int, compute_s: float, step: int) -> dict[str, Any]:
        round_s = time.perf_counter() - self.started
        return {
            "tokens_per_s": (tokens - self.tokens) / round_s if round_s > 0 else None,
            "round_s": round_s,
            "waiting_s": self.waiting_s,
            "blocked_s": self.blocked_s,
            "compute_s": compute_s - self.compute_s,
            "round_steps": step - self.step,
        }


def _forward_backward(
    part: SiteModel,
    optimizer: torch.optim.Optimizer,
    settings: TrainSettings,
    site: SiteRuntime,
    step: int,
    x: torch.Tensor,
    y: torch.Tensor,
    replicas: dist.ProcessGroup | None,
) -> torch.Tensor:
    """One inner step up to the optimizer's: this rank's loss, its gradients
    averaged over the site's replicas (``replicas``: where the loop does it) and
    clipped by the whole model's norm."""
    for group in optimizer.param_groups:
        group["lr"] = learning_rate(settings, step)
    optimizer.zero_grad()
    rank_loss = part.step(x, y)
    if replicas is not None:
        for p in part.parameters():
            if p.grad is not None:
                grad = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
                dist.all_reduce(grad, group=replicas)
                grad.div_(site.layout.dp)
    if settings.grad_clip and settings.strategy != "sync":  # sync clips the average
        clip_grad_norm(part.parameters(), settings.grad_clip, part.stage_group)
    return rank_loss


def _eval_due(settings: TrainSettings, steps: int, round_ended: bool) -> bool:
    """Held-out loss every sync_every steps (after DiLoCo's round: the global model),
    whatever the strategy, so runs compare at the same points; where sync_every can
    change live, after every round; or as train.eval_every says."""
    if settings.eval_every is not None:
        return settings.eval_every > 0 and steps % settings.eval_every == 0
    if settings.strategy in LIVE_SYNC_EVERY or settings.round_seconds is not None:
        return round_ended
    return steps % settings.sync_every == 0


def _checkpoint(
    run_dir: Path,
    site: SiteRuntime,
    part: SiteModel,
    optimizer: torch.optim.Optimizer,
    strategy: Strategy,
    settings: TrainSettings,
    records: RecordWriter,
    progress: dict[str, Any],
) -> None:
    """Every rank's checkpoint after this round (the same round in every site), and
    its record: what ``--resume-round`` goes on from, bit for bit."""
    saved = time.perf_counter()
    extra = {
        "strategy": strategy.state_dict(),
        "rng": torch.get_rng_state(),
        "settings": settings.to_dict(),
        **progress,
    }
    rounds = strategy.outer_steps
    path = save_checkpoint(
        run_dir / "checkpoints" / site.name,
        rounds,
        part.model,
        optimizer,
        extra=extra,
        kind="round",
    )
    records.write(
        "checkpoint",
        round=rounds,
        step=progress["step"],
        path=str(path.relative_to(run_dir)),
        seconds=time.perf_counter() - saved,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m isthmus.deploy.run.worker")
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("site")
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
    return train_until_stopped(args.run_dir, args.site, args.resume_round, args.rejoin)


def train_until_stopped(
    run_dir: Path, site: str, resume_round: int | None = None, rejoin: bool = False
) -> int:
    """:func:`train`, ending cleanly on SIGTERM (143); SIGUSR1 makes the site leave.
    This owns the process (the rank of ``isthmus run`` and of ``isthmus site``), so
    it makes the process-wide choices: signals, and malloc tuned for the data path."""
    keep_freed_memory()  # chunk buffers are reused, not faulted in anew (see allocator)
    signal.signal(signal.SIGTERM, _on_sigterm)
    signal.signal(signal.SIGUSR1, _on_sigusr1)
    end_with_parent()
    try:
        return train(run_dir, site, resume_round, rejoin)
    except _Stop:
        return 143


if __name__ == "__main__":
    raise SystemExit(run_site_main(main, "run_worker"))
