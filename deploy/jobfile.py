"""The job file: one YAML document that describes a multi-site training job.

It is read once, validated completely, and every problem is reported together,
each as ``FILE:LINE: field.path: what is wrong (the fix)``. Nothing starts
from a job file with an error. The schema is documented in docs/job-file.md.

Shape (every section but ``name`` and ``sites`` is optional)::

    name: demo
    seed: 0
    sites:
      - {name: us-east, ranks: 2, address: 127.0.0.1:7100, advertise: 203.0.113.7:7100}
      - {name: eu-west, ranks: 1, uplink_mbit: 400}
    wan:
      default: {rtt_ms: 80, bandwidth_mbit: 1000}        # or {preset: transatlantic}
      links:
        - {between: [us-east, eu-west], rtt_ms: 75, jitter_ms: 2, loss: 0.001}
      faults:
        - {at_s: 30, link: [us-east, eu-west], action: partition, for_s: 10}
        - {at_round: 4, link: [us-east, eu-west], action: partition, for_rounds: 2}
    train: {strategy: diloco, steps: 600, sync_every: 50, codec: int8}
    control: {broker: mqtt://broker.example:1883}     # else an embedded broker
    tune: {target_utilization: 0.9, codecs: [none, int8], online: true}   # isthmus tune
    model: tiny            # a built-in size, or package.module:function
    data: stdlib           # the built-in corpus, a text or .pt file, or package.module:function
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import re
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from isthmus.inter.control import Broker
from isthmus.inter.settings import SETTING_NAMES, SettingError, TrainSettings
from isthmus.inter.tls import SiteTls
from isthmus.intra.layout import Layout, LayoutError, check_sites
from isthmus.intra.model import SIZES
from isthmus.sim.link import (
    DIRECTION_FIELDS,
    LINK_FIELDS,
    DirectionParams,
    LinkConfigError,
    LinkParams,
    link_changes_to_direction,
)
from isthmus.sim.presets import PRESETS
from isthmus.sim.topology import Fault, Site, Topology, validate_fault
from isthmus.sim.tuner import LIVE_SYNC_EVERY, TUNE_KEYS, TuneError, TuneSettings

NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")
TOP_LEVEL_KEYS = (
    "name",
    "seed",
    "sites",
    "wan",
    "train",
    "model",
    "data",
    "control",
    "tune",
    "tls",
)
CONTROL_KEYS = ("broker", "username", "password", "password_env", "tls", "wait_s")
TLS_KEYS = ("ca", "cert", "key")
SITE_KEYS = ("name", "ranks", "nodes", "address", "advertise", "uplink_mbit", "parallel")
WAN_KEYS = ("default", "links", "faults")
FAULT_KEYS = (
    "at_s",
    "at_round",
    "link",
    "action",
    "for_s",
    "for_rounds",
    "rounds_of",
    "mode",
    "period_s",
    "down_s",
    "rate",
    "changes",
)


class JobFileError(ValueError):
    """Every problem found in a job file, each naming its field, line and fix."""

    def __init__(self, source: str, problems: list[tuple[str, int | None, str]]) -> None:
        self.source = source
        self.problems = problems
        super().__init__("\n".join(self.lines()))

    def lines(self) -> list[str]:
        out = []
        for path, line, message in self.problems:
            where = f"{self.source}:{line}" if line else self.source
            out.append(f"{where}: {path}: {message}" if path else f"{where}: {message}")
        return out


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
class WanSpec:
    """Emulated links: a default for every pair, overrides, and a fault schedule."""

    default: LinkParams
    overrides: dict[frozenset[str], tuple[tuple[str, str], LinkParams]] = field(
        default_factory=dict
    )
    faults: tuple[Fault, ...] = ()


@dataclass(frozen=True, kw_only=True)
class ControlSpec:
    """The job file's ``control:`` section: which MQTT broker, and how to log in."""

    broker: Broker
    wait_s: float = 3.0
    """How long a site waits for the broker at start before failing, naming it."""
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

    def for_site(self, job: str, site: str) -> SiteTls:
        def path(template: str) -> Path:
            return self.base / template.replace("{site}", site)

        return SiteTls.load(job, site, path(self.ca), path(self.cert), path(self.key))


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
    source: str = "<job>"
    raw: dict[str, Any] = field(default_factory=dict, repr=False)

    def site(self, name: str) -> SiteSpec:
        for site in self.sites:
            if site.name == name:
                return site
        raise KeyError(f"no site {name!r} in job {self.name!r}; sites: {self.site_names()}")

    def site_names(self) -> str:
        return ", ".join(s.name for s in self.sites)

    def topology(self, listen: dict[str, list[tuple[str, int]]]) -> Topology:
        """The emulated topology, with ``listen[site]`` the real address of each rank."""
        wan = self.wan or WanSpec(default=LinkParams())
        sites = [
            Site(name=s.name, listen=tuple(listen[s.name]), uplink_mbit=s.uplink_mbit)
            for s in self.sites
        ]
        return Topology.full_mesh(
            sites, default=wan.default, overrides=wan.overrides, faults=wan.faults, seed=self.seed
        )

    def rank_addresses(self, host: str = "127.0.0.1") -> dict[str, list[tuple[str, int]]]:
        """Where every rank listens: the job file's address, or a free port on ``host``."""
        return {s.name: s.listen_addresses() or free_ports(host, s.ranks) for s in self.sites}


