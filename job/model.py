"""The job: its sites, emulated links, control plane, TLS and settings, as plain data.

A :class:`Job` is what a job file means once it has been read and validated
(:func:`isthmus.job.file.load_job` builds one, with every problem reported
by line); every layer reads it and none is needed to describe it: this module
imports only the job model's own settings.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from isthmus.job.broker import Broker
from isthmus.job.fault_schedule import Fault, Slowdown
from isthmus.job.layout import Layout
from isthmus.job.link import LinkParams
from isthmus.job.ports import free_ports
from isthmus.job.settings import TrainSettings
from isthmus.job.tune import TuneSettings


@dataclass(frozen=True, kw_only=True)
class SiteSpec:
    """One site of the job."""

    name: str
    ranks: int = 1
    nodes: int = 1
    """Machines the site's ranks run on, ``ranks / nodes`` each (``isthmus site``
    starts torchrun with this layout, and checks the one torchrun reports)."""
    address: tuple[str, int] | None = None
    """Where rank 0's peer service listens; rank r listens on port + r (on its node)."""
    advertise: tuple[tuple[str, int], ...] | None = None
    """The addresses peers dial (NAT, port forwarding, load balancers): one for rank 0
    (rank r is port + r) or one per rank (a site on several nodes). Default: address."""
    uplink_mbit: float | None = None
    """Emulation only: cap on the site's total WAN egress, and on its ingress."""
    parallel: Layout | None = None
    """The job file's ``parallel:`` degrees; see :attr:`layout`."""

    @property
    def layout(self) -> Layout:
        """How the site's ranks split model and data; by default all data-parallel."""
        return self.parallel or Layout.for_ranks(self.ranks)

    def listen_addresses(self) -> list[tuple[str, int]] | None:
        if self.address is None:
            return None
        host, port = self.address
        return [(host, port + r) for r in range(self.ranks)]

    def dial_addresses(self) -> list[tuple[str, int]] | None:
        """Where peers reach each rank without emulation."""
        if self.advertise is not None and len(self.advertise) == self.ranks:
            return list(self.advertise)
        base = self.advertise[0] if self.advertise else self.address
        if base is None:
            return None
        host, port = base
        return [(host, port + r) for r in range(self.ranks)]

    @property
    def ranks_per_node(self) -> int:
        return self.ranks // self.nodes


@dataclass(frozen=True, kw_only=True)
class RegionSpec:
    """Sites that share long-haul capacity: the job file's ``regions:`` entries."""

    name: str
    sites: tuple[str, ...]
    egress_mbit: float | None = None
    """Emulation: one capacity shared by all traffic leaving the region for other
    regions, and separately by all traffic entering it from them."""


@dataclass(frozen=True, kw_only=True)
class WanSpec:
    """Emulated links: a default for every pair, overrides, and a fault schedule."""

    default: LinkParams
    overrides: dict[frozenset[str], tuple[tuple[str, str], LinkParams]] = field(
        default_factory=dict
    )
    faults: tuple[Fault, ...] = ()
    slowdowns: tuple[Slowdown, ...] = ()
    """Sites that compute slower for a while (``wan.faults`` entries with ``slow:``)."""
    between_regions: LinkParams | None = None
    """The default for a pair of sites in different regions (``default`` otherwise)."""

    def link_between(self, a: str, b: str, region_of: dict[str, str]) -> LinkParams:
        """The link of ``a`` and ``b`` as configured, its directions (a->b, b->a): an
        override, else the default across regions where they differ, else the default."""
        override = self.overrides.get(frozenset((a, b)))
        if override is not None:
            (first, _), params = override
            return params if first == a else LinkParams(params.b_to_a, params.a_to_b)
        different = a in region_of and b in region_of and region_of[a] != region_of[b]
        if different and self.between_regions is not None:
            return self.between_regions
        return self.default


@dataclass(frozen=True, kw_only=True)
class ControlSpec:
    """The job file's ``control:`` section: which MQTT broker, and how to log in."""

    broker: Broker
    wait_s: float = 10.0
    """How long a site waits for the broker at start before failing, naming it: a
    TLS connection across a WAN to a broker that is itself starting (it runs in one
    of the sites' data centres) takes seconds, not the milliseconds of a LAN."""
    password_env: str | None = None
    """The environment variable holding the password (kept out of the job file)."""

    def broker_for(self, site: str | None) -> Broker:
        """The broker with this site's login: ``{site}`` in the username, and in the
        client certificate's paths, is the site's name (one login per site, for a
        per-site ACL); without a site (``isthmus config set``, the online tuner) it is
        ``operator``, whose certificate ``isthmus certs --broker`` makes."""
        who = site or "operator"
        username = self.broker.username
        if username and site:
            username = username.replace("{site}", site)
        password = self.broker.password
        if self.password_env:
            password = os.environ.get(self.password_env, password)
        cert, key = (
            None if path is None else path.replace("{site}", who)
            for path in (self.broker.tls_cert, self.broker.tls_key)
        )
        return dataclasses.replace(
            self.broker, username=username, password=password, tls_cert=cert, tls_key=key
        )


