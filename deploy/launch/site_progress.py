"""The site's progress as ``isthmus site`` prints it: a line per round, view and
rejoin, read from the site's records, and only on the first node of a site of
several (every node reads the same records on a shared file system)."""

from __future__ import annotations

import os
import socket
import sys
import threading
from pathlib import Path
from typing import Any

from isthmus.job.file import SiteSpec
from isthmus.training.log_format import say


def scheduler_node_index() -> tuple[str, str] | None:
    """(variable, value) of the scheduler's word on which node of its job this is:
    Slurm's ``SLURM_NODEID`` or a Kubernetes indexed job's ``JOB_COMPLETION_INDEX``."""
    for variable in ("SLURM_NODEID", "JOB_COMPLETION_INDEX"):
        if variable in os.environ:
            return variable, os.environ[variable]
    return None


def prints_progress(spec: SiteSpec, endpoint: str | None) -> bool:
    """Whether this node's launcher prints the site's progress: on a site of several
    nodes only the first does (every node reads the same records on a shared file
    system, and each line would come once per node). The first node is Slurm's
    node 0, a Kubernetes indexed job's pod 0, or else the node the rendezvous
    endpoint names."""
    if spec.nodes == 1:
        return True
    scheduled = scheduler_node_index()
    if scheduled is not None:
        return scheduled[1] == "0"
    if endpoint is None:
        return True
    host = endpoint.rsplit(":", 1)[0].strip("[]")
    try:
        address = socket.getaddrinfo(host, None)[0][4][0]
        family = socket.AF_INET6 if ":" in address else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.bind((address, 0))  # only an address of this machine binds
    except OSError:
        return False
    return True


class SiteProgress:
    """Prints the site's progress from its records: a line per round, view and rejoin."""

    POLL_S = 1.0

    def __init__(self, out: Path, site: str) -> None:
        from isthmus.training.records import RecordTail

        self.site = site
        self._tail = RecordTail(out / "sites" / site / "metrics.jsonl", from_end=True)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="isthmus-site-progress", daemon=True)
        self._loss: float | None = None
        self._round: int | None = None

    def start(self) -> SiteProgress:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._print_new()

    def _run(self) -> None:
        while not self._stop.wait(self.POLL_S):
            self._print_new()

    def _print_new(self) -> None:
        for record in self._tail.read():
            line = self.line_for(record)
            if line:
                say(line, prefix=f"{self.site}: ", stream=sys.stdout, record=record.get("kind"))

    def line_for(self, record: dict[str, Any]) -> str | None:
        kind = record.get("kind")
        if kind == "step":
            self._loss = record.get("loss")
            return None
        if kind == "round":
            if record.get("outer_steps") == self._round:
                return None  # the closing totals of the last round, already shown
            self._round = record.get("outer_steps")
            loss = f", loss {self._loss:.3f}" if isinstance(self._loss, float) else ""
            sent = record.get("wan_bytes_sent", 0) / 1e6
            return (
                f"round {record.get('outer_steps')} at step {record.get('step')}{loss}, "
                f"{sent:.1f} MB sent"
            )
        if kind == "view":
            return (
                f"view {record.get('epoch')}: members {', '.join(record.get('members', []))} "
                f"from round {record.get('start_round')} ({record.get('reason')})"
            )
        if kind == "rejoin":
            pulled = record.get("bytes", 0) / 1e6
            return (
                f"rejoined at round {record.get('round')}: pulled {pulled:.1f} MB from "
                f"{record.get('donor')} in {record.get('seconds', 0):.1f} s"
            )
        if kind == "eval" and record.get("final"):
            return f"final held-out loss {record.get('eval_loss'):.3f}"
        if kind == "state" and record.get("state") in ("finished", "left"):
            return str(record["state"])
        return None
