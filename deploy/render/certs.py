"""``isthmus certs JOB.yaml --out DIR``: a job CA and one certificate per site.

The CA's key signs the site certificates and is needed again only to add a
site (run the command again with the same ``--out``: only the sites without a
certificate get one); keep it off the training machines. Each site gets ``SITE.crt`` and
``SITE.key`` and the CA's certificate ``ca.crt``, nothing else. With
``--broker HOST``, the control plane's broker gets a server certificate for
that host name or address (``broker.crt``, ``broker.key``) and the operator a
client certificate (``operator.crt``, ``operator.key``, for ``isthmus config
set``): a broker that requires client certificates of the job's CA then lets
in the sites and the operator, each under its own name (Mosquitto's
``use_identity_as_username``), and nobody else. Keys are ECDSA P-256 (small,
fast handshakes, supported by every gRPC build and by Mosquitto); files with
keys are written readable by their owner only.
"""

from __future__ import annotations

import datetime
import functools
import ipaddress
import os
from collections.abc import Callable, Sequence
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

VALID_DAYS = 365


def is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def make_certs(
    job: str,
    sites: Sequence[str],
    out: Path,
    *,
    days: int = VALID_DAYS,
    broker: Sequence[str] = (),
) -> list[Path]:
    """Write ``ca.crt``, ``ca.key`` and ``SITE.crt`` / ``SITE.key`` for every site
    into ``out``, and with ``broker`` (its host names or addresses) ``broker.crt``
    / ``.key`` and ``operator.crt`` / ``.key``; return the paths written.

    A job has one CA: where ``out`` holds it already, only the sites without a
    certificate get one, signed by it (a site added to a running job); a new CA
    would lock out every site holding the old one."""
    if broker and (clash := {"broker", "operator"} & set(sites)):
        raise FileExistsError(
            f"a site is named {sorted(clash)[0]!r}, which the broker's or operator's "
            "files would overwrite; rename the site or leave out --broker"
        )
    out.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.UTC)
    if (out / "ca.key").exists():
        return _add_sites(job, sites, out, now, days, broker)
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
    issue = functools.partial(_leaf, job, ca_name, ca_key, now, days, out)
    return written + _issue(issue, job, sites, broker)


def _add_sites(
    job: str,
    sites: Sequence[str],
    out: Path,
    now: datetime.datetime,
    days: int,
    broker: Sequence[str],
) -> list[Path]:
    """Certificates, signed by the job's existing CA, for the sites that have none."""
    ca_cert, ca_key = _load_ca(job, out)
    missing = [site for site in sites if not (out / f"{site}.crt").exists()]
    wants_broker = bool(broker) and not (out / "broker.crt").exists()
    if not missing and not wants_broker:
        raise FileExistsError(
            f"{out} holds this job's CA and a certificate for every site already; to add a "
            "site, name it in the job file first"
        )
    issue = functools.partial(_leaf, job, ca_cert.subject, ca_key, now, days, out)
    return _issue(issue, job, missing, broker if wants_broker else ())


def _load_ca(job: str, out: Path) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    """The job's CA in ``out``: its certificate and key, checked to be this job's."""
    try:
        ca_cert = x509.load_pem_x509_certificate((out / "ca.crt").read_bytes())
        ca_key = serialization.load_pem_private_key((out / "ca.key").read_bytes(), None)
    except (OSError, ValueError) as exc:
        raise FileExistsError(
            f"{out / 'ca.key'} exists but the CA cannot be read with {out / 'ca.crt'} ({exc}); "
            "use another --out for a new job"
        ) from None
    if not isinstance(ca_key, ec.EllipticCurvePrivateKey) or ca_cert.subject != x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, f"isthmus job {job}"),
            x509.NameAttribute(NameOID.COMMON_NAME, f"{job} CA"),
        ]
    ):
        raise FileExistsError(
            f"{out} holds the CA of another job ({ca_cert.subject.rfc4514_string()}); a job "
            "has one CA: use another --out"
        )
    return ca_cert, ca_key


REVOKED = "revoked.crl"


