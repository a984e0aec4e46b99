"""The records a run's sites write and its launcher reads: JSON lines, whole files.

Every record is one JSON object on one line with ``t`` (wall-clock seconds,
``time.time()``), ``site`` and ``kind``:

=================  ===========================================================================
kind               fields
=================  ===========================================================================
joined             written by rank 0 when the script calls ``isthmus.join()``: the launcher
                   fails a site that has not joined within ``--join-timeout``
start              ``ranks``, ``strategy``, ``steps``, ``ran`` (what the site trains:
                   :mod:`isthmus.training.description`)
described          ``fields``: what ``site.describe(...)`` added later, and how tokens and
                   the loss were counted
step               ``step`` (1-based), ``loss`` (mean over the site's ranks), ``tokens``
                   (cumulative, every data-parallel rank), ``compute_s`` (cumulative seconds
                   not blocked on the strategy), ``lr``
state              ``state``: ``computing``, ``waiting`` (for other sites to reach the round),
                   ``syncing`` (moving and averaging values), ``finished`` or ``run_over``
                   (back after every other site finished)
blocked            ``what`` (``waiting`` or ``syncing``), ``started`` (wall clock), ``seconds``
round              ``step``, ``outer_steps``, ``wan_bytes_sent``, ``wan_bytes_received``,
                   ``wan_bytes_sent_to`` (site -> bytes); cumulative, all the site's ranks;
                   ``all_reduce_rounds`` (algorithm -> rounds, cumulative, this rank's)
eval               ``step``, ``tokens``, ``eval_loss`` (held-out split), ``seconds`` it took;
                   ``final`` on the last
config             ``round``, ``step``, ``settings``: live settings applied from here on
checkpoint         ``round``, ``step``, ``path`` (relative to the run directory), ``seconds``
checkpoint_failed  ``round``, ``step``, ``error``, ``previous`` (the one to resume from)
slowdown           ``state`` (``started``, ``ended``), ``factor``, ``round``: a slow-site fault
resume             ``round``, ``step``: where ``isthmus run --resume`` went on from
=================  ===========================================================================

A site appends to its own file; the launcher is the only writer of the run's
merged ``metrics.jsonl``. A line cut short by a killed process is skipped.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from isthmus.job.basics import finite_or_none, to_json

if TYPE_CHECKING:  # the launcher reads records without importing torch
    from torch import nn


class RecordWriter:
    """Appends one site's records, one flushed line each; writes nothing when not
    ``enabled`` (every rank but the one that reports for the site).

    A field may be a number still on its way from the device (anything with
    ``ready()`` and ``__float__``, as
    :class:`~isthmus.training.host_values.LaterFloat`): the record is then
    held, with the time it was written at, until the value has arrived or the
    next record comes (or :meth:`release`, or :meth:`close`), so records keep
    their order and a GPU's step never waits for its own loss."""

    def __init__(self, path: Path, site: str, enabled: bool = True) -> None:
        self.site = site
        self._file = None
        self._held: dict[str, Any] | None = None
        self._lock = threading.Lock()  # the held record: the loop's and a strategy's
        if enabled:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._file = path.open("a", encoding="utf-8")
            if self._file.tell() and not _ends_with_newline(path):
                self._file.write("\n")  # a resumed run after a kill mid-line

    def write(self, kind: str, **fields: Any) -> None:
        if self._file is None:
            return
        record = {"t": time.time(), "site": self.site, "kind": kind, **fields}
        with self._lock:
            self._write_held()
            if any(_later(v) and not v.ready() for v in fields.values()):
                self._held = record
            else:
                self._append(record)

    def release(self) -> None:
        """Write a held record now (waiting for its values)."""
        with self._lock:
            self._write_held()

    def close(self) -> None:
        if self._file is not None:
            # A device that failed cannot give a held value: its record is lost with it.
            with contextlib.suppress(Exception):
                self.release()
            self._file.close()

    def _write_held(self) -> None:
        held, self._held = self._held, None
        if held is not None:
            self._append(held)

    def _append(self, record: dict[str, Any]) -> None:
        assert self._file is not None
        record = {k: float(v) if _later(v) else v for k, v in record.items()}
        self._file.write(to_json(record, default=_plain) + "\n")
        self._file.flush()


def _later(value: Any) -> bool:
    """A value still to be read from a device (records import no torch)."""
    return callable(getattr(value, "ready", None)) and hasattr(value, "__float__")


def _ends_with_newline(path: Path) -> bool:
    with path.open("rb") as f:
        f.seek(-1, 2)
        return f.read(1) == b"\n"


def _plain(value: Any) -> Any:
    if hasattr(value, "item"):  # a tensor or numpy scalar
        return finite_or_none(value.item())
    raise TypeError(f"not JSON: {value!r}")


class RecordTail:
    """Reads the records appended to a file since the last call (the file may
    not exist yet, and its last line may be half written)."""

    def __init__(self, path: Path, *, from_end: bool = False) -> None:
        """``from_end``: only records appended after now (a resumed run)."""
        self.path = path
        self._offset = path.stat().st_size if from_end and path.exists() else 0
        self._partial = b""

    def read(self) -> Iterator[dict[str, Any]]:
        try:
            with self.path.open("rb") as f:
                f.seek(self._offset)
                data = f.read()
        except FileNotFoundError:
            return
        self._offset += len(data)
        lines = (self._partial + data).split(b"\n")
        self._partial = lines.pop()
        for line in lines:
            try:
                yield json.loads(line)
            except ValueError:
                continue  # a line cut short by a killed process


def read_records(path: Path) -> list[dict[str, Any]]:
    """Every whole record of a file."""
    return list(RecordTail(path).read())


def write_json_atomic(path: Path, value: Any) -> None:
    """Write ``value`` as JSON: readers see the old file or the new one, never half."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(to_json(value, indent=2, default=_plain) + "\n")
    tmp.replace(path)


def parameter_digest(model: nn.Module) -> str:
    """SHA-256 of the model's parameters: for each in ``named_parameters()`` order,
    its name (UTF-8), a newline, then its values as contiguous little-endian
    float32. Equal digests mean bitwise-equal models."""
    digest = hashlib.sha256()
    for name, param in model.named_parameters():
        digest.update(name.encode() + b"\n")
        digest.update(param.detach().float().contiguous().cpu().numpy().tobytes())
    return digest.hexdigest()
