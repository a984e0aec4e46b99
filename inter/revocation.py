"""Certificates the job's CA has revoked: a revocation list the job file names (``tls.crl``).

gRPC's Python API takes no revocation list, so the check is Isthmus's own: a
site's peer service looks up the serial number of the caller's verified
certificate (from the TLS handshake) in the list at every call it admits
(``Hello``, ``Exchange``, ``FetchState``), and refuses a revoked one with
``REVOKED``. The list is read again whenever its file changes, so a
certificate revoked while the job runs is refused at its holder's next call,
without a restart. A list that the job's CA did not sign is refused: anyone
could otherwise write one that locks out every site.
"""

from __future__ import annotations

import datetime
import functools
import logging
import os
from pathlib import Path

from cryptography import x509

from isthmus.inter.tls import TlsError

log = logging.getLogger(__name__)


class Revocations:
    """The job's revocation list, read again when its file changes."""

    def __init__(self, path: Path, ca_pem: bytes) -> None:
        self.path = path
        self._ca = x509.load_pem_x509_certificate(ca_pem)
        self._stamp: tuple[int, int] | None = None
        self.serials: frozenset[int] = frozenset()
        self.refresh(first=True)

    def refresh(self, *, first: bool = False) -> None:
        """Read the list again if its file changed. The first read raises
        :class:`TlsError` naming ``tls.crl``; a later bad file is logged and the
        list in force kept (a half-written file must not let revoked sites back)."""
        try:
            status = os.stat(self.path)
        except OSError as exc:
            if first:
                raise TlsError(
                    "tls.crl", f"cannot read {self.path} ({exc.strerror}); {_MAKE}"
                ) from None
            log.error("tls.crl: cannot read %s (%s); the list read last stays", self.path, exc)
            return
        stamp = (status.st_mtime_ns, status.st_size)
        if stamp == self._stamp:
            return
        try:
            self.serials = self._read()
        except TlsError as exc:
            if first:
                raise
            log.error("%s; the list read last stays in force", exc)
            return
        self._stamp = stamp
        if not first:
            log.info(
                "tls.crl: read %s again: %d revoked certificates", self.path, len(self.serials)
            )

    def _read(self) -> frozenset[int]:
        data = self.path.read_bytes()
        try:
            if b"-----BEGIN" in data:
                crl = x509.load_pem_x509_crl(data)
            else:
                crl = x509.load_der_x509_crl(data)
        except ValueError:
            raise TlsError(
                "tls.crl", f"{self.path} holds no readable revocation list; {_MAKE}"
            ) from None
        if crl.issuer != self._ca.subject or not crl.is_signature_valid(self._ca.public_key()):
            raise TlsError(
                "tls.crl",
                f"{self.path} is not signed by the job's CA ({self._ca.subject.rfc4514_string()}); "
                f"{_MAKE}",
            )
        next_update = crl.next_update_utc
        if next_update is not None and next_update < datetime.datetime.now(datetime.UTC):
            log.warning(
                "tls.crl: %s was due to be replaced on %s; its revocations still hold",
                self.path,
                f"{next_update:%Y-%m-%d}",
            )
        return frozenset(entry.serial_number for entry in crl)

    def revoked(self, cert_pem: bytes) -> int | None:
        """The serial number of ``cert_pem`` if the list revokes it, else None."""
        self.refresh()
        if not self.serials:
            return None
        serial = _serial(cert_pem)
        return serial if serial in self.serials else None


@functools.lru_cache(maxsize=256)
def _serial(cert_pem: bytes) -> int:
    """A certificate's serial number. Cached: every call from a peer presents the same
    certificate, and parsing it is the only work a revocation check does."""
    return x509.load_pem_x509_certificate(cert_pem).serial_number


_MAKE = (
    "'isthmus certs JOB.yaml --out DIR --revoke SITE' writes DIR/revoked.crl, signed by "
    "the job's CA"
)