def revoke_site(
    job: str, site: str, out: Path, *, days: int = VALID_DAYS
) -> tuple[int, list[Path]]:
    """Revoke ``site``'s certificate in ``out`` (added to ``out/revoked.crl``, signed by
    the job's CA, with the serials revoked before) and give the site a new
    certificate and key. Returns the revoked serial number and the paths written.
    Every file is replaced whole (sites that follow their files must never read a
    half-written one)."""
    if not (out / "ca.key").exists():
        raise FileExistsError(f"{out} holds no job CA (ca.key); revoke where 'isthmus certs' wrote")
    ca_cert, ca_key = _load_ca(job, out)
    try:
        old = x509.load_pem_x509_certificate((out / f"{site}.crt").read_bytes())
    except (OSError, ValueError):
        raise FileExistsError(
            f"{out / (site + '.crt')}: no certificate of site {site!r} to revoke"
        ) from None
    now = datetime.datetime.now(datetime.UTC)
    builder = (
        x509.CertificateRevocationListBuilder()
        .issuer_name(ca_cert.subject)
        .last_update(now - datetime.timedelta(minutes=5))
        .next_update(now + datetime.timedelta(days=days))
    )
    revoked = {old.serial_number}
    if (out / REVOKED).exists():
        for entry in x509.load_pem_x509_crl((out / REVOKED).read_bytes()):
            revoked.add(entry.serial_number)
    for serial in sorted(revoked):
        builder = builder.add_revoked_certificate(
            x509.RevokedCertificateBuilder().serial_number(serial).revocation_date(now).build()
        )
    crl = builder.sign(ca_key, hashes.SHA256())
    written = [_replace(out / REVOKED, crl.public_bytes(serialization.Encoding.PEM))]
    staging = out / f".{site}.new"
    staging.mkdir(exist_ok=True)
    issue = functools.partial(_leaf, job, ca_cert.subject, ca_key, now, days, staging)
    for path in _issue(issue, job, [site], ()):
        os.replace(path, out / path.name)
        written.append(out / path.name)
    staging.rmdir()
    return old.serial_number, written


def _replace(path: Path, data: bytes) -> Path:
    temporary = path.with_name(f".{path.name}.{os.getpid()}")
    temporary.write_bytes(data)
    os.replace(temporary, path)
    return path


def _issue(
    issue: Callable[..., list[Path]], job: str, sites: Sequence[str], broker: Sequence[str]
) -> list[Path]:
    """A certificate for each site, and with ``broker`` the broker's and the operator's."""
    from isthmus.inter.tls import site_dns_name

    written: list[Path] = []
    for site in sites:
        # Every site is both a server (its peer service) and a client (it dials).
        alt = [x509.DNSName(site_dns_name(job, site))]
        written += issue(
            site, alt, [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
        )
    if broker:
        written += issue("broker", _names(broker), [ExtendedKeyUsageOID.SERVER_AUTH])
        written += issue("operator", [], [ExtendedKeyUsageOID.CLIENT_AUTH])
    return written


def _names(hosts: Sequence[str]) -> list[x509.GeneralName]:
    """Subject alternative names: an IP address as such, anything else as DNS."""
    names: list[x509.GeneralName] = []
    for host in hosts:
        if is_ip(host):
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        else:
            names.append(x509.DNSName(host))
    return names


def _leaf(
    job: str,
    ca_name: x509.Name,
    ca_key: ec.EllipticCurvePrivateKey,
    now: datetime.datetime,
    days: int,
    out: Path,
    name: str,
    alt_names: list[x509.GeneralName],
    usages: list[x509.ObjectIdentifier],
) -> list[Path]:
    """A certificate (common name ``name``) and key signed by the job's CA."""
    key = ec.generate_private_key(ec.SECP256R1())
    builder = (
        x509.CertificateBuilder()
        .subject_name(
            x509.Name(
                [
                    x509.NameAttribute(NameOID.ORGANIZATION_NAME, f"isthmus job {job}"),
                    x509.NameAttribute(NameOID.COMMON_NAME, name),
                ]
            )
        )
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
    )
    if alt_names:
        builder = builder.add_extension(x509.SubjectAlternativeName(alt_names), critical=False)
    cert = builder.sign(ca_key, hashes.SHA256())
    return [_write(out / f"{name}.crt", _pem(cert)), _write_key(out / f"{name}.key", key)]


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
