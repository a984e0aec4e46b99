"""Runtime control of a running emulator: a small JSON-lines service on loopback.

``isthmus wan up`` serves it; ``isthmus wan set|cut|heal|stats`` and
:class:`ControlClient` talk to it. One request per line, one answer per line::

    {"op": "set", "link": ["us-east", "eu-west"], "changes": {"rtt_ms": 120}}
    {"ok": true}
    {"op": "cut", "link": ["us-east", "eu-west"], "mode": "reset"}
    {"op": "stats"}
    {"ok": true, "stats": {...}}
    {"op": "progress", "rounds": {"us-east": 4, "eu-west": 3}}
    {"ok": true, "progress": {"us-east": 4, "eu-west": 3}}

``progress`` reports the rounds each site has completed (``isthmus run``'s
launcher sends it as the sites record rounds); faults that start or end at a
round (``at_round``, ``for_rounds``) wait on it.

It listens on loopback only and has no authentication: anyone who can open a
loopback connection on the machine can change the emulated links.
"""

from __future__ import annotations

import asyncio
import json
import socket
from typing import Any, Protocol

from isthmus.job.link import LinkConfigError
from isthmus.sim.fault_runner import ControllableLink, Progress

MAX_REQUEST_BYTES = 64 * 1024


class Controllable(Protocol):
    """An emulator of any backend, as the control service sees it."""

    def link(self, a: str, b: str) -> ControllableLink: ...

    def stats(self) -> dict[str, Any]: ...


class ControlServer:
    """Serves control requests for ``emulator`` on ``host`` (a free port by default)."""

    def __init__(
        self,
        emulator: Controllable,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        progress: Progress | None = None,
    ) -> None:
        """``progress``: where ``progress`` requests go (the emulator's fault
        schedule waits on it); without one they are refused."""
        self.emulator = emulator
        self.progress = progress
        self._host, self._port = host, port
        self._server: asyncio.Server | None = None
        self.address: tuple[str, int] | None = None

    async def start(self) -> tuple[str, int]:
        self._server = await asyncio.start_server(
            self._serve, self._host, self._port, limit=MAX_REQUEST_BYTES
        )
        host, port = self._server.sockets[0].getsockname()[:2]
        self.address = (host, port)
        return self.address

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while line := await reader.readline():
                writer.write(json.dumps(self.handle(line)).encode() + b"\n")
                await writer.drain()
        except (ConnectionError, asyncio.LimitOverrunError, ValueError):
            pass
        finally:
            writer.close()

    def handle(self, line: bytes) -> dict[str, Any]:
        """Answer one request; never raises (a bad request gets ``ok: false`` and why)."""
        try:
            request = json.loads(line)
        except ValueError:
            return {"ok": False, "error": "request is not JSON"}
        if not isinstance(request, dict):
            return {"ok": False, "error": "request must be a JSON object"}
        op = request.get("op")
        try:
            if op == "stats":
                return {"ok": True, "stats": self.emulator.stats()}
            if op == "progress":
                return self._progress(request)
            link = self._link(request)
            if op == "set":
                changes = request.get("changes")
                if not isinstance(changes, dict) or not changes:
                    return {"ok": False, "error": "set needs 'changes', e.g. {\"rtt_ms\": 100}"}
                link.update(source=request.get("source"), **changes)
            elif op == "cut":
                link.cut(request.get("mode", "blackhole"))
            elif op == "heal":
                link.heal()
            else:
                ops = "set, cut, heal, stats or progress"
                return {"ok": False, "error": f"unknown op {op!r}; use {ops}"}
            return {"ok": True, "link": link.stats()}
        except (KeyError, ValueError, LinkConfigError, TypeError) as exc:
            message = exc.args[0] if isinstance(exc, KeyError) and exc.args else str(exc)
            return {"ok": False, "error": message}

    def _progress(self, request: dict[str, Any]) -> dict[str, Any]:
        if self.progress is None:
            return {"ok": False, "error": "this emulator takes no progress reports"}
        rounds = request.get("rounds")
        if not (
            isinstance(rounds, dict)
            and all(
                isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool)
                for k, v in rounds.items()
            )
        ):
            return {
                "ok": False,
                "error": "'rounds' must map sites to rounds completed, e.g. {\"us-east\": 4}",
            }
        for site, done in rounds.items():
            self.progress.report(site, done)
        return {"ok": True, "progress": self.progress.as_dict()}

    def _link(self, request: dict[str, Any]) -> ControllableLink:
        pair = request.get("link")
        if not (
            isinstance(pair, list) and len(pair) == 2 and all(isinstance(p, str) for p in pair)
        ):
            raise ValueError('\'link\' must name two sites, e.g. ["us-east", "eu-west"]')
        return self.emulator.link(pair[0], pair[1])


