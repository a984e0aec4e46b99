"""Site checkpoints with torch.distributed.checkpoint: save, and resume where the site stopped.

Each site checkpoints its own state (model and optimizer, in whatever layout
it trains: FSDP shards, tensor-parallel pieces, pipeline stages) with
``torch.distributed.checkpoint``: every rank writes its part in parallel, and
the checkpoint can be loaded by the same layout. What is not a model or an
optimizer (a strategy's counters and outer state, RNG states: each rank's own)
goes in a per-rank file beside them. A small ``meta.json`` (rank 0) records
the number and what the caller adds; it is written last, after every rank has
written its part, so a checkpoint without it is incomplete (a kill mid-write)
and is never resumed: the previous one stays usable.

Layout on disk: ``DIR/step-000012/`` (or ``round-...``: the caller names what it
counts) with DCP's files, ``rank-<r>.pt`` and ``meta.json``;
:func:`latest_checkpoint` finds the newest complete one.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from isthmus.intra import collectives
from isthmus.intra.checkpoint_files import (
    META,
    checkpoint_number,
    checkpoint_path,
    complete_checkpoints,
    latest_checkpoint,
)

__all__ = [
    "checkpoint_number",
    "checkpoint_path",
    "complete_checkpoints",
    "latest_checkpoint",
    "load_checkpoint",
    "load_extra",
    "save_checkpoint",
]


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier(model: nn.Module) -> None:
    if dist.is_initialized():
        collectives.barrier(device=_device(model), where="checkpoint.save")


def _device(model: nn.Module) -> torch.device:
    """Where the rank computes, read off its model (the barrier's GPU on NCCL)."""
    for p in model.parameters():
        return collectives.device_of(p.to_local() if isinstance(p, DTensor) else p)
    return torch.device("cpu")


def save_checkpoint(
    folder: str | Path,
    step: int,
    model: nn.Module,
    optimizer: Optimizer,
    *,
    meta: dict[str, Any] | None = None,
    extra: dict[str, Any] | None = None,
    keep: int = 2,
    kind: str = "step",
) -> Path:
    """Write the state after ``step`` steps (or rounds: ``kind``); keep the newest
    ``keep`` checkpoints. Every rank of the site calls it. ``extra``: this rank's
    other state (tensors and plain values), returned by :func:`load_extra`."""
    path = checkpoint_path(folder, step, kind)
    model_state, optimizer_state = get_state_dict(model, optimizer)
    problem = None
    try:
        dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=str(path))
        if extra is not None:
            target = path / f"rank-{_rank()}.pt"
            tmp = target.with_name(f".{target.name}.tmp")
            torch.save(extra, tmp)
            os.replace(tmp, target)
    except (OSError, RuntimeError, CheckpointException) as exc:  # a full disk, a quota
        cause = _cause(exc)
        if not isinstance(cause, Exception):
            # SIGTERM's or Ctrl-C's exit, raised while DCP wrote (it wraps whatever
            # its writers raise): the process is stopping, not the checkpoint failing.
            raise cause from None
        problem = f"{type(cause).__name__}: {cause}".splitlines()[0]
    # Every rank's part is on disk (all agree) before the checkpoint may count.
    _agree_written(model, path, problem)
    if _rank() == 0:
        record = {kind: step, **(meta or {})}
        tmp = path / f".{META}.tmp"
        try:
            tmp.write_text(json.dumps(record))
            os.replace(tmp, path / META)
        except OSError as exc:
            problem = f"{type(exc).__name__}: {exc}".splitlines()[0]
    _agree_written(model, path, problem)
    if _rank() == 0:
        for old in complete_checkpoints(Path(folder), kind)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    return path


class CheckpointWriteError(OSError):
    """A checkpoint could not be written (a full disk, a quota): nothing of it is left,
    and the newest complete one before it stays valid."""


def _cause(exc: BaseException) -> BaseException:
    """What went wrong at the root (DCP wraps each rank's error in its
    CheckpointException; the lowest rank's is taken)."""
    while isinstance(exc, CheckpointException) and exc.failures:
        exc = exc.failures[min(exc.failures)][0]
    while exc.__cause__ is not None:
        exc = exc.__cause__
    return exc


def _agree_written(model: nn.Module, path: Path, problem: str | None) -> None:
    """Whether every rank wrote its part (a collective, in place of a barrier); raise
    :class:`CheckpointWriteError` on every rank where one did not, after rank 0
    removed what was written."""
    failed = problem is not None
    if dist.is_initialized():
        flags = collectives.all_reduce_values(
            [float(failed)], device=_device(model), where="checkpoint.save"
        )
        failed = bool(flags[0])
    if not failed:
        return
    if _rank() == 0:
        shutil.rmtree(path, ignore_errors=True)
    _barrier(model)
    why = problem or "another rank of the site could not write its part"
    raise CheckpointWriteError(f"checkpoint {path.name} could not be written: {why}")


def load_checkpoint(path: str | Path, model: nn.Module, optimizer: Optimizer) -> dict[str, Any]:
    """Load ``path`` into ``model`` and ``optimizer`` (same layout as when saved);
    return its meta (the step or round, and what the caller recorded)."""
    path = Path(path)
    meta_path = path / META
    if not meta_path.is_file():
        raise FileNotFoundError(f"{path}: not a complete checkpoint (no {META})")
    model_state, optimizer_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optimizer": optimizer_state}
    dcp.load(state, checkpoint_id=str(path))
    set_state_dict(
        model,
        optimizer,
        model_state_dict=state["model"],
        optim_state_dict=state["optimizer"],
    )
    return json.loads(meta_path.read_text())


def load_extra(path: str | Path) -> dict[str, Any]:
    """This rank's ``extra`` state of the checkpoint at ``path``."""
    target = Path(path) / f"rank-{_rank()}.pt"
    if not target.is_file():
        raise FileNotFoundError(f"{target}: this rank's state is missing from the checkpoint")
    return torch.load(target, weights_only=True, map_location="cpu")  # callers copy to their device