def free_ports(host: str, count: int) -> list[tuple[str, int]]:
    """``count`` ports free on ``host`` now, where outgoing connections do not take
    them (:func:`isthmus.intra.launch.free_ports`)."""
    from isthmus.intra.launch import free_ports as pick

    return [(host, port) for port in pick(host, count)]


def free_port_blocks(host: str, sizes: list[int]) -> list[int]:
    """A base port per entry of ``sizes`` such that ``base .. base + size - 1`` are
    all free now and no two blocks overlap: a site's rank r listens on base + r."""
    bases: list[int] = []
    taken: set[int] = set()
    for size in sizes:
        for _ in range(100):
            ((_, base),) = free_ports(host, 1)
            block = set(range(base, base + size))
            if base + size <= 65536 and not block & taken and _all_free(host, block):
                bases.append(base)
                taken |= block
                break
        else:
            raise RuntimeError(f"no block of {size} free ports found on {host}")
    return bases


def _all_free(host: str, ports: set[int]) -> bool:
    for port in ports:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
            try:
                sock.bind((host, port))
            except OSError:
                return False
    return True


class _Loader(yaml.SafeLoader):
    """YAML as people write numbers: PyYAML follows YAML 1.1, which reads ``1e-5``
    (no dot) as a string; YAML 1.2 and everyone else read a float."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def load_yaml(text: str) -> Any:
    """Parse YAML text (a job file, a ``key=value`` setting) as Isthmus reads it."""
    return yaml.load(text, Loader=_Loader)


def load_job(path: str | Path, *, check_files: bool = True) -> Job:
    """Read and validate a job file; raise :class:`JobFileError` listing every problem.
    ``check_files=False``: the files it names need not exist yet (``isthmus certs``
    makes the certificates the job file already names)."""
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise JobFileError(str(path), [("", None, "file not found; check the path")]) from None
    except OSError as exc:
        raise JobFileError(str(path), [("", None, f"cannot read: {exc.strerror}")]) from None
    return parse_job(text, source=str(path), check_files=check_files)


def parse_job(text: str, *, source: str = "<job>", check_files: bool = True) -> Job:
    try:
        data = load_yaml(text)
        lines = _line_map(yaml.compose(text, Loader=_Loader))
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = mark.line + 1 if mark is not None else None
        problem = getattr(exc, "problem", None) or str(exc)
        raise JobFileError(source, [("", line, f"not valid YAML: {problem}")]) from None
    return _Validator(source, lines, check_files).job(data)


def _line_map(node: yaml.Node | None, path: str = "") -> dict[str, int]:
    """Map every field path (``sites[1].ranks``) to the 1-based line where it appears."""
    out: dict[str, int] = {}
    if node is None:
        return out
    out[path] = node.start_mark.line + 1
    if isinstance(node, yaml.MappingNode):
        for key, value in node.value:
            child = f"{path}.{key.value}" if path else str(key.value)
            out.update(_line_map(value, child))
            out[child] = key.start_mark.line + 1
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            out.update(_line_map(item, f"{path}[{i}]"))
    return out


class _Validator:
    """Walks the parsed YAML, collecting every problem instead of stopping at the first."""

    def __init__(self, source: str, lines: dict[str, int], check_files: bool = True) -> None:
        self.source = source
        self.lines = lines
        self.check_files = check_files
        self.problems: list[tuple[str, int | None, str]] = []
        self.named_sites: list[str] = []

    def fail(self, path: str, message: str) -> None:
        line = self.lines.get(path)
        probe = path
        while line is None and probe:
            # Up to the nearest enclosing field that has a line. A key YAML reads as
            # another type (null, 1.0) has no dot or index to strip: stop there.
            shorter = re.sub(r"(\.[^.\[]*|\[\d+\])$", "", probe)
            if shorter == probe:
                break
            probe = shorter
            line = self.lines.get(probe)
        self.problems.append((path, line, message))

    def mapping(self, value: Any, path: str, allowed: tuple[str, ...]) -> dict[str, Any] | None:
        what = path or "the job file"
        if not isinstance(value, dict):
            self.fail(path, f"{what} must be a mapping of keys to values, got {_kind(value)}")
            return None
        for key in value:
            if key not in allowed:
                self.fail(_join(path, str(key)), _unknown(str(key), allowed))
        return value

    # -- top level ------------------------------------------------------------------
    def job(self, data: Any) -> Job:
        if data is None:
            raise JobFileError(self.source, [("", None, "the file is empty; see docs/job-file.md")])
        data = self.mapping(data, "", TOP_LEVEL_KEYS)
        if data is None:
            raise JobFileError(self.source, self.problems)
        name = data.get("name")
        if name is None:
            self.fail("", "missing 'name': give the job a name, e.g. name: demo")
        elif not (isinstance(name, str) and NAME_PATTERN.match(name)):
            self.fail("name", _bad_name(name))
        seed = data.get("seed", 0)
        if not (isinstance(seed, int) and not isinstance(seed, bool) and seed >= 0):
            self.fail("seed", f"must be an integer >= 0, got {seed!r}")
        sites = self.sites(data.get("sites"))
        # Links may name a site whose own entry has an error: that is reported
        # once, at the site, not again at every link that names it.
        names = self.named_sites
        wan = self.wan(data["wan"], names) if data.get("wan") is not None else None
        train = self.train(data.get("train") or {})
        model = self.model(data.get("model", "tiny"), sites)
        control = self.control(data["control"]) if data.get("control") is not None else None
        data_source = self.data(data.get("data", "stdlib"))
        tune = self.tune(data.get("tune") or {}, train)
        if train is not None and sites and train.min_sites > len(sites):
            self.fail(
                "train.min_sites",
                f"the job has {len(sites)} sites, so a quorum of {train.min_sites} can never "
                f"be met; use at most {len(sites)} (0: half of them, rounded up)",
            )
        tls = self.tls(data["tls"]) if data.get("tls") is not None else None
        if self.problems:
            raise JobFileError(self.source, self.problems)
        assert train is not None
        return Job(
            name=name,
            sites=tuple(sites),
            train=train,
            wan=wan,
            seed=seed,
            model=model,
            data=data_source,
            control=control,
            tune=tune or TuneSettings(),
            tls=tls,
            source=self.source,
            raw=data,
        )

    # -- tls ---------------------------------------------------------------------------
    def tls(self, value: Any) -> TlsSpec | None:
        raw = self.mapping(value, "tls", TLS_KEYS)
        if raw is None:
            return None
        for key in TLS_KEYS:
            if not isinstance(raw.get(key), str) or not raw[key]:
                self.fail(
                    f"tls.{key}",
                    f"missing or not a path, got {raw.get(key)!r}; 'isthmus certs JOB.yaml "
                    "--out certs' makes the files and prints this section",
                )
        if self.problems:
            return None
        base = Path(self.source).parent if self.source != "<job>" else Path.cwd()
        return TlsSpec(ca=raw["ca"], cert=raw["cert"], key=raw["key"], base=base.resolve())

    # -- sites -------------------------------------------------------------------------
    def sites(self, value: Any) -> list[SiteSpec]:
        if value is None:
            self.fail("", "missing 'sites': list at least one site, e.g. sites: [{name: a}]")
            return []
        if not isinstance(value, list) or not value:
            self.fail("sites", f"must be a non-empty list of sites, got {_kind(value)}")
            return []
        out: list[SiteSpec] = []
        seen: dict[str, int] = {}
        for i, raw in enumerate(value):
            path = f"sites[{i}]"
            name = raw.get("name") if isinstance(raw, dict) else None
            if isinstance(name, str) and name in seen:
                self.fail(
                    f"{path}.name",
                    f"duplicate site name {name!r} (also sites[{seen[name]}]); "
                    "every site needs its own name",
                )
                continue
            if isinstance(name, str):
                seen[name] = i
                self.named_sites.append(name)
            site = self.site(raw, path)
            if site is not None:
                out.append(site)
        self.check_ports(out)
        if out:
            try:
                check_sites({s.name: s.layout for s in out})
            except LayoutError as exc:
                self.fail("sites", str(exc))
        return out

    def site(self, raw: Any, path: str) -> SiteSpec | None:
        raw = self.mapping(raw, path, SITE_KEYS)
        if raw is None:
            return None
        ok = True
        name = raw.get("name")
        if name is None:
            self.fail(path, "missing 'name': every site needs a name, e.g. name: us-east")
            ok = False
        elif not (isinstance(name, str) and NAME_PATTERN.match(name)):
            self.fail(f"{path}.name", _bad_name(name))
            ok = False
        ranks = raw.get("ranks", 1)
        if not (isinstance(ranks, int) and not isinstance(ranks, bool) and ranks >= 1):
            self.fail(
                f"{path}.ranks", f"must be an integer >= 1 (processes in the site), got {ranks!r}"
            )
            ok = False
        nodes = raw.get("nodes", 1)
        if not (isinstance(nodes, int) and not isinstance(nodes, bool) and nodes >= 1):
            self.fail(f"{path}.nodes", f"must be an integer >= 1 (machines), got {nodes!r}")
            ok = False
        elif ok and ranks % nodes:
            self.fail(
                f"{path}.nodes",
                f"{ranks} ranks do not split evenly over {nodes} nodes; every node runs "
                "ranks / nodes processes: change ranks or nodes",
            )
            ok = False
        address = self.address(raw.get("address"), f"{path}.address", ranks if ok else 1)
        advertise = self.advertised(raw.get("advertise"), f"{path}.advertise", ranks if ok else 1)
        uplink = raw.get("uplink_mbit")
        if uplink is not None and not (_is_number(uplink) and uplink > 0):
            self.fail(f"{path}.uplink_mbit", f"must be a positive number of Mbit/s, got {uplink!r}")
            ok = False
        layout = None
        if ok:
            parallel = raw.get("parallel")
            if parallel is not None and not isinstance(parallel, dict):
                self.fail(
                    f"{path}.parallel",
                    f"must be a mapping of degrees, e.g. {{dp_shard: 2}}, got {_kind(parallel)}",
                )
                ok = False
            else:
                try:
                    layout = Layout.for_ranks(ranks, parallel)
                except LayoutError as exc:
                    self.fail(f"{path}.parallel", str(exc).removeprefix("parallel: "))
                    ok = False
        if not ok:
            return None
        return SiteSpec(
            name=name,
            ranks=ranks,
            nodes=nodes,
            address=address,
            advertise=advertise,
            uplink_mbit=uplink,
            parallel=layout,
        )

    def address(self, value: Any, path: str, ranks: int) -> tuple[str, int] | None:
        if value is None:
            return None
        parsed = parse_address(value)
        if isinstance(parsed, str):
            self.fail(path, parsed)
            return None
        if parsed[1] + ranks - 1 > 65535:
            self.fail(
                path,
                f"rank r listens on port + r, so {ranks} ranks need ports up to "
                f"{parsed[1] + ranks - 1} > 65535; choose a lower port",
            )
            return None
        return parsed

    def advertised(self, value: Any, path: str, ranks: int) -> tuple[tuple[str, int], ...] | None:
        """``advertise``: one address (rank r is port + r) or a list, one per rank."""
        if value is None:
            return None
        if not isinstance(value, list):
            one = self.address(value, path, ranks)
            return None if one is None else (one,)
        if len(value) != ranks:
            self.fail(
                path,
                f"a list needs one address per rank: {ranks}, got {len(value)}; or give one "
                "address, and rank r is dialled at its port + r",
            )
            return None
        parsed = [self.address(v, f"{path}[{i}]", 1) for i, v in enumerate(value)]
        return None if any(p is None for p in parsed) else tuple(parsed)  # type: ignore[arg-type]

    def check_ports(self, sites: list[SiteSpec]) -> None:
        """Two sites must not be dialled at the same address. Sites on separate
        machines may listen on the same one (0.0.0.0:7100) when they advertise others."""
        used: dict[tuple[str, int], str] = {}
        for i, site in enumerate(sites):
            field = "advertise" if site.advertise else "address"
            for host, port in site.dial_addresses() or []:
                other = used.get((host, port))
                if other is not None:
                    self.fail(
                        f"sites[{i}].{field}",
                        f"{host}:{port} is also used by site {other!r} (rank r listens on "
                        "port + r); give each site its own port range, or its own "
                        "advertised address",
                    )
                    break
                used[(host, port)] = site.name

    # -- wan ---------------------------------------------------------------------------
    def wan(self, raw: Any, names: list[str]) -> WanSpec | None:
        raw = self.mapping(raw, "wan", WAN_KEYS)
        if raw is None:
            return None
        default = self.link_params(raw.get("default") or {}, "wan.default", between=None)
        overrides: dict[frozenset[str], tuple[tuple[str, str], LinkParams]] = {}
        links = raw.get("links") or []
        if not isinstance(links, list):
            self.fail("wan.links", f"must be a list of links, got {_kind(links)}")
            links = []
        for i, entry in enumerate(links):
            path = f"wan.links[{i}]"
            if not isinstance(entry, dict):
                self.fail(path, f"must be a mapping with 'between', got {_kind(entry)}")
                continue
            pair = self.pair(entry.get("between"), f"{path}.between", names)
            params = self.link_params(entry, path, between=pair)
            if pair is None or params is None:
                continue
            key = frozenset(pair)
            if key in overrides:
                self.fail(
                    f"{path}.between", f"link {pair[0]}<->{pair[1]} is listed twice; merge them"
                )
                continue
            overrides[key] = (pair, params)
        faults = self.faults(raw.get("faults") or [], names)
        if default is None:
            return None
        return WanSpec(default=default, overrides=overrides, faults=tuple(faults))

    def pair(self, value: Any, path: str, names: list[str]) -> tuple[str, str] | None:
        if value is None:
            self.fail(
                path.rsplit(".", 1)[0],
                f"missing '{path.rsplit('.', 1)[1]}': name two sites, e.g. [us-east, eu-west]",
            )
            return None
        if not (
            isinstance(value, list) and len(value) == 2 and all(isinstance(v, str) for v in value)
        ):
            self.fail(path, f"must name two sites, e.g. [us-east, eu-west], got {value!r}")
            return None
        a, b = value
        ok = True
        for site in (a, b):
            if site not in names:
                self.fail(
                    path, f"unknown site {site!r}; {_suggest(site, names)}sites: {', '.join(names)}"
                )
                ok = False
        if ok and a == b:
            self.fail(path, f"a link joins two different sites, got [{a}, {b}]")
            ok = False
        return (a, b) if ok else None

    def link_params(
        self, raw: Any, path: str, *, between: tuple[str, str] | None
    ) -> LinkParams | None:
        if not isinstance(raw, dict):
            self.fail(path, f"must be a mapping of link settings, got {_kind(raw)}")
            return None
        allowed = (*sorted(LINK_FIELDS), "preset")
        if between is not None:
            allowed = (*allowed, "between", "egress")
        settings = {k: v for k, v in raw.items() if k not in ("between", "egress")}
        for key in settings:
            if key not in allowed:
                self.fail(_join(path, key), _unknown(key, allowed))
                return None
        preset_name = settings.pop("preset", None)
        base: dict[str, Any] = {}
        if preset_name is not None:
            if not isinstance(preset_name, str) or preset_name not in PRESETS:
                self.fail(
                    f"{path}.preset",
                    f"unknown preset {preset_name!r}; {_suggest(str(preset_name), list(PRESETS))}"
                    f"presets: {', '.join(PRESETS)}",
                )
                return None
            base = dict(PRESETS[preset_name])
        base.update(settings)
        try:
            common = DirectionParams().replace(**link_changes_to_direction(base))
        except LinkConfigError as exc:
            self.fail(_join(path, "rtt_ms" if exc.field == "delay_ms" else exc.field), exc.reason)
            return None
        directions = {"a": common, "b": common}
        egress = raw.get("egress")
        if egress is not None and between is not None:
            if not isinstance(egress, dict):
                self.fail(f"{path}.egress", "must map a site of the link to its outgoing settings")
                return None
            for site, changes in egress.items():
                epath = f"{path}.egress.{site}"
                if site not in between:
                    self.fail(epath, f"not an end of this link; use {between[0]} or {between[1]}")
                    return None
                if not isinstance(changes, dict):
                    self.fail(epath, f"must be a mapping of link settings, got {_kind(changes)}")
                    return None
                bad = [k for k in changes if k not in DIRECTION_FIELDS | {"rtt_ms"}]
                if bad:
                    self.fail(_join(epath, bad[0]), _unknown(bad[0], tuple(sorted(LINK_FIELDS))))
                    return None
                one_way = dict(changes)
                if "rtt_ms" in one_way:
                    self.fail(
                        f"{epath}.rtt_ms", "one direction has no RTT; give delay_ms (one-way)"
                    )
                    return None
                try:
                    directions["a" if site == between[0] else "b"] = common.replace(**one_way)
                except LinkConfigError as exc:
                    self.fail(_join(epath, exc.field), exc.reason)
                    return None
        return LinkParams(directions["a"], directions["b"])

    def faults(self, raw: Any, names: list[str]) -> list[Fault]:
        if not isinstance(raw, list):
            self.fail("wan.faults", f"must be a list of faults, got {_kind(raw)}")
            return []
        out = []
        for i, entry in enumerate(raw):
            path = f"wan.faults[{i}]"
            entry = self.mapping(entry, path, FAULT_KEYS)
            if entry is None:
                continue
            missing = [k for k in ("link", "action") if k not in entry]
            if "at_s" not in entry and "at_round" not in entry:
                missing.insert(0, "at_s or at_round")
            if missing:
                self.fail(
                    path,
                    f"missing {', '.join(repr(m) for m in missing)}; "
                    "e.g. {at_s: 30, link: [a, b], action: partition, for_s: 10} or "
                    "{at_round: 4, link: [a, b], action: partition, for_rounds: 3}",
                )
                continue
            pair = self.pair(entry["link"], f"{path}.link", names)
            if pair is None:
                continue
            numbers = {}
            bad = False
            for key in ("at_s", "for_s", "period_s", "down_s", "rate"):
                value = entry.get(key)
                if key == "at_s" and value is None and "at_s" in entry:
                    self.fail(f"{path}.at_s", "must be a number of seconds from the start")
                    bad = True
                elif value is not None and not _is_number(value):
                    self.fail(f"{path}.{key}", f"must be a number, got {value!r}")
                    bad = True
                numbers[key] = value
            for key in ("at_round", "for_rounds"):
                value = entry.get(key)
                if key in entry and not (
                    isinstance(value, int) and not isinstance(value, bool) and value >= 1
                ):
                    hint = " (round 1 is the first round completed)" if value == 0 else ""
                    self.fail(
                        f"{path}.{key}",
                        f"must be a whole number of rounds >= 1, got {value!r}{hint}",
                    )
                    bad = True
                numbers[key] = value
            rounds_of = entry.get("rounds_of")
            if rounds_of is not None and not isinstance(rounds_of, str):
                self.fail(f"{path}.rounds_of", f"must be a site's name, got {_kind(rounds_of)}")
                bad = True
            changes = entry.get("changes") or {}
            if not isinstance(changes, dict):
                self.fail(
                    f"{path}.changes", f"must be a mapping of link settings, got {_kind(changes)}"
                )
                bad = True
            if bad:
                continue
            fault = Fault(
                at_s=numbers["at_s"],
                at_round=numbers["at_round"],
                link=pair,
                action=str(entry["action"]),
                for_s=numbers["for_s"],
                for_rounds=numbers["for_rounds"],
                rounds_of=rounds_of,
                mode=str(entry.get("mode", "blackhole")),
                period_s=numbers["period_s"],
                down_s=numbers["down_s"],
                rate=numbers["rate"],
                changes=dict(changes),
            )
            try:
                validate_fault(fault, names)
            except LinkConfigError as exc:
                field_path = (
                    f"{path}.changes.{exc.field}"
                    if fault.action == "brownout" and exc.field not in FAULT_KEYS
                    else f"{path}.{exc.field}"
                )
                self.fail(field_path, exc.reason)
                continue
            out.append(fault)
        return out

    # -- control plane -------------------------------------------------------------
    def control(self, raw: Any) -> ControlSpec | None:
        raw = self.mapping(raw, "control", CONTROL_KEYS)
        if raw is None:
            return None
        url = raw.get("broker")
        if not isinstance(url, str):
            self.fail("control.broker", f"give the broker as mqtt://host:port, got {url!r}")
            return None
        tls = raw.get("tls") or {}
        tls = self.mapping(tls, "control.tls", TLS_KEYS) or {}
        options: dict[str, Any] = {}
        for key in ("username", "password"):
            if raw.get(key) is not None and not isinstance(raw[key], str):
                self.fail(f"control.{key}", f"must be a string, got {_kind(raw[key])}")
            options[key] = raw.get(key)
        base = Path(self.source).parent if self.source != "<job>" else Path.cwd()
        for key in TLS_KEYS:
            if tls.get(key) is None:
                continue
            if "\0" in str(tls[key]):
                self.fail(f"control.tls.{key}", "a path cannot hold a NUL character")
                continue
            path = (base / str(tls[key])).resolve()
            # A per-site client certificate ({site}) exists only where that site runs.
            if self.check_files and "{site}" not in str(tls[key]) and not path.is_file():
                self.fail(f"control.tls.{key}", f"no file {str(path)!r}")
            options[f"tls_{key}"] = str(path)
        if (options.get("tls_cert") is None) != (options.get("tls_key") is None):
            self.fail("control.tls", "give both cert and key (a client certificate), or neither")
        password_env = raw.get("password_env")
        if password_env is not None and not isinstance(password_env, str):
            self.fail("control.password_env", f"must be a variable name, got {_kind(password_env)}")
        wait_s = raw.get("wait_s", 3.0)
        if not (_is_number(wait_s) and wait_s > 0):
            self.fail("control.wait_s", f"must be a number of seconds > 0, got {wait_s!r}")
            wait_s = 3.0
        try:
            broker = Broker.from_url(url, **options)
        except ValueError as exc:
            self.fail("control.broker", str(exc))
            return None
        if broker.url.startswith("mqtts") != url.startswith("mqtts"):
            self.fail(
                "control.broker", "mqtts:// needs control.tls.ca, and control.tls needs mqtts://"
            )
        return ControlSpec(broker=broker, wait_s=float(wait_s), password_env=password_env)

    # -- model and data --------------------------------------------------------------
    def model(self, value: Any, sites: list[SiteSpec]) -> str:
        if not isinstance(value, str) or not value:
            self.fail(
                "model",
                f"must be a built-in size ({', '.join(SIZES)}) or package.module:function, "
                f"got {value!r}",
            )
            return "tiny"
        if ":" in value:
            module, _, function = value.partition(":")
            if not (module and function):
                self.fail("model", f"{value!r} is not package.module:function")
            return value  # imported when the run starts, where its own packages are
        if value not in SIZES:
            self.fail(
                "model",
                f"unknown size {value!r}; {_suggest(value, tuple(SIZES))}use one of "
                f"{', '.join(SIZES)}, or package.module:function for your own model",
            )
            return value
        for index, site in enumerate(sites):
            try:
                site.layout.check_model(SIZES[value], where=f"sites[{index}]")
            except LayoutError as exc:
                self.fail(f"sites[{index}].parallel", str(exc).split(": ", 1)[-1])
        return value

    def data(self, value: Any) -> str:
        if not isinstance(value, str) or not value or "\0" in value:
            self.fail(
                "data",
                f"must be 'stdlib', a file, or package.module:function, got {value!r}",
            )
            return "stdlib"
        if value == "stdlib" or (":" in value and not Path(value).exists()):
            return value
        # Relative to the job file, so a job runs the same from any directory.
        base = Path(self.source).parent if self.source != "<job>" else Path.cwd()
        path = (base / value).resolve()
        if self.check_files and not path.is_file():
            self.fail(
                "data",
                f"no file {str(path)!r} (relative paths start at the job file's folder); "
                "give 'stdlib', a text file, a .pt token file, or package.module:function",
            )
        return str(path)

    # -- train ---------------------------------------------------------------------------
    def train(self, raw: Any) -> TrainSettings | None:
        raw = self.mapping(raw, "train", SETTING_NAMES)
        if raw is None:
            return None
        known = {k: v for k, v in raw.items() if k in SETTING_NAMES}
        try:
            return TrainSettings(**known)
        except SettingError as exc:
            self.fail(f"train.{exc.field}", exc.reason)
            return None

    # -- tune ----------------------------------------------------------------------------
    def tune(self, raw: Any, train: TrainSettings | None) -> TuneSettings | None:
        raw = self.mapping(raw, "tune", TUNE_KEYS)
        if raw is None:
            return None
        known = {k: v for k, v in raw.items() if k in TUNE_KEYS}
        if isinstance(known.get("codecs"), list):
            known["codecs"] = tuple(known["codecs"])
        try:
            tune = TuneSettings(**known)
        except TuneError as exc:
            self.fail(f"tune.{exc.field}", exc.reason)
            return None
        if tune.online and train is not None and train.strategy not in LIVE_SYNC_EVERY:
            self.fail(
                "tune.online",
                f"the {train.strategy} strategy fixes sync_every at the start; the online "
                f"controller needs {' or '.join(LIVE_SYNC_EVERY)} (or set online: false)",
            )
        if tune.online and train is not None and train.round_seconds is not None:
            self.fail(
                "tune.online",
                "rounds are time-budgeted (train.round_seconds), so sync_every, what the "
                "online controller moves, only caps them; set online: false or remove "
                "train.round_seconds",
            )
        return tune


def parse_address(value: Any) -> tuple[str, int] | str:
    """``host:port`` (IPv6 as ``[::1]:7100``) -> (host, port), or a message saying the fix."""
    if not isinstance(value, str):
        return f"must be 'host:port', e.g. 127.0.0.1:7100, got {value!r}"
    match = re.fullmatch(r"\[([0-9A-Fa-f:.]+)\]:(\d+)|([^:\s\[\]]+):(\d+)", value.strip())
    if not match:
        return f"must be 'host:port' (IPv6 as [::1]:7100), got {value!r}"
    host = match.group(1) or match.group(3)
    port = int(match.group(2) or match.group(4))
    if not 1 <= port <= 65535:
        return f"port must be in 1..65535, got {port}"
    return host, port


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _kind(value: Any) -> str:
    if value is None:
        return "nothing"
    return {dict: "a mapping", list: "a list", str: f"the text {value!r}"}.get(
        type(value), f"{value!r}"
    )


def _suggest(word: str, choices: list[str] | tuple[str, ...]) -> str:
    close = difflib.get_close_matches(word, list(choices), n=1)
    return f"did you mean {close[0]!r}? " if close else ""


def _unknown(key: str, allowed: tuple[str, ...]) -> str:
    return f"unknown key; {_suggest(key, allowed)}allowed here: {', '.join(allowed)}"


def _bad_name(value: Any) -> str:
    return (
        f"must be 1-63 letters, digits, '-', '_' or '.', starting with a letter or digit "
        f"(it names topics and files), got {value!r}"
    )
