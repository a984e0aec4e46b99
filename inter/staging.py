"""Staging: how encoded bytes move between a tensor's device and host memory.

The WAN only ever sees host bytes (gRPC messages, zstd), while the values may
live on a GPU. The codec does the arithmetic where the values are and hands
this module the encoded bytes only: a chunk of int8 values is a quarter of its
float32 values, so quantising on the device first divides the PCIe traffic by
the codec's ratio, as it divides the WAN's.

* :class:`HostStaging` (CPU tensors): the bytes are already in host memory;
  nothing is copied. This is the CPU path, exactly as fast as before.
* :class:`CopyStaging` (any other device): host buffers reused per chunk size
  (pinned on CUDA, so copies are DMA and asynchronous), the copies on a side
  CUDA stream with events, so they do not queue behind the compute stream's
  kernels (training may go on there while an exchange runs). The encoder
  thread waits for its own chunk's copy; the event loop keeps sending the
  chunks before it meanwhile. On a CPU device it takes the same path without
  streams, so the CPU suite exercises every copy a GPU site makes.

Device work (quantising, decoding, reducing) runs on the calling thread's
current stream; a CUDA tensor handed to the engine must be ready there
(made on it, or waited for by the caller).
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Sequence
from typing import Protocol

import torch

Buffer = bytes | bytearray | memoryview

_ALIGN = 64
"""Each part uploaded together starts at this many bytes: any dtype view fits."""
_GRANULE = 4096
"""Host buffers come in multiples of this: chunks of a vector share a size, so
the same few buffers serve every round."""


class Staging(Protocol):
    """Where encoded bytes are made (``device``) and how they reach the host and back."""

    device: torch.device

    def empty(self, nbytes: int) -> torch.Tensor:
        """A uint8 tensor on ``device`` for a codec to write encoded bytes into."""
        ...

    def to_host(self, raw: torch.Tensor) -> Buffer:
        """The bytes of ``raw`` (from :meth:`empty`) in host memory, owned by the caller."""
        ...

    def to_device(self, parts: Sequence[Buffer]) -> list[torch.Tensor]:
        """Each host buffer in ``parts`` as a uint8 tensor on ``device`` (read only)."""
        ...

    def settle(self) -> None:
        """Wait until device work queued so far on the current stream is done (a
        round's result is then safe to read from any stream or thread)."""
        ...


class HostStaging:
    """CPU tensors: encoded bytes are written straight into the payload, received
    bytes are read where they lie. No copies."""

    device = torch.device("cpu")

    def empty(self, nbytes: int) -> torch.Tensor:
        # Not a bytearray: that would be zeroed first, a pass over memory for nothing.
        return torch.empty(nbytes, dtype=torch.uint8)

    def to_host(self, raw: torch.Tensor) -> Buffer:
        # The payload is the tensor's memory itself (the view keeps it alive).
        return memoryview(raw.numpy()) if raw.numel() else b""

    def to_device(self, parts: Sequence[Buffer]) -> list[torch.Tensor]:
        return [read_only(part) for part in parts]

    def settle(self) -> None:
        return None


class CopyStaging:
    """A device's staging: reused host buffers, and on CUDA a side stream for the copies."""

    def __init__(self, device: torch.device | str) -> None:
        self.device = _indexed(torch.device(device))
        self._cuda = self.device.type == "cuda"
        self._stream = torch.cuda.Stream(self.device) if self._cuda else None
        self._lock = threading.Lock()
        self._free: dict[int, list[torch.Tensor]] = {}
        self._in_flight: list[tuple[torch.cuda.Event, torch.Tensor]] = []
        """Host buffers an upload still reads from, with the event that says it is done."""
        self.bytes_to_host = 0
        self.bytes_to_device = 0
        self.buffers_made = 0
        """Host buffers allocated over this staging's life (reuse keeps it small)."""

    def empty(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def to_host(self, raw: torch.Tensor) -> Buffer:
        n = raw.numel()
        if n == 0:
            return b""
        buffer = self._take(n)
        host = buffer[:n]
        if self._stream is None:
            host.copy_(raw)
        else:
            # The copy waits for the kernels that wrote raw, on the side stream, so
            # it does not queue behind later work on the compute stream.
            written = torch.cuda.Event()
            written.record(torch.cuda.current_stream(self.device))
            self._stream.wait_event(written)
            with torch.cuda.stream(self._stream):
                host.copy_(raw, non_blocking=True)
            raw.record_stream(self._stream)  # raw's memory is not reused before the copy
            copied = torch.cuda.Event()
            copied.record(self._stream)
            copied.synchronize()  # this (encoder) thread waits; the event loop sends on
        payload = bytearray(host.numpy())  # the buffer goes back for the next chunk
        self._give(buffer)
        self.bytes_to_host += n
        return payload

    def to_device(self, parts: Sequence[Buffer]) -> list[torch.Tensor]:
        """One copy for all ``parts`` (a chunk's scales and values), each aligned."""
        offsets, total = [], 0
        for part in parts:
            offsets.append(total)
            total += -(-len(part) // _ALIGN) * _ALIGN
        if total == 0:
            return [torch.empty(0, dtype=torch.uint8, device=self.device) for _ in parts]
        buffer = self._take(total)
        host = memoryview(buffer.numpy())
        for at, part in zip(offsets, parts, strict=True):
            host[at : at + len(part)] = part
        if self._stream is None:
            device = buffer[:total].to(self.device, copy=True)
            self._give(buffer)
        else:
            with torch.cuda.stream(self._stream):
                device = torch.empty(total, dtype=torch.uint8, device=self.device)
                device.copy_(buffer[:total], non_blocking=True)
            copied = torch.cuda.Event()
            copied.record(self._stream)
            current = torch.cuda.current_stream(self.device)
            current.wait_event(copied)  # decoding (on the current stream) waits for it
            device.record_stream(current)
            with self._lock:
                self._in_flight.append((copied, buffer))
        self.bytes_to_device += total
        return [device[at : at + len(part)] for at, part in zip(offsets, parts, strict=True)]

    def settle(self) -> None:
        if self._cuda:
            torch.cuda.current_stream(self.device).synchronize()

    def _take(self, nbytes: int) -> torch.Tensor:
        size = -(-nbytes // _GRANULE) * _GRANULE
        with self._lock:
            self._reclaim()
            free = self._free.get(size)
            if free:
                return free.pop()
            self.buffers_made += 1
        return torch.empty(size, dtype=torch.uint8, pin_memory=self._cuda)

    def _give(self, buffer: torch.Tensor) -> None:
        with self._lock:
            self._free.setdefault(buffer.numel(), []).append(buffer)

    def _reclaim(self) -> None:
        """Buffers whose upload has finished are free again (under the lock)."""
        busy = []
        for event, buffer in self._in_flight:
            if event.query():
                self._free.setdefault(buffer.numel(), []).append(buffer)
            else:
                busy.append((event, buffer))
        self._in_flight = busy


HOST = HostStaging()
_shared: dict[torch.device, Staging] = {}
_shared_lock = threading.Lock()


def staging_for(device: torch.device | str) -> Staging:
    """The staging for tensors on ``device``: :data:`HOST` for the CPU, one shared
    :class:`CopyStaging` per other device (its buffers serve every engine there)."""
    device = torch.device(device)
    if device.type == "cpu":
        return HOST
    device = _indexed(device)
    with _shared_lock:
        staging = _shared.get(device)
        if staging is None:
            staging = _shared[device] = CopyStaging(device)
        return staging


def _indexed(device: torch.device) -> torch.device:
    """``cuda`` as ``cuda:N`` (a tensor's device always names its index)."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def read_only(buffer: Buffer) -> torch.Tensor:
    """A uint8 tensor over received bytes without copying them. torch warns that
    the buffer is read-only; decoding only ever reads it."""
    if len(buffer) == 0:
        return torch.empty(0, dtype=torch.uint8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(buffer, dtype=torch.uint8)
