"""TCP segmentation offload on the router's TUN devices: super-packets and their real segments.

With ``IFF_VNET_HDR`` and TSO offload enabled on a TUN device, the hosts' TCP
hands the router ~64 KB "super-packets" (one IP/TCP header, a virtio-net
header saying the segment size) instead of one packet per 1448-byte segment:
5-6x less CPU for the router. TCP on the wire still consists of real segments,
so the link model must count bytes and losses per segment, and a loss must
remove exactly the lost segments. :func:`slice_segments` cuts a super-packet
into a smaller one (or a single segment) covering a run of its segments, with
the IP and TCP headers fixed up; the receiving kernel completes the checksum
(``NEEDS_CSUM``), as it would for the original.

Layout of what a TUN with IFF_VNET_HDR reads and writes::

    virtio_net_hdr (10 bytes, little-endian) | IPv4 header | TCP header | payload
"""

from __future__ import annotations

import struct

VNET_HDR = struct.Struct("<BBHHHH")  # flags, gso_type, hdr_len, gso_size, csum_start, csum_offset
VNET_HDR_LEN = VNET_HDR.size
F_NEEDS_CSUM = 1
GSO_NONE = 0
GSO_TCPV4 = 1
GSO_ECN = 0x80

_TCP_FIN = 0x01
_TCP_PSH = 0x08
_TCP_CWR = 0x80


class Frame:
    """One read from a TUN with a virtio-net header: maybe a TCP super-packet.

    A plain class with slots, its sizes computed once: the router builds one per
    packet, so this is on its hottest path.
    """

    __slots__ = (
        "csum_offset",
        "csum_start",
        "flags",
        "gso_size",
        "gso_type",
        "headers_len",
        "is_tcp_gso",
        "packet",
        "segments",
        "wire_bytes",
    )

    def __init__(
        self,
        flags: int,
        gso_type: int,
        gso_size: int,
        csum_start: int,
        csum_offset: int,
        packet: bytes | memoryview,
    ) -> None:
        self.flags = flags
        self.gso_type = gso_type
        self.gso_size = gso_size
        self.csum_start = csum_start
        self.csum_offset = csum_offset
        self.packet = packet
        """The IP packet, without the virtio-net header."""
        self.is_tcp_gso = (gso_type & ~GSO_ECN) == GSO_TCPV4 and gso_size > 0
        if self.is_tcp_gso:
            ihl = (packet[0] & 0x0F) * 4
            self.headers_len = ihl + (packet[ihl + 12] >> 4) * 4
            self.segments, self.wire_bytes = _on_wire(len(packet), self.headers_len, gso_size)
        else:
            self.headers_len = 0
            self.segments = 1
            self.wire_bytes = len(packet)

    def encode(self) -> bytes:
        return (
            VNET_HDR.pack(
                self.flags,
                self.gso_type,
                self.headers_len,
                self.gso_size,
                self.csum_start,
                self.csum_offset,
            )
            + self.packet
        )


def _on_wire(packet_len: int, headers_len: int, gso_size: int) -> tuple[int, int]:
    """(segments, bytes on the wire) of a TCP super-packet: every segment carries
    its own IP and TCP headers."""
    segments = max(1, -(-(packet_len - headers_len) // gso_size))
    return segments, packet_len + (segments - 1) * headers_len


def measure(data: bytes) -> tuple[int, int]:
    """(segments, bytes on the wire) of a TUN read, without building a :class:`Frame`.

    The router's fast path: most frames are forwarded whole, and only their size
    on the wire matters. ``data`` must be an IPv4 read at least 30 bytes long.
    """
    if data[1] & ~GSO_ECN == GSO_TCPV4:
        gso_size = data[4] | data[5] << 8
        if gso_size:
            ihl = (data[VNET_HDR_LEN] & 0x0F) * 4
            headers_len = ihl + (data[VNET_HDR_LEN + ihl + 12] >> 4) * 4
            return _on_wire(len(data) - VNET_HDR_LEN, headers_len, gso_size)
    return 1, len(data) - VNET_HDR_LEN


def parse(data: bytes) -> Frame | None:
    """A TUN read -> :class:`Frame`, or None when it is too short to be one."""
    if len(data) < VNET_HDR_LEN + 20:
        return None
    flags, gso_type, _hdr_len, gso_size, csum_start, csum_offset = VNET_HDR.unpack_from(data)
    # A view, not a copy: a super-packet is ~64 KB and most are forwarded as read.
    packet = memoryview(data)[VNET_HDR_LEN:]
    return Frame(flags, gso_type, gso_size, csum_start, csum_offset, packet)


def _fold(total: int) -> int:
    while total >> 16:
        total = (total & 0xFFFF) + (total >> 16)
    return total


def _ip_checksum(header: bytes | bytearray) -> int:
    total = sum(struct.unpack(f"!{len(header) // 2}H", header))
    return ~_fold(total) & 0xFFFF


def slice_segments(frame: Frame, first: int, count: int) -> Frame:
    """The frame made of segments ``first .. first + count - 1`` of ``frame``.

    The IPv4 total length, identification and header checksum, the TCP sequence
    number and flags (FIN and PSH only on the last segment, CWR only on the
    first) and the TCP pseudo-header checksum seed are rewritten, so the
    receiving stack takes it as the sender's segments.
    """
    packet = frame.packet
    ihl = (packet[0] & 0x0F) * 4
    hlen = frame.headers_len
    size = frame.gso_size
    total_segments = frame.segments
    start = hlen + first * size
    payload = packet[start : start + count * size]
    header = bytearray(packet[:hlen])
    tcp_len = hlen - ihl + len(payload)
    # IPv4: total length, a distinct id per segment (as the kernel's GSO does),
    # and the header checksum.
    struct.pack_into("!H", header, 2, ihl + tcp_len)
    (ip_id,) = struct.unpack_from("!H", header, 4)
    struct.pack_into("!H", header, 4, (ip_id + first) & 0xFFFF)
    struct.pack_into("!H", header, 10, 0)
    struct.pack_into("!H", header, 10, _ip_checksum(header[:ihl]))
    # TCP: sequence number and flags.
    (seq,) = struct.unpack_from("!I", header, ihl + 4)
    struct.pack_into("!I", header, ihl + 4, (seq + first * size) & 0xFFFFFFFF)
    flags = header[ihl + 13]
    if first + count < total_segments:
        flags &= ~(_TCP_FIN | _TCP_PSH)
    if first > 0:
        flags &= ~_TCP_CWR
    header[ihl + 13] = flags
    # With NEEDS_CSUM the checksum field holds the folded pseudo-header sum
    # (not inverted); its TCP length changed.
    src_dst = struct.unpack_from("!4H", header, 12)
    seed = _fold(sum(src_dst) + 6 + tcp_len)
    struct.pack_into("!H", header, ihl + 16, seed)
    gso_type = frame.gso_type if count > 1 else GSO_NONE
    return Frame(F_NEEDS_CSUM, gso_type, size if count > 1 else 0, ihl, 16, bytes(header) + payload)
