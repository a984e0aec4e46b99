"""``isthmus check JOB.yaml``: validate a job file and show what it describes."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from isthmus.deploy.usage import add_command
from isthmus.job.exposure import insecure_warning
from isthmus.job.file import Job, load_job
from isthmus.job.link import describe_link
from isthmus.sim.topology import Topology


def register(commands: Any) -> None:
    sub = add_command(
        commands,
        "check",
        _check,
        help="validate a job file and print its sites, links and settings",
    )
    sub.add_argument("job", metavar="JOB.yaml", help="the job file")


def _check(args: argparse.Namespace) -> int:
    job = load_job(args.job, require_tls=True)
    print(describe_job(job))
    for warning in job_warnings(job):
        print(f"warning: {warning}", file=sys.stderr)
    lines, problems = check_certificates(job)
    problems += plugin_problems(job)
    for line in lines:
        print(line)
    for problem in problems:
        print(f"{args.job}: {problem}", file=sys.stderr)
    return 2 if problems else 0


def job_warnings(job: Job) -> list[str]:
    """What a valid job file says that cannot take effect as written, and an exposed
    job's warning: one line each."""
    from isthmus.job.settings import settings_warnings

    exposed = insecure_warning(job)
    found = [exposed] if exposed else []
    raw_train = job.raw.get("train") if isinstance(job.raw.get("train"), dict) else {}
    found += [f"train.{f}: {why}" for f, why in settings_warnings(raw_train, job.train)]
    if job.wan is not None and len(job.sites) < 2:
        found.append("wan: a one-site job has no links to emulate; add a site or remove wan:")
    return found


def plugin_problems(job: Job) -> list[str]:
    """``model:`` and ``data:`` given as ``package.module:function``, imported here as
    a rank will import them (from the current directory): what ``run`` would refuse."""
    import os
    from pathlib import Path

    specs = [("model", job.model)] if ":" in job.model else []
    if ":" in job.data and not Path(job.data).exists():
        specs.append(("data", job.data))
    if not specs:
        return []
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # a rank's `python -m` has it first
    from isthmus.intra.plugins import load_callable  # torch: only for a job that needs it

    problems = []
    for what, spec in specs:
        try:
            load_callable(spec, what)
        except ValueError as exc:
            problems.append(str(exc))
    return problems


EXPIRY_WARNING_DAYS = 30
"""A certificate that ends sooner than this is named: replace it while the job runs."""


def check_certificates(job: Job) -> tuple[list[str], list[str]]:
    """Each site's TLS files that are on this machine, checked as the site will check
    them at start (and the revocation list): lines to print, and problems (each
    naming its field). A site whose files live only on its own machine is said so."""
    import datetime

    from cryptography import x509

    from isthmus.inter.tls import SiteTls, TlsError

    if job.tls is None:
        return [], []
    lines, problems = [], []
    now = datetime.datetime.now(datetime.UTC)
    for site in job.sites:
        ca, cert, key = job.tls.paths(site.name)
        if not cert.exists() and not key.exists():
            lines.append(f"  tls {site.name}: files not on this machine ({cert.name})")
            continue
        try:
            SiteTls.load(job.name, site.name, ca, cert, key, crl=job.tls.crl_path)
        except TlsError as exc:
            problems.append(f"site {site.name}: {exc}")
            continue
        ends = x509.load_pem_x509_certificate(cert.read_bytes()).not_valid_after_utc
        days = (ends - now).days
        lines.append(f"  tls {site.name}: certificate valid until {ends:%Y-%m-%d} ({days} days)")
        if days < EXPIRY_WARNING_DAYS:
            lines.append(
                f"  warning: site {site.name}'s certificate ends in {days} days: make a new "
                "one (remove the old .crt/.key, run isthmus certs again) and copy it over "
                "the old; running sites take it up without a restart"
            )
    return lines, problems


def describe_job(job: Job) -> str:
    lines = [f"job {job.name!r}: {len(job.sites)} sites, strategy {job.train.strategy}"]
    for site in job.sites:
        where = "{}:{}".format(*site.address) if site.address else "(free ports when emulated)"
        extra = (
            ", advertise " + ", ".join("{}:{}".format(*a) for a in site.advertise)
            if site.advertise
            else ""
        )
        cap = f", uplink {site.uplink_mbit:g} Mbit/s" if site.uplink_mbit else ""
        noun = "rank" if site.ranks == 1 else "ranks"
        on = f" on {site.nodes} nodes" if site.nodes > 1 else ""
        lines.append(f"  site {site.name}: {site.ranks} {noun}{on} at {where}{extra}{cap}")
    for region in job.regions:
        cap = f", {region.egress_mbit:g} Mbit/s out and in" if region.egress_mbit else ""
        lines.append(f"  region {region.name}: {', '.join(region.sites)}{cap}")
    if job.wan is None:
        lines.append("  wan: none (real network; peers dial each site's advertised address)")
    else:
        topology = Topology.for_job(job, {s.name: [("127.0.0.1", 1)] * s.ranks for s in job.sites})
        for a, b in topology.pairs():
            p = topology.link_params(a, b)
            lines.append(f"  link {a}<->{b}: {describe_link(p.a_to_b, p.rtt_ms)}")
        for f in job.wan.faults:
            lasting = f" {f.describe_length()}" if f.describe_length() else ""
            lines.append(
                f"  fault at {f.describe_start()}: {f.action} {f.link[0]}<->{f.link[1]}{lasting}"
            )
        lines += [f"  slow site: {s.describe()}" for s in job.wan.slowdowns]
    lines += describe_train(job.train)
    return "\n".join(lines)


def describe_train(train: Any) -> list[str]:
    """The settings that apply to the job's strategy, one line per group."""
    import dataclasses

    from isthmus.job.settings import GROUPS, STRATEGY_GROUPS

    theirs = {g for groups in STRATEGY_GROUPS.values() for g in groups}
    applies = [g for g in GROUPS if g not in theirs or g in STRATEGY_GROUPS[train.strategy]]
    lines = [f"  train ({train.strategy}):"]
    for group in applies:
        values = ", ".join(f"{f.name}={getattr(train, f.name)}" for f in dataclasses.fields(group))
        lines.append(f"    {group.__name__.removesuffix('Settings').lower()}: {values}")
    return lines
