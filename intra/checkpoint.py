"""Site checkpoints with torch.distributed.checkpoint: save, and resume where the site stopped.

Each site checkpoints its own state (model and optimizer, in whatever layout
it trains: FSDP shards, tensor-parallel pieces, pipeline stages) with
``torch.distributed.checkpoint``: every rank writes its part in parallel, and
the checkpoint can be loaded by the same layout. A small ``meta.json`` (rank 0)
records the step and what the caller adds (the round, tokens seen...); it is
written last, so a checkpoint without it is incomplete and is never resumed.

Layout on disk: ``DIR/step-000012/`` with DCP's files and ``meta.json``;
:func:`latest_checkpoint` finds the newest complete one.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.optim import Optimizer

META = "meta.json"
_STEP_DIR = re.compile(r"^step-(\d+)$")


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def save_checkpoint(
    folder: str | Path,
    step: int,
    model: nn.Module,
    optimizer: Optimizer,
    *,
    meta: dict[str, Any] | None = None,
    keep: int = 2,
) -> Path:
    """Write the state after ``step`` steps; keep the newest ``keep`` checkpoints.
    Every rank of the site calls it."""
    path = Path(folder) / f"step-{step:06d}"
    model_state, optimizer_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=str(path))
    _barrier()
    if _rank() == 0:
        record = {"step": step, **(meta or {})}
        tmp = path / f".{META}.tmp"
        tmp.write_text(json.dumps(record))
        os.replace(tmp, path / META)
        for old in _complete(Path(folder))[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    _barrier()
    return path


def latest_checkpoint(folder: str | Path) -> Path | None:
    """The newest complete checkpoint under ``folder``, or None."""
    complete = _complete(Path(folder))
    return complete[-1] if complete else None


def _complete(folder: Path) -> list[Path]:
    if not folder.is_dir():
        return []
    found = [
        (int(m.group(1)), p)
        for p in folder.iterdir()
        if (m := _STEP_DIR.match(p.name)) and (p / META).is_file()
    ]
    return [p for _, p in sorted(found)]


def load_checkpoint(path: str | Path, model: nn.Module, optimizer: Optimizer) -> dict[str, Any]:
    """Load ``path`` into ``model`` and ``optimizer`` (same layout as when saved);
    return its meta (``step`` and what the caller recorded)."""
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
