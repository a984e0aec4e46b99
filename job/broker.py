"""The job file's MQTT broker: where it is and how to log in (``control.broker``).

Plain data with its URL parsing, below every layer: the job model holds one, the
control plane (:mod:`isthmus.inter.control_plane`) connects to it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

if TYPE_CHECKING:
    import ssl


@dataclass(frozen=True)
class Broker:
    """Where the broker is and how to authenticate to it."""

    host: str
    port: int
    username: str | None = None
    password: str | None = field(default=None, repr=False)  # never in a log line
    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None

    @classmethod
    def from_url(cls, url: str, **options: Any) -> Broker:
        """``mqtt://host:port`` (``mqtts://`` for TLS; default ports 1883 / 8883)."""
        parts = urlsplit(url)
        if parts.scheme not in ("mqtt", "mqtts") or not parts.hostname:
            raise ValueError(f"broker {url!r}: give mqtt://host:port or mqtts://host:port")
        try:
            port = parts.port or (8883 if parts.scheme == "mqtts" else 1883)
        except ValueError:
            raise ValueError(f"broker {url!r}: the port must be a number 1-65535") from None
        return cls(parts.hostname, port, **options)

    @property
    def url(self) -> str:
        return f"{'mqtts' if self.tls_ca else 'mqtt'}://{self.host}:{self.port}"

    def tls_context(self) -> ssl.SSLContext | None:
        if not self.tls_ca:
            return None
        import ssl  # 20 ms: only where a connection is made, not for every job read

        context = ssl.create_default_context(cafile=self.tls_ca)
        if self.tls_cert:
            context.load_cert_chain(self.tls_cert, self.tls_key)
        return context

    def client(self, identifier: str, **options: Any) -> Any:
        import aiomqtt

        return aiomqtt.Client(
            self.host,
            self.port,
            identifier=identifier,
            username=self.username,
            password=self.password,
            tls_context=self.tls_context(),
            **options,
        )
