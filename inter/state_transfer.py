"""Pulling the global state from a live peer: how a site catches up.

A site that rejoins, joins, or fell a round behind asks a member (the view's
donor) for the global state after a given number of rounds: the global
parameters, the outer optimizer and the counters, serialised once by the
donor into one blob (``torch.save``; read back with ``weights_only``, so a
peer can send tensors and numbers, never code). The blob streams in parts of
at most the transport's chunk size; each part carries a CRC-32 over its bytes
and fields, and every part names the blob's SHA-256, checked at the end. A
part that fails its check, or a stream that breaks, is not fatal: the caller
asks again from the last good byte (``offset``), until its deadline. The
donor keeps the blob of the round it serves, so a resumed transfer reads the
same bytes.
"""

from __future__ import annotations

import asyncio
import hashlib
import io
import logging
import struct
import zlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import grpc
import torch

from isthmus.inter.peer import PROTOCOL_VERSION
from isthmus.inter.peer_client import PeerClient
from isthmus.proto import wire_pb2

log = logging.getLogger(__name__)

_FIELDS = struct.Struct("<QQQ")
READY_POLL_S = 0.1
RETRY_PAUSE_S = 0.2


class StateUnavailable(Exception):
    """The donor cannot serve the state asked for (``code``: a wire ErrorCode)."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


class StateGone(RuntimeError):
    """The donor is past the round asked for: the membership decision must be retaken."""


StateProvider = Callable[[int], tuple[str, bytes]]
"""rounds -> (SHA-256 hex, blob) of the global state after that many rounds; raises
:class:`StateUnavailable` (STATE_NOT_READY while the donor is not there yet)."""


def pack_state(state: dict[str, Any]) -> tuple[str, bytes]:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    blob = buffer.getvalue()
    return hashlib.sha256(blob).hexdigest(), blob


def unpack_state(blob: bytes) -> dict[str, Any]:
    """The state in ``blob``; tensors, numbers, strings and containers only. Tensors
    land in host memory whatever device the donor held them on (a GPU donor can
    serve a CPU site, or one with fewer GPUs); the strategies copy them onto theirs."""
    state = torch.load(io.BytesIO(blob), weights_only=True, map_location="cpu")
    if not isinstance(state, dict):
        raise ValueError(f"the donor's state is a {type(state).__name__}, not a dict")
    return state


def part_checksum(part: wire_pb2.StatePart, payload: bytes) -> int:
    crc = zlib.crc32(payload)
    crc = zlib.crc32(_FIELDS.pack(part.rounds, part.total, part.offset), crc)
    return zlib.crc32(part.digest.encode(), crc) & 0xFFFFFFFF


async def serve_state(
    provider: StateProvider | None,
    request: wire_pb2.StateRequest,
    *,
    part_bytes: int,
    time_left: Callable[[], float | None],
) -> AsyncIterator[wire_pb2.StatePart]:
    """The parts answering ``request``: waits while the donor is not at the round yet
    (as long as the call's deadline allows), then streams from ``request.offset``."""
    if provider is None:
        yield _refusal(wire_pb2.STATE_GONE, "this site serves no state (no strategy with one)")
        return
    loop = asyncio.get_running_loop()
    while True:
        try:
            # Serialising a large model takes a while: not on the event loop, which
            # carries every other stream of this rank.
            digest, blob = await loop.run_in_executor(None, provider, request.rounds)
            break
        except StateUnavailable as exc:
            left = time_left()
            if exc.code != wire_pb2.STATE_NOT_READY or (left is not None and left < 1.0):
                yield _refusal(exc.code, str(exc))
                return
            await asyncio.sleep(READY_POLL_S)
    if request.offset > len(blob):
        yield _refusal(
            wire_pb2.WRONG_SHAPE, f"offset {request.offset} is past the state's {len(blob)} bytes"
        )
        return
    offset = request.offset
    while True:
        payload = blob[offset : offset + part_bytes]
        part = wire_pb2.StatePart(
            rounds=request.rounds, total=len(blob), digest=digest, offset=offset, payload=payload
        )
        part.checksum = part_checksum(part, payload)
        yield part
        offset += len(payload)
        if offset >= len(blob):
            return


def _refusal(code: int, message: str) -> wire_pb2.StatePart:
    return wire_pb2.StatePart(error=wire_pb2.Error(code=code, message=message))


@dataclass
class Fetched:
    state: dict[str, Any]
    bytes: int
    seconds: float
    resumed: int
    """Times the transfer went on from where a broken or bad part left it."""


async def fetch_state(
    client: PeerClient, rounds: int, *, deadline_s: float, max_bytes: int
) -> Fetched:
    """The donor's global state after ``rounds`` rounds, verified, resuming after a
    broken stream or a bad part until ``deadline_s``. ``max_bytes``: the most this
    site's state can take (a donor that announces more is refused, not believed).
    Raises :class:`StateGone` if the donor is past that round, TimeoutError naming
    the donor at the deadline."""
    me = client.identity
    loop = asyncio.get_running_loop()
    started = loop.time()
    deadline = started + deadline_s
    received = bytearray()
    digest: str | None = None
    total: int | None = None
    resumed = 0
    pause = RETRY_PAUSE_S
    last_problem = "no answer"
    while True:
        remaining = deadline - loop.time()
        if remaining <= 0:
            raise TimeoutError(
                f"state transfer from {client.address} ({client.peer_site}) did not finish "
                f"within {deadline_s:g} s ({len(received)} of {total or '?'} bytes; last "
                f"problem: {last_problem})"
            )
        request = wire_pb2.StateRequest(
            job=me.job,
            site=me.site,
            rank=me.rank,
            protocol_version=PROTOCOL_VERSION,
            layout_fingerprint=me.layout_fingerprint,
            rounds=rounds,
            offset=len(received),
        )
        try:
            call = client.stub.FetchState(request, timeout=remaining, wait_for_ready=True)
            async for part in call:
                if part is None:
                    last_problem = "a part that does not parse"
                    call.cancel()
                    break
                if part.HasField("error"):
                    if part.error.code == wire_pb2.STATE_GONE:
                        raise StateGone(f"{client.peer_site}: {part.error.message}")
                    last_problem = part.error.message
                    if part.error.code != wire_pb2.STATE_NOT_READY:
                        raise RuntimeError(
                            f"state transfer from {client.peer_site} refused: {part.error.message}"
                        )
                    break
                payload = part.payload
                if part_checksum(part, payload) != part.checksum:
                    last_problem = f"part at byte {part.offset} failed its checksum"
                    call.cancel()
                    break
                if digest is not None and part.digest != digest:
                    # The donor's blob changed (it restarted): start over.
                    received.clear()
                    digest = None
                    last_problem = "the donor's state changed mid-transfer"
                    call.cancel()
                    break
                if part.total > max_bytes:
                    call.cancel()
                    raise RuntimeError(
                        f"state transfer from {client.peer_site}: it announces {part.total} "
                        f"bytes, more than this site's state can take ({max_bytes}); the "
                        "sites do not run the same model"
                    )
                if part.offset != len(received) or part.rounds != rounds:
                    last_problem = f"part at byte {part.offset}, expected {len(received)}"
                    call.cancel()
                    break
                digest, total = part.digest, part.total
                received += payload
                if len(received) >= total:
                    call.cancel()
                    break
        except grpc.aio.AioRpcError as exc:
            last_problem = f"{exc.code().name}: {exc.details()}"
        if total is not None and len(received) >= total:
            blob = bytes(received)
            if hashlib.sha256(blob).hexdigest() == digest:
                state = unpack_state(blob)
                return Fetched(state, len(blob), loop.time() - started, resumed)
            last_problem = "the whole state failed its SHA-256"
            received.clear()
            digest = total = None
        resumed += 1
        log.info("state transfer from %s: %s; going on", client.peer_site, last_problem)
        await asyncio.sleep(min(pause, max(0.0, deadline - loop.time())))
        pause = min(pause * 2, 2.0)