@dataclass(frozen=True, kw_only=True)
class TlsSpec:
    """The job file's ``tls:`` section: mutual TLS between sites (the data plane).

    ``cert`` and ``key`` may hold ``{site}``, replaced by each site's name; paths
    are relative to the job file. Only the files of the site being started must
    exist where it runs."""

    ca: str
    cert: str
    key: str
    base: Path
    crl: str | None = None
    """The job's revocation list (``isthmus certs --revoke`` writes it), or None."""

    @property
    def crl_path(self) -> Path | None:
        return None if self.crl is None else self.base / self.crl

    def paths(self, site: str) -> tuple[Path, Path, Path]:
        """The CA certificate, and ``site``'s certificate and key (what
        :meth:`isthmus.inter.tls.SiteTls.load` reads)."""

        def path(template: str) -> Path:
            return self.base / template.replace("{site}", site)

        return path(self.ca), path(self.cert), path(self.key)


@dataclass(frozen=True, kw_only=True)
class MetricsSpec:
    """The job file's ``metrics:`` section: Prometheus endpoints of every rank."""

    prometheus_port: int
    """On a real cluster each rank serves ``/metrics`` on this port + its local rank;
    ``isthmus run`` on one machine picks free ports instead (``endpoints.json``)."""


@dataclass(frozen=True, kw_only=True)
class Job:
    """A validated job file."""

    name: str
    sites: tuple[SiteSpec, ...]
    train: TrainSettings
    wan: WanSpec | None = None
    seed: int = 0
    model: str = "tiny"
    """A built-in model size (:data:`isthmus.intra.model.SIZES`) or ``package.module:function``."""
    data: str = "stdlib"
    """``stdlib`` (the built-in corpus), an absolute path to a text or ``.pt`` token file,
    or ``package.module:function``."""
    control: ControlSpec | None = None
    """The control plane's broker; None: ``isthmus run`` starts an embedded one."""
    tune: TuneSettings = field(default_factory=TuneSettings)
    """What ``isthmus tune`` aims for, and ``isthmus run``'s online H controller."""
    tls: TlsSpec | None = None
    """Mutual TLS between sites; None: plaintext (emulated runs, trusted networks)."""
    insecure: bool = False
    """The job file's ``insecure: true``: run without TLS across a network (see
    :mod:`isthmus.job.exposure`)."""
    metrics: MetricsSpec | None = None
    """Prometheus endpoints (``metrics:``); None: none served."""
    regions: tuple[RegionSpec, ...] = ()
    """Groups of sites that share long-haul capacity; none: every site on its own."""
    source: str = "<job>"
    raw: dict[str, Any] = field(default_factory=dict, repr=False)

    def site(self, name: str) -> SiteSpec:
        for site in self.sites:
            if site.name == name:
                return site
        raise KeyError(f"no site {name!r} in job {self.name!r}; sites: {self.site_names()}")

    @property
    def algorithm(self) -> str:
        """The cross-site all-reduce the job's rounds use (``train.algorithm``, or
        its default: ``two_level`` with regions; ``auto`` on emulated links, whose
        costs the cost model knows, so each round takes one trip or two by its
        encoded size; else ``direct``)."""
        if self.train.algorithm is not None:
            return self.train.algorithm
        if self.regions:
            return "two_level"
        return "auto" if self.wan is not None else "direct"

    @property
    def survives_site_loss(self) -> bool:
        """Whether the run goes on when a site is lost: the membership protocol runs
        (:func:`isthmus.training.site_control.membership_for`). Every strategy's rounds
        run under membership views (:mod:`isthmus.inter.member_rounds`); it takes two
        sites. The launcher and every rank read this one rule."""
        return len(self.sites) >= 2

    def region_of(self) -> dict[str, str]:
        """Each site's region, by name (empty without ``regions:``)."""
        return {site: region.name for region in self.regions for site in region.sites}

    def site_names(self) -> str:
        return ", ".join(s.name for s in self.sites)

    def rank_addresses(self, host: str = "127.0.0.1") -> dict[str, list[tuple[str, int]]]:
        """Where every rank listens: the job file's address, or a free port on ``host``."""
        return {
            s.name: s.listen_addresses() or [(host, port) for port in free_ports(host, s.ranks)]
            for s in self.sites
        }
