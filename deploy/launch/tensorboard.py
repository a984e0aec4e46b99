"""TensorBoard event files of a run, one run per site under ``RUN_DIR/tensorboard/SITE``.

Written by the launcher from the records it merges, so sites need no extra
dependency and the files exist however the run ended. tensorboardX writes
the event format without pulling in TensorBoard itself (``tensorboard
--logdir RUN_DIR/tensorboard`` reads them).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any


def _summary_writer_class() -> Any:
    """tensorboardX's SummaryWriter, imported without torch where torch is not loaded.

    tensorboardX imports torch if it can, only to accept tensors as values; the
    launcher logs plain floats and otherwise never needs torch, whose import
    costs about 1.5 s of CPU on a 2-core machine, time the ranks starting beside
    it want. A ``None`` in ``sys.modules`` makes that optional import fail as if
    torch were absent; the entry is removed again straight after, so a later
    ``import torch`` in this process works as usual."""
    hide_torch = "torch" not in sys.modules
    if hide_torch:
        sys.modules["torch"] = None  # type: ignore[assignment]
    try:
        from tensorboardX import SummaryWriter
    finally:
        if hide_torch:
            del sys.modules["torch"]
    return SummaryWriter


class TensorBoardWriter:
    def __init__(self, folder: Path, sites: list[str], settings: dict[str, Any]) -> None:
        """``settings``: those that applied (what ``summary.json`` states), shown as
        text beside what each site says it trains."""
        SummaryWriter = _summary_writer_class()
        self._writers = {site: SummaryWriter(str(folder / site)) for site in sites}
        self._settings = settings

    def add(self, record: dict[str, Any]) -> None:
        writer = self._writers.get(record.get("site") or "")
        if writer is None:
            return
        kind, t = record["kind"], record["t"]
        if kind == "step":
            step = record["step"]
            if record["loss"] is not None:
                writer.add_scalar("loss/train", record["loss"], step, walltime=t)
            writer.add_scalar("tokens", record["tokens"], step, walltime=t)
            writer.add_scalar("lr", record["lr"], step, walltime=t)
        elif kind == "eval" and record["eval_loss"] is not None:
            writer.add_scalar("loss/eval", record["eval_loss"], record["step"], walltime=t)
        elif kind == "round":
            writer.add_scalar(
                "wan/bytes_sent", record["wan_bytes_sent"], record["step"], walltime=t
            )
            writer.add_scalar("outer_steps", record["outer_steps"], record["step"], walltime=t)
        elif kind == "blocked":
            writer.add_scalar(f"blocked_s/{record['what']}", record["seconds"], walltime=t)
        elif kind == "start":
            ran = record.get("ran") or {}
            rows = [*self._settings.items(), *((f"trained: {k}", v) for k, v in ran.items())]
            table = "| setting | value |\n| --- | --- |\n" + "\n".join(
                f"| {k} | {v} |" for k, v in rows
            )
            writer.add_text("run/what_ran", table, 0, walltime=t)
        elif kind == "config":
            changed = ", ".join(f"{k}={v}" for k, v in record["settings"].items())
            writer.add_text(
                "run/live_changes", f"from round {record['round']}: {changed}", record["step"],
                walltime=t,
            )  # fmt: skip

    def close(self) -> None:
        for writer in self._writers.values():
            writer.close()
