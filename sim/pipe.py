"""One direction of an emulated link in the TCP-proxy backend: the pipe its bytes go through.

    read from sender -> pending -> (rate limiters, loss) -> delay line -> write to receiver

A :class:`Pipe` applies its direction's link model (:class:`DirectionRuntime`)
to one connection's bytes: the shared rate limiters give every batch its
departure, a sampled one-way delay its arrival (never before the batch ahead),
a lost segment stalls the stream for a retransmission timeout, and credit
(a window, returned one reverse delay after delivery, like an ACK) and the
link's queue bound what is in flight, so TCP flow control slows the sender.
:mod:`isthmus.sim.proxy` owns the connections and listeners around the pipes.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from isthmus.job.link import DirectionParams
from isthmus.sim import precise_timers
from isthmus.sim.congestion import CubicWindow
from isthmus.sim.direction import DirectionModel

if TYPE_CHECKING:
    from isthmus.sim.proxy import ProxiedConnection

log = logging.getLogger(__name__)

# A pipe stops reading once this much is waiting to enter the link (on top of
# one read of at most 256 KiB, asyncio's read size).
PENDING_LIMIT_BYTES = 256 * 1024
# On a capped link, large reads are cut into batches of about this many
# seconds of the rate, so the receiver sees a smooth stream, not bursts.
BATCH_SECONDS = 0.002
MIN_BATCH_BYTES = 16 * 1024
# Linux's shortest delayed-ACK timeout (TCP_DELACK_MIN).
DELAYED_ACK_S = 0.040


@dataclass
class DirectionCounters:
    """Counters of one direction of one link, over all its connections."""

    bytes: int = 0
    """Bytes put on the link (retransmissions after a partition count again)."""
    segments: int = 0
    segments_delayed: int = 0
    """Segments that crossed with a non-zero one-way delay."""
    lost_segments: int = 0
    stalls: int = 0
    """Retransmission stalls caused by lost segments."""
    corrupted_bytes: int = 0
    connections: int = 0
    resets: int = 0
    """Connections torn down by a reset partition, or refused during one."""
    disconnects: int = 0
    """Connections whose sender went away; the other side was closed cleanly."""
    upstream_failures: int = 0
    """Connections whose destination could not be reached."""


class DirectionRuntime(DirectionModel):
    """One direction of a link in the proxy: the model plus its connections and counters."""

    def __init__(self, **kwargs: Any) -> None:
        self.counters = DirectionCounters()
        self.pipes: set[Pipe] = set()
        super().__init__(**kwargs)

    def apply(self, params: DirectionParams) -> None:
        super().apply(params)
        self._corrupt_gap = self._next_corrupt_gap()
        rate = params.rate_bytes_per_s
        self.batch_bytes = (
            max(MIN_BATCH_BYTES, int(rate * BATCH_SECONDS)) if rate is not None else None
        )

    def update(self, params: DirectionParams) -> None:
        """Switch to new settings while traffic flows; bytes already scheduled keep their times."""
        self.apply(params)
        for pipe in list(self.pipes):
            pipe.pump()

    def corrupt(self, data: bytes) -> bytes:
        """Flip one bit in a ``params.corrupt`` fraction of bytes (seeded, reproducible)."""
        if self.params.corrupt == 0:
            return data
        if self._corrupt_gap >= len(data):
            self._corrupt_gap -= len(data)
            return data
        buf = bytearray(data)
        pos = self._corrupt_gap
        while pos < len(buf):
            buf[pos] ^= 1 << self.rng.randrange(8)
            self.counters.corrupted_bytes += 1
            pos += self._next_corrupt_gap() + 1
        self._corrupt_gap = pos - len(buf)
        return bytes(buf)

    def _next_corrupt_gap(self) -> int:
        rate = self.params.corrupt
        if rate <= 0 or rate >= 1:
            return 0
        u = 1.0 - self.rng.random()
        return int(math.log(u) / math.log1p(-rate))

    def queued_bytes(self) -> int:
        return sum(p.queued_bytes for p in self.pipes)

    def stats(self) -> dict[str, Any]:
        return {
            **dataclasses.asdict(self.counters),
            "active_connections": len({p.connection for p in self.pipes}),
            "queued_bytes": self.queued_bytes(),
            "blackholed": self.blackholed,
        }


class Pipe:
    """One direction of one proxied connection, shaped by a :class:`DirectionRuntime`."""

    def __init__(
        self,
        connection: ProxiedConnection,
        direction: DirectionRuntime,
        reverse: DirectionRuntime,
    ) -> None:
        self.connection = connection
        self.direction = direction
        self.reverse = reverse
        self.loop = connection.loop
        self.src: asyncio.Transport | None = None
        self.dst: asyncio.Transport | None = None
        self._pending: deque[bytes] = deque()
        self._pending_bytes = 0
        self._line: deque[tuple[float, bytes]] = deque()
        self._line_bytes = 0
        self._unacked = 0
        self._stall_until = 0.0
        self._last_deliver = 0.0
        self._stream_offset = 0
        # The receiver's side: bytes it got, and up to where it has ACKed them.
        self._received = 0
        self._acked_point = 0
        self._delayed_ack: asyncio.TimerHandle | None = None
        # TCP's congestion window, applied on lossy links (see _lose).
        self._congestion = CubicWindow(rtt_s=self._rtt_s())
        self._pump_timer: asyncio.TimerHandle | None = None
        self._deliver_timer: precise_timers.TimerHandle | None = None
        self._dst_paused = False
        self._reading_paused = False
        self._eof = False
        self._done = False
        direction.pipes.add(self)

    @property
    def done(self) -> bool:
        return self._done

    @property
    def queued_bytes(self) -> int:
        """Bytes read from the sender and not yet delivered to the receiver."""
        return self._pending_bytes + self._line_bytes

    # -- input ---------------------------------------------------------------
    def feed(self, data: bytes) -> None:
        if self._done:
            return
        self._pending.append(data)
        self._pending_bytes += len(data)
        self.pump()

    def feed_eof(self) -> None:
        self._eof = True
        self._maybe_finish()

    # -- onto the link --------------------------------------------------------
    def pump(self) -> None:
        """Move pending bytes onto the link as far as rate, queue, stalls and cuts allow."""
        if self._pump_timer is not None:
            self._pump_timer.cancel()
            self._pump_timer = None
        d = self.direction
        now = self.loop.time()
        queue_s = d.params.queue_ms / 1e3
        while self._pending and not self._done:
            if d.blackholed:
                break
            if now < self._stall_until:
                self._arm_pump(self._stall_until)
                break
            backlog = d.backlog_s(now)
            if backlog > queue_s:
                self._arm_pump(now + backlog - queue_s)
                break
            in_flight = self._line_bytes + self._unacked
            room = self._window() - in_flight
            if room < d.params.mss_bytes and (in_flight or room <= 0):
                # The window is full: _ack pumps again when it opens. TCP sends
                # whole segments within its window, never one past it.
                break
            limit = room if d.batch_bytes is None else min(d.batch_bytes, room)
            piece = self._take_pending(max(int(limit), d.params.mss_bytes))
            self._transmit(piece, now)
            if d.batch_bytes is not None and self._pending:
                # A capped link is shared: yield after each batch so every
                # connection waiting for it gets its turn (round robin),
                # instead of the first one awake filling the whole queue.
                self._arm_pump(now + max(0.0, d.backlog_s(now) - queue_s))
                break
        self._update_reading()

    def _take_pending(self, limit: int | None) -> bytes:
        head = self._pending.popleft()
        if limit is not None and len(head) > limit:
            self._pending.appendleft(head[limit:])
            head = head[:limit]
        self._pending_bytes -= len(head)
        return head

    def _transmit(self, piece: bytes, now: float) -> None:
        d = self.direction
        c = d.counters
        depart = d.reserve(len(piece), now)
        deliver = depart + d.jitter.sample_s()
        # Segments are counted by position in the stream, not per batch, so
        # the loss pattern of a connection does not depend on read sizes.
        mss = d.params.mss_bytes
        end = self._stream_offset + len(piece)
        segments = -(-end // mss) - -(-self._stream_offset // mss)
        self._stream_offset = end
        lost = d.loss.lost_in(segments)
        if lost:
            c.lost_segments += lost
            c.stalls += 1
            deliver = max(deliver, self._lose(depart))
        deliver = max(deliver, self._last_deliver)
        self._last_deliver = deliver
        c.bytes += len(piece)
        c.segments += segments
        if d.params.delay_ms > 0 or d.params.jitter_ms > 0:
            c.segments_delayed += segments
        piece = d.corrupt(piece)
        self._line.append((deliver, piece))
        self._line_bytes += len(piece)
        if self._deliver_timer is None:
            self._arm_deliver()

    def _lose(self, depart: float) -> float:
        """React to a lost segment as TCP does; return when the retransmission arrives.

        With enough segments in flight for three duplicate ACKs, fast retransmit
        repairs it one round trip later, and the congestion window is cut as
        CUBIC cuts it (:mod:`isthmus.sim.congestion`). With fewer, the sender
        waits for a retransmission timeout and starts again from one segment.
        The stream is held until the repair arrives: TCP delivers in order.
        """
        d = self.direction
        congestion = self._congestion
        congestion.rtt_s = self._rtt_s()
        if congestion.cwnd < 4:
            # A timeout: Linux restarts from a one-segment window in slow start
            # (tcp_enter_loss), which at high loss rates keeps windows small.
            self._stall_until = depart + d.rto_s
            congestion.on_timeout(depart)
            return self._stall_until + d.params.delay_ms / 1e3
        congestion.on_loss(depart)
        return depart + congestion.rtt_s + d.params.delay_ms / 1e3

    def _rtt_s(self) -> float:
        return (self.direction.params.delay_ms + self.reverse.params.delay_ms) / 1e3

    def _arm_pump(self, when: float) -> None:
        self._pump_timer = self.loop.call_at(when, self.pump)

    # -- off the link ---------------------------------------------------------
    def _arm_deliver(self) -> None:
        if self._line and not self._dst_paused and self.dst is not None:
            self._deliver_timer = self.connection.link.timers.call_at(
                self._line[0][0], self._deliver
            )

    def _deliver(self) -> None:
        self._deliver_timer = None
        if self._done or self.dst is None:
            return
        horizon = self.loop.time() + precise_timers.SLACK_S
        out: list[bytes] = []
        while self._line and self._line[0][0] <= horizon:
            out.append(self._line.popleft()[1])
        if out:
            data = out[0] if len(out) == 1 else b"".join(out)
            self._line_bytes -= len(data)
            self._unacked += len(data)
            self.dst.write(data)
            self._received += len(data)
            self._receiver_acks()
        self._arm_deliver()
        self._maybe_finish()

    def _receiver_acks(self, *, all_received: bool = False) -> None:
        """Send the receiver's ACKs for what it got; the window credit returns when
        an ACK has crossed back.

        On a lossy link, where the congestion window matters, the receiver delays
        its ACKs as Linux does (RFC 1122): one per two full segments at once, the
        rest when its delayed-ACK timer fires, at least 40 ms later. A flight with
        an odd segment at its end thus waits for the timer, which is what makes
        Linux's smoothed RTT a few ms longer than the path's.
        """
        params = self.direction.params
        point = self._received
        if params.loss and not all_received:
            point -= self._received % (2 * params.mss_bytes)
        if point > self._acked_point:
            nbytes, self._acked_point = point - self._acked_point, point
            if self._delayed_ack is not None:
                self._delayed_ack.cancel()
                self._delayed_ack = None
            ack_delay = self.reverse.params.delay_ms / 1e3
            if ack_delay > 0:
                self.loop.call_later(ack_delay, self._ack, nbytes)
            else:
                self._ack(nbytes)
        if self._received > self._acked_point and self._delayed_ack is None:
            self._delayed_ack = self.loop.call_later(DELAYED_ACK_S, self._delayed_ack_fires)

    def _delayed_ack_fires(self) -> None:
        self._delayed_ack = None
        if not self._done:
            self._receiver_acks(all_received=True)

    def _ack(self, nbytes: int) -> None:
        self._unacked -= nbytes
        params = self.direction.params
        if params.loss:
            self._congestion.limit = params.window_bytes / params.mss_bytes
            self._congestion.on_ack(nbytes / params.mss_bytes, self.loop.time())
        if self._pending and self._pump_timer is None:
            self.pump()
        else:
            self._update_reading()

    def _window(self) -> float:
        """Bytes this connection may have on the link: the receive window, and on
        a lossy link also the congestion window (a lossless link never makes TCP
        back off)."""
        params = self.direction.params
        if params.loss == 0:
            return params.window_bytes
        # Linux counts its congestion window in whole segments.
        congestion = math.floor(self._congestion.segments(self.loop.time())) * params.mss_bytes
        return min(params.window_bytes, congestion)

    def attach_destination(self, transport: asyncio.Transport) -> None:
        self.dst = transport
        if self._deliver_timer is None:
            self._arm_deliver()
        self._maybe_finish()

    def pause_writing(self) -> None:
        """The receiver's socket buffer is full: hold deliveries (the window fills up)."""
        self._dst_paused = True
        if self._deliver_timer is not None:
            self._deliver_timer.cancel()
            self._deliver_timer = None

    def resume_writing(self) -> None:
        self._dst_paused = False
        if self._deliver_timer is None:
            self._arm_deliver()

    def _update_reading(self) -> None:
        if self.src is None or self._done:
            return
        in_window = self._pending_bytes + self._line_bytes + self._unacked
        full = (
            in_window >= self.direction.params.window_bytes
            or self._pending_bytes >= PENDING_LIMIT_BYTES
        )
        if full and not self._reading_paused:
            self._reading_paused = True
            self.src.pause_reading()
        elif not full and self._reading_paused:
            self._reading_paused = False
            with contextlib.suppress(RuntimeError):  # transport closing
                self.src.resume_reading()

    # -- partitions -------------------------------------------------------------
    def blackhole(self) -> None:
        """Bytes on the wire are lost in a cut; TCP will send them again after it heals."""
        if self._deliver_timer is not None:
            self._deliver_timer.cancel()
            self._deliver_timer = None
        for _, piece in reversed(self._line):
            self._pending.appendleft(piece)
            self._pending_bytes += len(piece)
        self._line.clear()
        self._line_bytes = 0
        self._last_deliver = 0.0

    # -- end of stream ------------------------------------------------------------
    def _maybe_finish(self) -> None:
        # The EOF is passed on only once a destination exists to receive it.
        ready = self.dst is not None and not self._pending and not self._line
        if self._eof and not self._done and ready:
            self._done = True
            self.connection.pipe_finished(self)

    def close(self) -> None:
        """Stop for good: timers cancelled, undelivered bytes dropped."""
        self._done = True
        for timer in (self._pump_timer, self._deliver_timer, self._delayed_ack):
            if timer is not None:
                timer.cancel()
        self._pending.clear()
        self._line.clear()
        self._pending_bytes = self._line_bytes = 0
        self.direction.pipes.discard(self)
