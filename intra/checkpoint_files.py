"""Where checkpoints lie on disk and which of them are complete, without torch.

A checkpoint is a folder ``DIR/<kind>-NNNNNN/`` whose ``meta.json`` is written
last (see :mod:`isthmus.intra.checkpoint`). Finding the newest complete one is
plain file work, kept apart from saving and loading so the launcher can look at
a run's checkpoints (``isthmus run --resume``) without importing torch, which
costs seconds of CPU per process on a small machine.
"""

from __future__ import annotations

import re
from pathlib import Path

META = "meta.json"
_NUMBERED = re.compile(r"^([a-z]+)-(\d+)$")


def checkpoint_path(folder: str | Path, number: int, kind: str = "step") -> Path:
    return Path(folder) / f"{kind}-{number:06d}"


def latest_checkpoint(folder: str | Path, kind: str = "step") -> Path | None:
    """The newest complete checkpoint under ``folder``, or None."""
    complete = complete_checkpoints(Path(folder), kind)
    return complete[-1] if complete else None


def complete_checkpoints(folder: str | Path, kind: str = "step") -> list[Path]:
    """The complete checkpoints under ``folder``, oldest first."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    found = [
        (int(m.group(2)), p)
        for p in folder.iterdir()
        if (m := _NUMBERED.match(p.name)) and m.group(1) == kind and (p / META).is_file()
    ]
    return [p for _, p in sorted(found)]


def checkpoint_number(path: Path) -> int:
    """The step or round a checkpoint directory is named after."""
    m = _NUMBERED.match(path.name)
    if m is None:
        raise ValueError(f"{path}: not a checkpoint directory (kind-NNNNNN)")
    return int(m.group(2))
