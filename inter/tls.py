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

from dataclasses import dataclass
from pathlib import Path

import grpc

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
    """One site's TLS material, in PEM."""

    job: str
    site: str
    ca: bytes
    cert: bytes
    key: bytes

    @classmethod
    def load(cls, job: str, site: str, ca: Path, cert: Path, key: Path) -> SiteTls:
        """Read the files; a missing one is named with its job-file key and the fix."""
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
        return cls(job, site, contents["tls.ca"], contents["tls.cert"], contents["tls.key"])

    def server_credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials(
            [(self.key, self.cert)], root_certificates=self.ca, require_client_auth=True
        )

    def channel_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            root_certificates=self.ca, private_key=self.key, certificate_chain=self.cert
        )

    def channel_options(self, peer_site: str) -> list[tuple[str, str]]:
        """Check the server's certificate against the site we mean to reach, whatever
        the address we dial."""
        return [("grpc.ssl_target_name_override", site_dns_name(self.job, peer_site))]


def certified_sites(context: grpc.aio.ServicerContext) -> set[str]:
    """The site names the caller's verified certificate carries (empty without TLS)."""
    auth = context.auth_context() or {}
    names = {n.decode() for n in auth.get("x509_common_name", [])}
    for san in auth.get("x509_subject_alternative_name", []):
        names.add(san.decode().split(".", 1)[0])
    return names
