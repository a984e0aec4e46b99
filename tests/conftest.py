"""Shared fixtures: a probe server and two-site emulated links over real loopback TCP."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from isthmus.job.link import LinkParams
from isthmus.sim.emulator import BackgroundEmulator
from isthmus.sim.probe import ProbeServer
from isthmus.sim.topology import Fault, Site, Topology


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
        [Site(name="a", listen=()), Site(name="b", listen=(upstream,))],
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
