"""Measure a path the way a user would: round trips, one-way delays, bulk throughput.

:class:`ProbeServer` is a small TCP server (threads, blocking sockets: they
release the GIL, so one process can source and sink over a GB/s). The
``measure_*`` functions connect to it, directly or through an emulated link,
and return raw samples; ``isthmus wan demo`` and ``isthmus bench wan`` turn
them into the figures they print.

One-way delays compare ``time.monotonic_ns()`` taken in the sender and in the
receiver: CLOCK_MONOTONIC is one clock for every process of a Linux machine,
so this works across processes on one machine, never across machines.
"""

from __future__ import annotations

import socket
import struct
import threading
import time
from dataclasses import dataclass

_ECHO, _SINK, _STAMP = b"e", b"s", b"t"
_STAMP_FORMAT = struct.Struct("!q")  # sender's monotonic_ns
_STAMP_SIZE = 64  # a small message, padded: one segment


class ProbeServer:
    """Echo, sink and timestamp service on ``host`` (a free port unless ``port`` given)."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0) -> None:
        self._sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, port))
        self._sock.listen(64)
        self.address: tuple[str, int] = self._sock.getsockname()[:2]
        self._thread = threading.Thread(target=self._accept_loop, daemon=True, name="probe")
        self._closed = False

    def __enter__(self) -> ProbeServer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._closed = True
        self._sock.close()

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            threading.Thread(target=self._handle, args=(conn,), daemon=True).start()

    def _handle(self, conn: socket.socket) -> None:
        with conn:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            try:
                mode = _recv_exact(conn, 1)
                if mode == _ECHO:
                    while data := conn.recv(65536):
                        conn.sendall(data)
                elif mode == _SINK:
                    _sink(conn)
                elif mode == _STAMP:
                    _stamps(conn)
            except (OSError, ConnectionError):
                return


def _recv_exact(conn: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = conn.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("peer closed")
        buf += chunk
    return bytes(buf)


def _sink(conn: socket.socket) -> None:
    """Count bytes until EOF; answer the total, the first-to-last-byte seconds, and
    progress samples (seconds since the first byte, bytes so far) every ~50 ms."""
    buf = bytearray(4 << 20)
    view = memoryview(buf)
    total = 0
    first = last = next_sample = 0.0
    progress: list[float] = []
    while n := conn.recv_into(view):
        last = time.perf_counter()
        if total == 0:
            first = last
            next_sample = last
        total += n
        if last >= next_sample:
            progress += (last - first, float(total))
            next_sample = last + 0.05
    progress += (last - first, float(total))
    header = struct.pack("!qdi", total, last - first, len(progress))
    conn.sendall(header + struct.pack(f"!{len(progress)}d", *progress))


def _stamps(conn: socket.socket) -> None:
    """Record each message's one-way delay; answer them all at EOF."""
    delays: list[int] = []
    pending = b""
    while data := conn.recv(65536):
        now = time.monotonic_ns()
        pending += data
        while len(pending) >= _STAMP_SIZE:
            (sent,) = _STAMP_FORMAT.unpack_from(pending)
            delays.append(now - sent)
            pending = pending[_STAMP_SIZE:]
    conn.sendall(struct.pack(f"!i{len(delays)}q", len(delays), *delays))


def _connect(address: tuple[str, int], mode: bytes, timeout_s: float) -> socket.socket:
    sock = socket.create_connection(address, timeout=timeout_s)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.sendall(mode)
    return sock


def measure_rtt_ms(
    address: tuple[str, int], *, count: int = 30, interval_s: float = 0.0, timeout_s: float = 30
) -> list[float]:
    """Round trips of small messages through an echo, in milliseconds."""
    out = []
    with _connect(address, _ECHO, timeout_s) as sock:
        message = b"x" * _STAMP_SIZE
        # The first exchange includes the emulator's connection set-up: skip it.
        for i in range(count + 1):
            start = time.perf_counter()
            sock.sendall(message)
            _recv_exact(sock, len(message))
            if i:
                out.append((time.perf_counter() - start) * 1e3)
            if interval_s:
                time.sleep(interval_s)
    return out


