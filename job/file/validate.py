"""Validating a parsed job file: every problem at once, each with its field, line and fix.

The ``wan:`` section is :mod:`isthmus.job.file.wan_section`; the settings sections
are checked by their own dataclasses (:mod:`isthmus.job.settings`,
:mod:`isthmus.job.tune`), whose errors name the field.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from isthmus.job.addressing import parse_address
from isthmus.job.basics import is_number
from isthmus.job.broker import Broker
from isthmus.job.exposure import unprotected
from isthmus.job.file.regions_section import regions_section
from isthmus.job.file.wan_section import FAULT_KEYS, WAN_KEYS, wan_section
from isthmus.job.file.words import bad_name, join_path, kind, suggest, unknown
from isthmus.job.layout import Layout, LayoutError, check_sites
from isthmus.job.model import ControlSpec, Job, MetricsSpec, SiteSpec, TlsSpec
from isthmus.job.settings import SETTING_NAMES, TrainSettings, settings_problems
from isthmus.job.sizes import SIZES
from isthmus.job.tune import LIVE_SYNC_EVERY, TUNE_KEYS, TuneError, TuneSettings

NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")
TOP_LEVEL_KEYS = (
    "name",
    "seed",
    "sites",
    "regions",
    "wan",
    "train",
    "model",
    "data",
    "control",
    "tune",
    "tls",
    "insecure",
    "metrics",
)
METRICS_KEYS = ("prometheus_port",)
CONTROL_KEYS = ("broker", "username", "password", "password_env", "tls", "wait_s")
TLS_KEYS = ("ca", "cert", "key")
PEER_TLS_KEYS = (*TLS_KEYS, "crl")
SITE_KEYS = ("name", "ranks", "nodes", "address", "advertise", "uplink_mbit", "parallel")


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


class Validator:
    """Walks the parsed YAML, collecting every problem instead of stopping at the first."""

    def __init__(
        self,
        source: str,
        lines: dict[str, int],
        check_files: bool = True,
        require_tls: bool = False,
    ) -> None:
        self.source = source
        self.lines = lines
        self.check_files = check_files
        self.require_tls = require_tls
        """Refuse a job that would run without TLS across a network
        (:func:`isthmus.job.exposure.unprotected`)."""
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
            self.fail(path, f"{what} must be a mapping of keys to values, got {kind(value)}")
            return None
        for key in value:
            if key not in allowed:
                self.fail(join_path(path, str(key)), unknown(str(key), allowed))
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
            self.fail("name", bad_name(name))
        seed = data.get("seed", 0)
        if not (isinstance(seed, int) and not isinstance(seed, bool) and seed >= 0):
            self.fail("seed", f"must be an integer >= 0, got {seed!r}")
        sites = self.sites(data.get("sites"))
        # Links may name a site whose own entry has an error: that is reported
        # once, at the site, not again at every link that names it.
        names = self.named_sites
        regions = regions_section(self, data["regions"], names) if "regions" in data else ()
        wan = wan_section(self, data["wan"], names) if data.get("wan") is not None else None
        if wan is not None and wan.between_regions is not None and not regions:
            self.fail(
                "wan.between_regions",
                "the job has no regions: add a regions: section, or give these settings "
                "as wan.default",
            )
        train = self.train(data.get("train") or {})
        algorithm = train.algorithm if train is not None else None
        if algorithm == "two_level" and not regions:
            self.fail(
                "train.algorithm",
                "two_level needs the sites' regions: add a regions: section, or use direct, "
                "gather, ring or auto",
            )
        if algorithm == "auto" and wan is None:
            self.fail(
                "train.algorithm",
                "auto picks from the links' costs, which only an emulated job (a wan: "
                "section) states; use direct, gather, ring or two_level",
            )
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
        insecure = data.get("insecure", False)
        if not isinstance(insecure, bool):
            self.fail(
                "insecure",
                f"must be true or false, got {insecure!r}; true runs without TLS across a "
                "network, which only a private network you trust should",
            )
            insecure = False
        metrics = self.metrics(data["metrics"], sites) if data.get("metrics") is not None else None
        if self.problems:
            raise JobFileError(self.source, self.problems)
        assert train is not None
        job = Job(
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
            insecure=insecure,
            metrics=metrics,
            regions=regions,
            source=self.source,
            raw=data,
        )
        if self.require_tls:
            for path, message in unprotected(job):
                self.fail(path, message)
            if self.problems:
                raise JobFileError(self.source, self.problems)
        return job

    # -- tls ---------------------------------------------------------------------------
    def tls(self, value: Any) -> TlsSpec | None:
        raw = self.mapping(value, "tls", PEER_TLS_KEYS)
        if raw is None:
            return None
        crl = raw.get("crl")
        if crl is not None and (not isinstance(crl, str) or not crl or "{site}" in crl):
            self.fail(
                "tls.crl",
                f"must be the path of the job's revocation list (one for every site), got "
                f"{crl!r}; 'isthmus certs JOB.yaml --out DIR --revoke SITE' writes "
                "DIR/revoked.crl",
            )
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
        return TlsSpec(ca=raw["ca"], cert=raw["cert"], key=raw["key"], base=base.resolve(), crl=crl)

    # -- sites -------------------------------------------------------------------------
    def sites(self, value: Any) -> list[SiteSpec]:
        if value is None:
            self.fail("", "missing 'sites': list at least one site, e.g. sites: [{name: a}]")
            return []
        if not isinstance(value, list) or not value:
            self.fail("sites", f"must be a non-empty list of sites, got {kind(value)}")
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
            self.fail(f"{path}.name", bad_name(name))
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
        if uplink is not None and not (is_number(uplink, finite=False) and uplink > 0):
            self.fail(f"{path}.uplink_mbit", f"must be a positive number of Mbit/s, got {uplink!r}")
            ok = False
        layout = None
        if ok:
            parallel = raw.get("parallel")
            if parallel is not None and not isinstance(parallel, dict):
                self.fail(
                    f"{path}.parallel",
                    f"must be a mapping of degrees, e.g. {{dp_shard: 2}}, got {kind(parallel)}",
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

    # -- control plane -------------------------------------------------------------
    def metrics(self, raw: Any, sites: list[SiteSpec]) -> MetricsSpec | None:
        raw = self.mapping(raw, "metrics", METRICS_KEYS)
        if raw is None:
            return None
        port = raw.get("prometheus_port")
        # Each rank of a node serves on port + its local rank: the last must fit too.
        per_node = max((s.ranks_per_node for s in sites), default=1)
        if not (
            isinstance(port, int) and not isinstance(port, bool) and 1 <= port <= 65536 - per_node
        ):
            self.fail(
                "metrics.prometheus_port",
                f"must be a port number 1-{65536 - per_node} (rank r of a node serves on "
                f"port + r, and a node runs up to {per_node} ranks), got {port!r}",
            )
            return None
        return MetricsSpec(prometheus_port=port)

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
                self.fail(f"control.{key}", f"must be a string, got {kind(raw[key])}")
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
            self.fail("control.password_env", f"must be a variable name, got {kind(password_env)}")
        wait_s = raw.get("wait_s", ControlSpec.wait_s)
        if not (is_number(wait_s, finite=False) and wait_s > 0):
            self.fail("control.wait_s", f"must be a number of seconds > 0, got {wait_s!r}")
            wait_s = ControlSpec.wait_s
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
                f"unknown size {value!r}; {suggest(value, tuple(SIZES))}use one of "
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
        settings, problems = settings_problems(known)
        for problem in problems:
            self.fail(f"train.{problem.field}", problem.reason)
        return settings

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


__all__ = ["FAULT_KEYS", "WAN_KEYS", "JobFileError", "Validator"]
