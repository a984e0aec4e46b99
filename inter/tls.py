"""Mutual TLS between sites: who a peer is, proven by a certificate of the job's CA.

Every site holds the job's CA certificate and its own certificate and key
(``isthmus certs`` makes them). A site's certificate names the site twice: as
its common name, and as the DNS name ``<site>.<job>.isthmus``. A rank dialling
site X checks that the server's certificate carries X's DNS name (gRPC's
target-name override: the address dialled may be an IP, a NAT or a load
balancer, but the certificate must be X's); a server requires a client
certificate of the job's CA and refuses, with the caller's address in the log,
a peer whose certificate names another site than the one it claims. A peer
without such a certificate, or with one of another job's CA, fails the TLS
handshake itself: it never reaches Isthmus's code, gets nothing and gives
nothing.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import grpc

if TYPE_CHECKING:
    from isthmus.inter.revocation import Revocations

log = logging.getLogger(__name__)

DOMAIN = "isthmus"


def site_dns_name(job: str, site: str) -> str:
    """The name a site's certificate carries and its peers check."""
    return f"{site}.{job}.{DOMAIN}"


class TlsError(ValueError):
    """TLS files missing or unreadable; ``field`` names the job-file key."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


@dataclass(frozen=True)
class SiteTls:
    """One site's TLS material, in PEM; loaded from files (:meth:`load`), it follows
    them: replaced certificates are taken up without a restart."""

    job: str
    site: str
    ca: bytes
    cert: bytes
    key: bytes
    files: TlsFiles | None = field(default=None, compare=False, repr=False)
    """Where the material came from, read again when the files change."""
    revocations: Revocations | None = field(default=None, compare=False, repr=False)
    """The job's revocation list (``tls.crl``), if it names one."""

    @classmethod
    def load(
        cls, job: str, site: str, ca: Path, cert: Path, key: Path, crl: Path | None = None
    ) -> SiteTls:
        """Read the files; a missing one is named with its job-file key and the fix."""
        files = TlsFiles(job, site, ca, cert, key)
        revocations = None
        if crl is not None:
            from isthmus.inter.revocation import Revocations

            revocations = Revocations(crl, files.material[0])
            serial = revocations.revoked(files.material[1])
            if serial is not None:
                raise TlsError(
                    "tls.cert",
                    f"{cert} (serial {serial:x}) is revoked by the job's list {crl}: every "
                    "peer would refuse this site; copy it the certificate and key "
                    "'isthmus certs --revoke' made",
                )
        return cls(job, site, *files.material, files=files, revocations=revocations)

    def current(self) -> tuple[bytes, bytes, bytes]:
        """(ca, cert, key) as the files hold them now (checked; a bad replacement is
        logged and the material in force kept)."""
        if self.files is None:
            return self.ca, self.cert, self.key
        self.files.refresh()
        return self.files.material

    @property
    def generation(self) -> int:
        """Goes up each time the files are taken up again."""
        if self.files is None:
            return 0
        self.files.refresh()
        return self.files.generation

    def server_credentials(self) -> grpc.ServerCredentials:
        if self.files is None:
            return grpc.ssl_server_credentials(
                [(self.key, self.cert)], root_certificates=self.ca, require_client_auth=True
            )
        files = self.files
        served = [files.generation]

        def fetch() -> grpc.ServerCertificateConfiguration | None:
            # gRPC asks before each handshake: new files serve new connections, and
            # the connections up already keep theirs.
            try:
                files.refresh()
            except Exception:  # never let a bad file break the handshake thread
                log.exception("tls: reading the certificate files again failed")
                return None
            if files.generation == served[0]:
                return None
            served[0] = files.generation
            return _server_configuration(files.material)

        return grpc.dynamic_ssl_server_credentials(
            _server_configuration(files.material), fetch, require_client_authentication=True
        )

    def channel_credentials(self) -> grpc.ChannelCredentials:
        ca, cert, key = self.current()
        return grpc.ssl_channel_credentials(
            root_certificates=ca, private_key=key, certificate_chain=cert
        )

    def channel_options(self, peer_site: str) -> list[tuple[str, str]]:
        """Check the server's certificate against the site we mean to reach, whatever
        the address we dial."""
        return [("grpc.ssl_target_name_override", site_dns_name(self.job, peer_site))]


def _server_configuration(
    material: tuple[bytes, bytes, bytes],
) -> grpc.ServerCertificateConfiguration:
    ca, cert, key = material
    return grpc.ssl_server_certificate_configuration([(key, cert)], root_certificates=ca)


