"""How the packet router's link direction treats frames: whole, queue-cut, lossy.

These run without root: they feed a :class:`PacketDirection` the bytes a TUN
read would give and check what it schedules. The router's end-to-end
behaviour with real hosts is in test_hosts.py.
"""

from __future__ import annotations

from test_gso import super_packet

from isthmus.job.link import DirectionParams
from isthmus.sim import gso
from isthmus.sim.router import PacketDirection


def _direction(**params) -> PacketDirection:
    return PacketDirection(src="a", dst="b", params=DirectionParams(**params), seed=7)


def test_a_whole_frame_crosses_unparsed_after_delay_and_serialisation():
    d = _direction(delay_ms=10, bandwidth_mbit=100)
    data, _ = super_packet(10)
    [(deliver, out)] = d.admit(data, now=100.0)
    assert out is data  # forwarded as read, not re-encoded
    wire = gso.parse(data).wire_bytes
    assert deliver == 100.0 + wire / (100e6 / 8) + 0.010
    c = d.counters
    assert (c.frames, c.segments, c.bytes, c.segments_delayed) == (1, 10, wire, 10)


def test_a_full_queue_keeps_the_head_of_the_frame_and_drops_the_tail():
    # 1 ms of queue at 100 Mbit/s holds 12500 bytes: 8 full segments of 1500,
    # and a ninth that starts while the queue still has room.
    d = _direction(bandwidth_mbit=100, queue_ms=1)
    first, _ = super_packet(44)
    [(_, out)] = d.admit(first, now=0.0)
    assert gso.parse(out).segments == 9
    assert d.counters.queue_drops == 35
    data, payload = super_packet(10)
    assert d.admit(data, now=0.0) == []
    assert d.counters.queue_drops == 45
    # Once the queue has drained to half, a frame is cut to what fits.
    drained = d.backlog_s(0.0) - 0.0005
    [(_, out)] = d.admit(data, now=drained)
    kept = gso.parse(out)
    assert 1 <= kept.segments < 10
    assert bytes(kept.packet)[52:] == payload[: kept.segments * 1448]
    assert d.counters.queue_drops == 45 + 10 - kept.segments


def test_loss_removes_exactly_the_lost_segments():
    d = _direction(loss=0.2)
    data, payload = super_packet(40)
    sent = received = 0
    for _ in range(50):
        pieces = d.admit(data, now=0.0)
        sent += 40
        for _, out in pieces:
            frame = gso.parse(out)
            received += frame.segments
            start = (int.from_bytes(bytes(frame.packet)[24:28], "big") - 1_000_000) // 1448
            assert (
                bytes(frame.packet)[52:] == payload[start * 1448 : (start + frame.segments) * 1448]
            )
    assert d.counters.lost_segments == sent - received
    assert 0.1 < d.counters.lost_segments / sent < 0.3


def test_a_partition_drops_everything_and_counts_segments():
    d = _direction()
    d.blackholed = True
    data, _ = super_packet(5)
    assert d.admit(data, now=0.0) == []
    assert d.counters.partition_drops == 5
