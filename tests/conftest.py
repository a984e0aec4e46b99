"""Shared fixtures: a probe server and two-site emulated links over real loopback TCP;
the longest tests first on xdist workers."""

from __future__ import annotations

import json
import os

# Before torch is imported, here and in every process the tests start: one compute
# thread a process, as scripts/test.sh sets it (the processes share the cores).
os.environ.setdefault("OMP_NUM_THREADS", "1")
import statistics
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from needs import record_figure, record_skip

from isthmus.job.link import LinkParams
from isthmus.sim.emulator import BackgroundEmulator
from isthmus.sim.probe import ProbeServer
from isthmus.sim.topology import EmulatedSite, Fault, Topology

DURATIONS = Path(__file__).with_name("durations.json")
"""Seconds each test took in a recent whole-suite run (scripts/test_durations.py)."""


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """In scripts/test.sh's pass of slow tests (``ISTHMUS_LONGEST_FIRST=1``, on xdist
    workers): the longest tests first. A pass's wall time is its busiest worker's:
    in file order, a 60-80 s test that came late kept one worker busy for a minute
    after the other had run out of work. Longest first, the last tests handed out
    are short ones, whichever worker takes them (``worksteal`` gives each worker a
    contiguous part and an idle one takes the tail of another's). Every worker
    sorts the same way (the controller checks that their collections match). The
    pass of short tests keeps the file order: it has no long test to strand, and
    the one run that sorted it too took 2:57 against 2:06 the run before (the
    heaviest tests, each spawning ranks, then ran against each other)."""
    if os.environ.get("ISTHMUS_LONGEST_FIRST") != "1" or "PYTEST_XDIST_WORKER" not in os.environ:
        return
    if not DURATIONS.exists():
        return
    known = json.loads(DURATIONS.read_text())
    typical = statistics.median(known.values()) if known else 0.0
    items.sort(key=lambda item: -known.get(item.nodeid, typical))


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Every skip, and every figure a test recorded, for scripts/test.sh's closing
    lines (xdist's controller gets the workers' reports, so only it records them)."""
    if "PYTEST_XDIST_WORKER" in os.environ:
        return
    if report.skipped and not hasattr(report, "wasxfail"):
        record_skip(report.nodeid, report.longrepr)
    if report.when == "call":
        for name, value in report.user_properties:
            if name == "figure":
                record_figure(report.nodeid, str(value))


def pytest_collectreport(report: pytest.CollectReport) -> None:
    """A module skipped whole (its imports need what is missing)."""
    if report.skipped and "PYTEST_XDIST_WORKER" not in os.environ:
        record_skip(report.nodeid, report.longrepr)


@pytest.fixture
def probe() -> Iterator[ProbeServer]:
    with ProbeServer() as server:
        yield server


@contextmanager
def _two_sites(
    upstream: tuple[str, int], params: LinkParams, faults: tuple[Fault, ...] = (), seed: int = 0
) -> Iterator[BackgroundEmulator]:
    """Site "a" (clients only) linked to site "b", whose rank 0 is ``upstream``."""
    topology = Topology.full_mesh(
        [EmulatedSite(name="a", listen=()), EmulatedSite(name="b", listen=(upstream,))],
        default=params,
        faults=faults,
        seed=seed,
    )
    with BackgroundEmulator(topology) as wan:
        yield wan


@pytest.fixture
def two_sites():
    """Factory: ``with two_sites(upstream, params) as wan`` runs a two-site emulator."""
    return _two_sites
