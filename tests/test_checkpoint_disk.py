"""A checkpoint that cannot be written (a full disk) fails that checkpoint, loudly,
leaves nothing of it behind, and the newest complete one stays what a resume goes
on from; the next checkpoint, once there is room, is written as usual. On a real
full file system: a small tmpfs, filled."""

from __future__ import annotations

import contextlib
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from needs import needs_root
from torch import nn

from isthmus.intra.checkpoint import (
    CheckpointWriteError,
    complete_checkpoints,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
)


@contextlib.contextmanager
def small_disk(folder: Path, size: str = "2m") -> Iterator[Path]:
    folder.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)],
                   check=True)  # fmt: skip
    try:
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], check=False)


def fill(disk: Path) -> Path:
    """Write zeros until the file system is full; returns the file (delete it to free)."""
    filler = disk / "filler"
    with filler.open("wb") as out, contextlib.suppress(OSError):
        while True:
            out.write(b"\0" * (64 << 10))
            out.flush()
    return filler


@needs_root
def test_a_checkpoint_on_a_full_disk_fails_alone_and_the_previous_one_stays(tmp_path):
    torch.manual_seed(0)
    model = nn.Linear(64, 64)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 64)).sum().backward()
    optimizer.step()
    with small_disk(tmp_path / "disk") as disk:
        folder = disk / "checkpoints"
        save_checkpoint(folder, 1, model, optimizer, extra={"round": 1}, kind="round")
        saved = {k: v.clone() for k, v in model.state_dict().items()}
        filler = fill(disk)
        with torch.no_grad():
            model.weight.add_(1.0)  # the state after round 2, which will not be written
        with pytest.raises(CheckpointWriteError, match=r"round-0*2 could not be written: OSError: .*No space left on device"):
            save_checkpoint(folder, 2, model, optimizer, extra={"round": 2}, kind="round")
        # Nothing of round 2 is left; round 1 is complete and loads as it was saved.
        assert [p.name for p in folder.iterdir() if "2" in p.name.split("-")[-1]] == []
        assert latest_checkpoint(folder, "round").name.endswith("1")
        fresh = nn.Linear(64, 64)
        load_checkpoint(latest_checkpoint(folder, "round"), fresh, torch.optim.AdamW(
            fresh.parameters()))  # fmt: skip
        for name, tensor in fresh.state_dict().items():
            assert torch.equal(tensor, saved[name]), name
        # Room again: the next checkpoint is written as usual.
        filler.unlink()
        save_checkpoint(folder, 3, model, optimizer, extra={"round": 3}, kind="round")
        assert [p.name[-1] for p in complete_checkpoints(folder, "round")] == ["1", "3"]
