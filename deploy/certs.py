"""``isthmus certs JOB.yaml --out DIR``: a job CA and one certificate per site.

The CA's key signs the site certificates and is needed again only to add a
site; keep it off the training machines. Each site gets ``SITE.crt`` and
``SITE.key`` and the CA's certificate ``ca.crt``, nothing else. Keys are
ECDSA P-256 (small, fast handshakes, supported by every gRPC build); files
with keys are written readable by their owner only.
"""

from __future__ import annotations

import argparse
import datetime
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from isthmus.deploy.cli import UsageError, add_command
from isthmus.deploy.jobfile import load_job
from isthmus.inter.tls import site_dns_name

VALID_DAYS = 365


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
        "--days", type=int, default=VALID_DAYS, help=f"validity (default {VALID_DAYS})"
    )


def _certs(args: argparse.Namespace) -> int:
    job = load_job(args.job)
    if args.days < 1:
        raise UsageError(f"--days: must be >= 1, got {args.days}")
    out = Path(args.out)
    try:
        written = make_certs(job.name, [s.name for s in job.sites], out, days=args.days)
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
    return 0


def make_certs(job: str, sites: Sequence[str], out: Path, *, days: int = VALID_DAYS) -> list[Path]:
    """Write ``ca.crt``, ``ca.key`` and ``SITE.crt`` / ``SITE.key`` for every site
    into ``out``; return the paths written. Refuses to overwrite a CA: a new CA
    would lock out every site holding the old one."""
    out.mkdir(parents=True, exist_ok=True)
    if (out / "ca.key").exists():
        raise FileExistsError(
            f"{out / 'ca.key'} exists: a job has one CA; use another --out, or remove "
            "the old files if no site uses them"
        )
    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, f"isthmus job {job}"),
            x509.NameAttribute(NameOID.COMMON_NAME, f"{job} CA"),
        ]
    )
    ca_cert = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))  # clocks differ
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=False,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .sign(ca_key, hashes.SHA256())
    )
    written = [_write(out / "ca.crt", _pem(ca_cert)), _write_key(out / "ca.key", ca_key)]
    for site in sites:
        key = ec.generate_private_key(ec.SECP256R1())
        cert = (
            x509.CertificateBuilder()
            .subject_name(
                x509.Name(
                    [
                        x509.NameAttribute(NameOID.ORGANIZATION_NAME, f"isthmus job {job}"),
                        x509.NameAttribute(NameOID.COMMON_NAME, site),
                    ]
                )
            )
            .issuer_name(ca_name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=days))
            .add_extension(
                x509.SubjectAlternativeName([x509.DNSName(site_dns_name(job, site))]),
                critical=False,
            )
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            # Every site is both a server (its peer service) and a client (it dials).
            .add_extension(
                x509.ExtendedKeyUsage(
                    [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
                ),
                critical=False,
            )
            .sign(ca_key, hashes.SHA256())
        )
        written.append(_write(out / f"{site}.crt", _pem(cert)))
        written.append(_write_key(out / f"{site}.key", key))
    return written


def _pem(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def _write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> Path:
    data = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    return path