class TlsFiles:
    """A site's CA, certificate and key files, read again when one changes (a
    certificate replaced before it expires). A replacement is checked as at start;
    one that fails is logged and the material in force kept: a half-copied file
    must not take the site off the job."""

    def __init__(self, job: str, site: str, ca: Path, cert: Path, key: Path) -> None:
        self.job, self.site = job, site
        self.paths = (ca, cert, key)
        self.generation = 0
        self._stamp = self._stamps()
        self.material = _read_checked(job, site, ca, cert, key)

    def _stamps(self) -> tuple[tuple[int, int], ...]:
        stamps = []
        for path in self.paths:
            try:
                status = os.stat(path)
                stamps.append((status.st_mtime_ns, status.st_size))
            except OSError:
                stamps.append((-1, -1))
        return tuple(stamps)

    def refresh(self) -> bool:
        """Take up changed files; True when the material changed."""
        stamp = self._stamps()
        if stamp == self._stamp:
            return False
        self._stamp = stamp
        try:
            material = _read_checked(self.job, self.site, *self.paths)
        except TlsError as exc:
            log.error("tls: the replaced files are refused (%s); the ones in force stay", exc)
            return False
        if material == self.material:
            return False
        self.material = material
        self.generation += 1
        log.info("tls: took up new certificate files for site %r", self.site)
        return True


def _read_checked(
    job: str, site: str, ca: Path, cert: Path, key: Path
) -> tuple[bytes, bytes, bytes]:
    contents = {}
    for name, path in (("tls.ca", ca), ("tls.cert", cert), ("tls.key", key)):
        try:
            contents[name] = path.read_bytes()
        except (OSError, ValueError) as exc:  # ValueError: a NUL in the path
            why = getattr(exc, "strerror", None) or exc
            raise TlsError(
                name,
                f"cannot read {path} ({why}); make the files with "
                f"'isthmus certs JOB.yaml --out DIR' and copy each site its own",
            ) from None
        if b"-----BEGIN" not in contents[name]:
            raise TlsError(name, f"{path} is not a PEM file")
    _check_certificate(job, site, ca, cert, key, contents)
    return contents["tls.ca"], contents["tls.cert"], contents["tls.key"]


def _check_certificate(
    job: str, site: str, ca: Path, cert: Path, key: Path, contents: dict[str, bytes]
) -> None:
    """Refuse, before any peer sees them, files that would fail every handshake: a
    certificate of another site or job, one the job's CA did not sign, one out of
    its validity, a key that is not the certificate's. Each named with its field
    and the fix (a handshake failure would only say "certificate verify failed")."""
    import datetime

    from cryptography import x509
    from cryptography.exceptions import InvalidSignature
    from cryptography.hazmat.primitives import serialization

    remake = (
        "make this site's files with 'isthmus certs JOB.yaml --out DIR' (the same DIR "
        "keeps the job's CA)"
    )
    try:
        authority = x509.load_pem_x509_certificate(contents["tls.ca"])
    except ValueError:
        raise TlsError("tls.ca", f"{ca} holds no readable certificate") from None
    try:
        mine = x509.load_pem_x509_certificate(contents["tls.cert"])
    except ValueError:
        raise TlsError("tls.cert", f"{cert} holds no readable certificate; {remake}") from None
    try:
        names = mine.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        dns = names.get_values_for_type(x509.DNSName)
    except x509.ExtensionNotFound:
        dns = []
    wanted = site_dns_name(job, site)
    if wanted not in dns:
        raise TlsError(
            "tls.cert",
            f"{cert} is not site {site!r} of job {job!r}'s certificate (it names "
            f"{', '.join(dns) or 'no site'}, not {wanted}); {remake}",
        )
    try:
        mine.verify_directly_issued_by(authority)
    except (ValueError, TypeError, InvalidSignature):
        raise TlsError(
            "tls.cert",
            f"{cert} is not signed by the job's CA {ca}; the sites of a job share one CA: {remake}",
        ) from None
    now = datetime.datetime.now(datetime.UTC)
    if not mine.not_valid_before_utc <= now <= mine.not_valid_after_utc:
        raise TlsError(
            "tls.cert",
            f"{cert} is valid from {mine.not_valid_before_utc:%Y-%m-%d} to "
            f"{mine.not_valid_after_utc:%Y-%m-%d}, not now; {remake}",
        )
    try:
        private = serialization.load_pem_private_key(contents["tls.key"], password=None)
    except (ValueError, TypeError):
        raise TlsError("tls.key", f"{key} holds no readable unencrypted private key") from None
    public = serialization.PublicFormat.SubjectPublicKeyInfo
    encoding = serialization.Encoding.DER
    if private.public_key().public_bytes(encoding, public) != mine.public_key().public_bytes(
        encoding, public
    ):
        raise TlsError("tls.key", f"{key} is not the key of {cert}; {remake}")


def peer_certificate(context: grpc.aio.ServicerContext) -> bytes | None:
    """The caller's verified certificate, in PEM (None without TLS)."""
    auth = context.auth_context() or {}
    certs = auth.get("x509_pem_cert") or []
    return certs[0] if certs else None


def certified_sites(context: grpc.aio.ServicerContext) -> set[str]:
    """The site names the caller's verified certificate carries (empty without TLS)."""
    auth = context.auth_context() or {}
    names = {n.decode() for n in auth.get("x509_common_name", [])}
    for san in auth.get("x509_subject_alternative_name", []):
        names.add(san.decode().split(".", 1)[0])
    return names
