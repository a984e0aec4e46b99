"""``isthmus certs JOB.yaml --out DIR``: the command line of the job's certificates;
what makes them is :mod:`isthmus.deploy.render.certs` (cryptography loads only
when a command runs, not for ``--help``)."""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

from isthmus.deploy.usage import UsageError, add_command
from isthmus.job.file import load_job


def register(commands: Any) -> None:
    sub = add_command(
        commands,
        "certs",
        _certs,
        help="make a job CA and one TLS certificate per site (mutual TLS between sites)",
    )
    sub.add_argument("job", metavar="JOB.yaml", help="the job file (its name and sites)")
    sub.add_argument("--out", required=True, metavar="DIR", help="where to write the files")
    sub.add_argument(
        "--days", type=int, default=None, help="validity in days (default: one year)"
    )
    sub.add_argument(
        "--broker",
        action="append",
        default=[],
        metavar="HOST",
        help="also a server certificate for the control plane's broker at this host name "
        "or IP address (repeat for more names), and a client certificate for the operator",
    )
    sub.add_argument(
        "--revoke",
        metavar="SITE",
        help="revoke SITE's certificate (adds it to DIR/revoked.crl, which tls.crl names) "
        "and make the site a new one",
    )


def _certs(args: argparse.Namespace) -> int:
    from isthmus.deploy.render.certs import VALID_DAYS, is_ip, make_certs

    job = load_job(args.job, check_files=False)  # it may name the files made here
    if args.days is None:
        args.days = VALID_DAYS
    if args.days < 1:
        raise UsageError(f"--days: must be >= 1, got {args.days}")
    out = Path(args.out)
    if args.revoke is not None:
        return _revoke(job, args.revoke, out, args)
    for host in args.broker:
        if not host or " " in host or "/" in host or (":" in host and not is_ip(host)):
            raise UsageError(f"--broker: give a host name or IP address, got {host!r}")
    try:
        written = make_certs(
            job.name, [s.name for s in job.sites], out, days=args.days, broker=args.broker
        )
    except FileExistsError as exc:
        raise UsageError(str(exc)) from None
    for path in written:
        print(path)
    relative = os.path.relpath(out.resolve(), Path(args.job).resolve().parent)
    print(
        f"\nAdd to {args.job}, and give each site ca.crt, its own .crt and .key (not ca.key):\n"
        f"tls:\n  ca: {relative}/ca.crt\n  cert: {relative}/{{site}}.crt\n"
        f"  key: {relative}/{{site}}.key"
    )
    if args.broker:
        print(
            f"\nFor the broker (broker.crt / .key; require_certificate and "
            f"use_identity_as_username in deploy/mosquitto/mosquitto.conf):\n"
            f"control:\n  broker: mqtts://{args.broker[0]}:8883\n"
            f"  tls: {{ca: {relative}/ca.crt, cert: {relative}/{{site}}.crt, "
            f"key: {relative}/{{site}}.key}}"
        )
    return 0


def _revoke(job: Any, site: str, out: Path, args: argparse.Namespace) -> int:
    from isthmus.deploy.render.certs import REVOKED, revoke_site

    names = [s.name for s in job.sites]
    if site not in names:
        raise UsageError(
            f"--revoke: {site!r} is not a site of job {job.name!r} ({', '.join(names)})"
        )
    try:
        serial, written = revoke_site(job.name, site, out, days=args.days)
    except FileExistsError as exc:
        raise UsageError(f"--revoke: {exc}") from None
    for path in written:
        print(path)
    relative = os.path.relpath((out / REVOKED).resolve(), Path(args.job).resolve().parent)
    print(
        f"\nRevoked site {site!r}'s certificate (serial {serial:x}) and made it a new one.\n"
        f"Copy {out / REVOKED} to every site, where the job file's tls.crl names it:\n"
        f"tls:\n  crl: {relative}\n"
        f"and {site}.crt / {site}.key to site {site!r}. Running sites take up both without a "
        "restart; the old certificate is refused at its next call."
    )
    return 0