class ControlError(RuntimeError):
    """The emulator refused a request or could not be reached; the message says why."""


class ControlClient:
    """Synchronous client of a :class:`ControlServer` (one short connection per request)."""

    def __init__(self, address: tuple[str, int], timeout_s: float = 10.0) -> None:
        self.address = address
        self.timeout_s = timeout_s

    def request(self, **request: Any) -> dict[str, Any]:
        host, port = self.address
        try:
            with socket.create_connection(self.address, timeout=self.timeout_s) as sock:
                sock.sendall(json.dumps(request).encode() + b"\n")
                data = b""
                while not data.endswith(b"\n"):
                    chunk = sock.recv(65536)
                    if not chunk:
                        break
                    data += chunk
        except OSError as exc:
            raise ControlError(
                f"cannot reach the emulator's control service at {host}:{port} "
                f"({exc.strerror or exc}); is 'isthmus wan up' still running?"
            ) from None
        try:
            answer = json.loads(data)
        except ValueError:
            raise ControlError(f"the emulator at {host}:{port} sent a malformed answer") from None
        if not answer.get("ok"):
            raise ControlError(answer.get("error", "request refused"))
        return answer

    def set(self, a: str, b: str, *, source: str | None = None, **changes: Any) -> dict[str, Any]:
        return self.request(op="set", link=[a, b], changes=changes, source=source)["link"]

    def cut(self, a: str, b: str, mode: str = "blackhole") -> dict[str, Any]:
        return self.request(op="cut", link=[a, b], mode=mode)["link"]

    def heal(self, a: str, b: str) -> dict[str, Any]:
        return self.request(op="heal", link=[a, b])["link"]

    def stats(self) -> dict[str, Any]:
        return self.request(op="stats")["stats"]

    def progress(self, rounds: dict[str, int]) -> dict[str, int]:
        """Report the rounds each site has completed; returns what the emulator holds."""
        return self.request(op="progress", rounds=rounds)["progress"]


def format_stats(stats: dict[str, Any]) -> str:
    """Per link and direction, the counters that matter for the backend that made them."""
    describe = _packet_counters if stats.get("backend") == "hosts" else _proxy_counters
    lines = []
    for link in stats["links"]:
        a, b = link["between"]
        lines.append(f"link {a}<->{b} ({link['state']}):")
        for direction in (f"{a}->{b}", f"{b}->{a}"):
            lines.append(f"  {direction}: {describe(link[direction])}")
    return "\n".join(lines)


def _proxy_counters(c: dict[str, Any]) -> str:
    return (
        f"{c['bytes'] / 1e6:.1f} MB, {c['segments']} segments, {c['stalls']} stalls, "
        f"{c['resets']} resets, {c['disconnects']} disconnects, "
        f"{c['active_connections']} open, queue {c['queued_bytes'] / 1e3:.0f} kB"
    )


def _packet_counters(c: dict[str, Any]) -> str:
    return (
        f"{c['bytes'] / 1e6:.1f} MB, {c['segments']} segments in {c['frames']} frames, "
        f"{c['lost_segments']} lost, {c['queue_drops']} queue drops, "
        f"{c['partition_drops']} partition drops, {c['corrupted_segments']} corrupted"
    )
