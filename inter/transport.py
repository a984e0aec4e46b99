"""gRPC settings for long, fat WAN links, shared by every server and channel of Isthmus.

Defaults of gRPC suit a data center. Across a WAN a stream must keep a whole
bandwidth-delay product in flight (1 Gbit/s x 100 ms = 12.5 MB), idle links
are cut by middleboxes unless kept alive, and both ends must agree on
keepalive or the server answers pings with GOAWAY ("too_many_pings").
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from isthmus.job.setting_groups import MAX_CONNECTIONS_PER_PEER

if TYPE_CHECKING:
    from isthmus.inter.tls import SiteTls
    from isthmus.job.model import Job

# The largest chunk a message may carry, plus room for the other fields.
MAX_CHUNK_BYTES = 16 * 1024 * 1024
MESSAGE_OVERHEAD_BYTES = 64 * 1024
DNS_RESOLVE_MIN_MS = 1000
"""The least time between two lookups of a peer's name (gRPC's default: 30 s)."""


@dataclass(frozen=True, kw_only=True)
class TransportSettings:
    """What both ends of a cross-site gRPC connection agree on."""

    max_chunk_bytes: int = 4 * 1024 * 1024
    """Encoded bytes per chunk message: big enough to amortise per-message cost,
    small enough to pipeline encode, send and decode."""

    stream_window_bytes: int = 64 * 1024 * 1024
    """Initial HTTP/2 stream window (lookahead): at least one bandwidth-delay product,
    so a stream is not held back waiting for WINDOW_UPDATEs. BDP probing then tunes it."""

    connections_per_peer: int = 1
    """TCP connections this rank opens to each peer rank; the chunks of every call are
    dealt over all of them. One TCP connection carries at most its window per round
    trip, and Linux caps a window at the receiver's largest socket buffer
    (``net.ipv4.tcp_rmem``'s third value: 6 MiB by default, often raised to 16-64 MiB
    on hosts tuned for a WAN). So 1 Gbit/s at 300 ms, a bandwidth-delay product of
    37.5 MB, needs three connections with 16 MiB windows: one fills 45% of it,
    whatever the stream windows above TCP say (see :func:`connections_for`)."""

    keepalive_s: float = 30.0
    """Ping an idle connection this often, so NATs and firewalls keep it open."""

    keepalive_timeout_s: float = 20.0
    """A ping unanswered this long marks the connection dead."""

    stall_s: float = 30.0
    """A stream with chunks out and no acknowledgement for this long is given up, its
    connection dropped and redialled, and the chunks sent again. Longer than one
    chunk takes to cross the slowest link behind a full queue; shorter than the
    keepalive's detection (keepalive_s + keepalive_timeout_s), which a garbled
    connection can also defeat."""

    reconnect_backoff_s: float = 2.0
    """Longest pause between attempts to reach a peer that refuses connections (a
    reset partition, a restarting site): how late a healed link is noticed."""

    max_streams_per_site: int = 256
    """Streams one site may hold open to a rank at once (every lane, shard and round
    in flight together stays far below). A stream beyond it is refused at once
    (RESOURCE_EXHAUSTED, logged and counted as FLOOD) and its sender, if it is a
    real site, sends again after a pause: a peer that opens streams without end
    costs this rank a bounded number of handlers."""

    max_streams_per_connection: int = 256
    """HTTP/2 ``max_concurrent_streams``: streams beyond it on one connection wait in
    the caller's own process, not here."""

    max_calls: int = 4096
    """Calls of every kind a rank serves at once, from all peers together; beyond it
    gRPC refuses new calls (RESOURCE_EXHAUSTED). Bounds a flood from many connections."""

    max_early_bytes_per_site: int = 1 << 30
    """Encoded bytes of one site's chunks a rank holds before their round opens
    (a faster peer's next round). Beyond it a chunk is not taken (ROUND_AHEAD) and its
    sender sends it again later. Give at least one round's share of the largest
    lane (with gather, a peer's share is its whole encoded lane), or a site one
    round ahead waits for this one to catch up."""

    tls: SiteTls | None = None
    """Mutual TLS with the job's CA (:mod:`isthmus.inter.tls`); None: plaintext, for
    emulated runs on one machine and networks the user already trusts."""

    def __post_init__(self) -> None:
        if not 1024 <= self.max_chunk_bytes <= MAX_CHUNK_BYTES:
            raise ValueError(
                f"max_chunk_bytes must be in [1 KiB, {MAX_CHUNK_BYTES >> 20} MiB], "
                f"got {self.max_chunk_bytes}"
            )
        if self.stream_window_bytes < 65535:
            raise ValueError(
                f"stream_window_bytes must be >= 65535, got {self.stream_window_bytes}"
            )
        if min(self.keepalive_s, self.keepalive_timeout_s, self.stall_s) <= 0:
            raise ValueError("keepalive_s, keepalive_timeout_s and stall_s must be > 0")
        for name in ("max_streams_per_site", "max_streams_per_connection", "max_calls"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_early_bytes_per_site < self.max_message_bytes:
            raise ValueError(
                f"max_early_bytes_per_site must hold at least one message "
                f"({self.max_message_bytes} bytes), got {self.max_early_bytes_per_site}"
            )
        if not 1 <= self.connections_per_peer <= MAX_CONNECTIONS_PER_PEER:
            raise ValueError(
                f"connections_per_peer must be in [1, {MAX_CONNECTIONS_PER_PEER}], "
                f"got {self.connections_per_peer}"
            )
        if self.reconnect_backoff_s < 0.5:
            raise ValueError(f"reconnect_backoff_s must be >= 0.5, got {self.reconnect_backoff_s}")

    @property
    def max_message_bytes(self) -> int:
        return self.max_chunk_bytes + MESSAGE_OVERHEAD_BYTES

    def _both_ends(self) -> list[tuple[str, Any]]:
        return [
            ("grpc.max_send_message_length", self.max_message_bytes),
            ("grpc.http2.lookahead_bytes", self.stream_window_bytes),
            ("grpc.http2.bdp_probe", 1),
            ("grpc.keepalive_time_ms", int(self.keepalive_s * 1000)),
            ("grpc.keepalive_timeout_ms", int(self.keepalive_timeout_s * 1000)),
            ("grpc.keepalive_permit_without_calls", 1),
        ]

    def channel_options(self) -> list[tuple[str, Any]]:
        return [
            *self._both_ends(),
            ("grpc.max_receive_message_length", self.max_message_bytes),
            ("grpc.http2.max_pings_without_data", 0),
            # gRPC backs off up to 120 s between attempts to reach a peer that refused
            # connections: a site would then notice a healed link minutes late. A
            # connection attempt every few seconds costs nothing on a WAN.
            ("grpc.initial_reconnect_backoff_ms", 500),
            ("grpc.max_reconnect_backoff_ms", int(self.reconnect_backoff_s * 1000)),
            # A peer started again behind the same name may have a new address (a
            # container or pod gets a new IP): gRPC looks the name up again when a
            # connection fails, but by default at most every 30 s, so a site dialled
            # the old address until its round deadline passed (seen with a killed
            # and restarted site container). One lookup a second at most.
            ("grpc.dns_min_time_between_resolutions_ms", DNS_RESOLVE_MIN_MS),
            # Each peer gets its own connection: parallel channels to one address
            # must not be merged into one TCP connection.
            ("grpc.use_local_subchannel_pool", 1),
        ]

    def server_options(self) -> list[tuple[str, Any]]:
        return [
            *self._both_ends(),
            # Up to twice the limit gets in, for the servicer to refuse by name (and
            # count); gRPC cuts larger ones itself, without a word to the handler.
            ("grpc.max_receive_message_length", 2 * self.max_message_bytes),
            # Accept the clients' keepalive pings. Their BDP probes count as pings
            # too: a probe sent while the connection has no stream (between rounds)
            # is a "bad ping", and after max_ping_strikes of them the server sends
            # GOAWAY too_many_pings and closes the connection, failing any stream
            # that just started on it (seen in site-loss runs). Peers are
            # authenticated sites, not strangers to be throttled: 0 accepts any
            # number of bad pings.
            ("grpc.http2.min_recv_ping_interval_without_data_ms", int(self.keepalive_s * 500)),
            ("grpc.http2.max_ping_strikes", 0),
            # gRPC sets SO_REUSEPORT by default: a second rank on the same port
            # would silently share it instead of failing.
            ("grpc.so_reuseport", 0),
            ("grpc.max_concurrent_streams", self.max_streams_per_connection),
        ]


def connections_for(bytes_per_s: float | None, rtt_s: float, window_bytes: int) -> int:
    """The TCP connections that keep a link of ``bytes_per_s`` and ``rtt_s`` full when
    each may have ``window_bytes`` in flight: its bandwidth-delay product over the
    window, plus a quarter for the round trip's slack (a window is returned a round
    trip after it left, and a little later under load), at least 1 and at most
    :data:`MAX_CONNECTIONS_PER_PEER`. An uncapped link gets one."""
    if bytes_per_s is None or rtt_s <= 0:
        return 1
    needed = math.ceil(1.25 * bytes_per_s * rtt_s / window_bytes)
    return max(1, min(MAX_CONNECTIONS_PER_PEER, needed))


def connections_of(job: Job, site: str, *, window_bytes: int | None = None) -> int:
    """``train.connections_per_peer`` for ``site``'s ranks: the number given, or for
    ``auto`` what the site's longest-fat emulated link needs with the emulator's TCP
    window (the window a link's direction gives each connection, or ``window_bytes``
    where real TCP sets it: the packet-level hosts); 1 on a real WAN, whose links
    and buffers the job file does not state."""
    setting = job.train.connections_per_peer
    if setting != "auto":
        return int(setting)
    wan = job.wan
    if wan is None:
        return 1
    region_of = job.region_of()
    needed = 1
    for other in job.sites:
        if other.name == site:
            continue
        link = wan.link_between(site, other.name, region_of)
        rtt_s = (link.a_to_b.delay_ms + link.b_to_a.delay_ms) / 1e3
        for direction in (link.a_to_b, link.b_to_a):
            needed = max(
                needed,
                connections_for(
                    direction.rate_bytes_per_s, rtt_s, window_bytes or direction.window_bytes
                ),
            )
    return needed