def measure_one_way_ms(
    address: tuple[str, int], *, count: int = 200, interval_s: float = 0.02, timeout_s: float = 60
) -> list[float]:
    """One-way delays of small messages spaced ``interval_s`` apart, in milliseconds."""
    with _connect(address, _STAMP, timeout_s) as sock:
        for _ in range(count):
            stamp = _STAMP_FORMAT.pack(time.monotonic_ns())
            sock.sendall(stamp + b"\0" * (_STAMP_SIZE - len(stamp)))
            time.sleep(interval_s)
        sock.shutdown(socket.SHUT_WR)
        (n,) = struct.unpack("!i", _recv_exact(sock, 4))
        delays = struct.unpack(f"!{n}q", _recv_exact(sock, 8 * n))
    return [d / 1e6 for d in delays]


@dataclass(frozen=True)
class Throughput:
    bytes: int
    seconds: float
    """From the first to the last byte at the receiver."""
    progress: tuple[tuple[float, float], ...] = ()
    """(seconds since the first byte, bytes received so far), every ~50 ms."""

    @property
    def mbit_per_s(self) -> float:
        return self.bytes * 8 / self.seconds / 1e6 if self.seconds > 0 else 0.0

    @property
    def mbyte_per_s(self) -> float:
        return self.bytes / self.seconds / 1e6 if self.seconds > 0 else 0.0

    def mbit_per_s_after(self, skip_s: float) -> float:
        """Throughput after the first ``skip_s`` seconds (TCP's ramp-up excluded)."""
        after = [(t, b) for t, b in self.progress if t >= skip_s]
        if len(after) < 2 or after[-1][0] <= after[0][0]:
            return self.mbit_per_s
        (t0, b0), (t1, b1) = after[0], after[-1]
        return (b1 - b0) * 8 / (t1 - t0) / 1e6


def measure_throughput(
    address: tuple[str, int],
    *,
    seconds: float = 3.0,
    congestion: str | None = None,
    timeout_s: float = 120,
) -> Throughput:
    """Send as fast as possible for ``seconds``; the receiver times what arrived.
    ``congestion`` picks the sender's TCP congestion control (e.g. cubic, bbr)."""
    block = b"\0" * (1 << 20)
    with socket.create_connection(address, timeout=timeout_s) as sock:
        if congestion:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, congestion.encode())
        sock.sendall(_SINK)
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            sock.sendall(block)
        sock.shutdown(socket.SHUT_WR)
        total, elapsed, n = struct.unpack("!qdi", _recv_exact(sock, 20))
        flat = struct.unpack(f"!{n}d", _recv_exact(sock, 8 * n))
    progress = tuple(zip(flat[0::2], flat[1::2], strict=True))
    return Throughput(total, elapsed, progress)


def main(argv: list[str] | None = None) -> int:
    """``python -m isthmus.sim.probe``: the same probes as a command, for use inside
    emulated hosts (``isthmus wan exec``). Results are printed as JSON."""
    import argparse
    import json

    parser = argparse.ArgumentParser(prog="python -m isthmus.sim.probe")
    verbs = parser.add_subparsers(dest="verb", required=True)
    serve = verbs.add_parser("serve", help="run the probe server until killed")
    serve.add_argument("--host", default="0.0.0.0")
    serve.add_argument("--port", type=int, default=9000)
    rtt = verbs.add_parser("rtt", help="round trips through the server's echo")
    rtt.add_argument("address", metavar="HOST:PORT")
    rtt.add_argument("--count", type=int, default=20)
    bulk = verbs.add_parser("throughput", help="bulk transfer into the server's sink")
    bulk.add_argument("address", metavar="HOST:PORT")
    bulk.add_argument("--seconds", type=float, default=5.0)
    bulk.add_argument("--congestion", help="TCP congestion control of the sender")
    bulk.add_argument("--skip-s", type=float, default=0.0, help="ramp-up to leave out")
    args = parser.parse_args(argv)
    if args.verb == "serve":
        with ProbeServer(args.host, args.port) as server:
            print(json.dumps({"listening": "{}:{}".format(*server.address)}), flush=True)
            threading.Event().wait()
        return 0
    host, _, port = args.address.rpartition(":")
    address = (host, int(port))
    if args.verb == "rtt":
        print(json.dumps({"rtt_ms": measure_rtt_ms(address, count=args.count)}))
    else:
        result = measure_throughput(address, seconds=args.seconds, congestion=args.congestion)
        print(
            json.dumps(
                {
                    "bytes": result.bytes,
                    "seconds": result.seconds,
                    "mbit_per_s": result.mbit_per_s,
                    "mbit_per_s_after_ramp": result.mbit_per_s_after(args.skip_s),
                }
            )
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
