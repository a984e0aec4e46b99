"""Cutting TCP offload super-packets into runs of their real segments."""

from __future__ import annotations

import struct

from isthmus.sim import gso


def super_packet(segments: int, mss: int = 1448, last: int | None = None, flags: int = 0x18):
    payload = bytes(range(256)) * ((segments * mss) // 256 + 1)
    payload = payload[: (segments - 1) * mss + (last if last is not None else mss)]
    tcp = bytearray(32)
    struct.pack_into("!HHI", tcp, 0, 40000, 9000, 1_000_000)
    tcp[12] = 8 << 4  # 32-byte header (timestamps)
    tcp[13] = flags
    ip = bytearray(20)
    ip[0] = 0x45
    struct.pack_into("!HH", ip, 2, 20 + 32 + len(payload), 777)
    ip[8], ip[9] = 64, 6
    ip[12:16] = bytes([10, 213, 0, 1])
    ip[16:20] = bytes([10, 213, 0, 2])
    packet = bytes(ip) + bytes(tcp) + payload
    header = gso.VNET_HDR.pack(gso.F_NEEDS_CSUM, gso.GSO_TCPV4, 52, mss, 20, 16)
    return header + packet, payload


def _checksum_ok(ip_header: bytes) -> bool:
    total = sum(struct.unpack("!10H", ip_header))
    while total >> 16:
        total = (total & 0xFFFF) + (total >> 16)
    return total == 0xFFFF


def test_sizes_of_asuper_packet():
    data, _ = super_packet(10, last=100)
    frame = gso.parse(data)
    assert frame.is_tcp_gso and frame.headers_len == 52
    assert frame.segments == 10
    assert frame.wire_bytes == 9 * 1448 + 100 + 10 * 52


def test_slices_carry_the_right_bytes_and_headers():
    data, payload = super_packet(10, last=100)
    frame = gso.parse(data)
    middle = gso.slice_segments(frame, 3, 4)
    packet = bytes(middle.packet)
    assert packet[52:] == payload[3 * 1448 : 7 * 1448]
    (total_len, ip_id) = struct.unpack_from("!HH", packet, 2)
    assert total_len == len(packet) and ip_id == 777 + 3
    assert _checksum_ok(packet[:20])
    (seq,) = struct.unpack_from("!I", packet, 24)
    assert seq == 1_000_000 + 3 * 1448
    assert packet[20 + 13] & 0x08 == 0  # PSH only on the last segment
    assert middle.is_tcp_gso and middle.segments == 4 and middle.flags == gso.F_NEEDS_CSUM
    last = gso.slice_segments(frame, 9, 1)
    assert bytes(last.packet)[52:] == payload[9 * 1448 :]
    assert bytes(last.packet)[20 + 13] & 0x08  # keeps PSH
    assert last.gso_type == gso.GSO_NONE and last.segments == 1


def test_pseudo_header_seed_matches_the_segment_length():
    data, _ = super_packet(3)
    piece = gso.slice_segments(gso.parse(data), 1, 1)
    packet = bytes(piece.packet)
    (seed,) = struct.unpack_from("!H", packet, 20 + 16)
    words = struct.unpack("!4H", packet[12:20])
    expected = sum(words) + 6 + (len(packet) - 20)
    while expected >> 16:
        expected = (expected & 0xFFFF) + (expected >> 16)
    assert seed == expected


def test_encode_round_trips():
    data, _ = super_packet(5)
    assert gso.parse(data).encode() == data


def test_measure_agrees_with_parse():
    for segments, last in ((1, None), (10, 100), (44, None)):
        data, _ = super_packet(segments, last=last)
        frame = gso.parse(data)
        assert gso.measure(data) == (frame.segments, frame.wire_bytes)
    ack = gso.VNET_HDR.pack(0, gso.GSO_NONE, 0, 0, 0, 0) + bytes([0x45]) + bytes(51)
    assert gso.measure(ack) == (1, 52)
