"""Staging: how encoded bytes move between a tensor's device and host memory.

The WAN only ever sees host bytes (gRPC messages, zstd), while the values may
live on a GPU. The codec does the arithmetic where the values are and hands
this module the encoded bytes only: a chunk of int8 values is a quarter of its
float32 values, so quantising on the device first divides the PCIe traffic by
the codec's ratio, as it divides the WAN's.

* :class:`HostStaging` (CPU tensors): the bytes are already in host memory;
  nothing is copied. This is the CPU path, exactly as fast as before.
* :class:`CopyStaging` (any other device): pinned host buffers reused per
  chunk size (torch's caching host allocator; pinned, the copies are DMA and
  asynchronous; a payload is its pinned buffer, not copied again), copied on
  side CUDA streams (one each way) with events, so they do not queue behind
  the compute stream's kernels (training may go on there while an exchange
  runs). The encoder
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
    """A device's staging: pinned host buffers, and on CUDA side streams for the copies."""

    def __init__(self, device: torch.device | str) -> None:
        self.device = _indexed(torch.device(device))
        self._cuda = self.device.type == "cuda"
        # One side stream each way: a GPU has a copy engine per direction, so a
        # chunk going out and one coming in cross PCIe at the same time.
        self._down = torch.cuda.Stream(self.device) if self._cuda else None
        self._up = torch.cuda.Stream(self.device) if self._cuda else None
        self.bytes_to_host = 0
        self.bytes_to_device = 0
        """Bytes copied each way over this staging's life (encoded bytes only)."""

    def empty(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def to_host(self, raw: torch.Tensor) -> Buffer:
        n = raw.numel()
        if n == 0:
            return b""
        host = self._host_buffer(n)
        if self._down is None:
            host.copy_(raw)
        else:
            # The copy waits for the kernels that wrote raw, on the side stream, so
            # it does not queue behind later work on the compute stream.
            written = torch.cuda.Event()
            written.record(torch.cuda.current_stream(self.device))
            self._down.wait_event(written)
            with torch.cuda.stream(self._down):
                host.copy_(raw, non_blocking=True)
            raw.record_stream(self._down)  # raw's memory is not reused before the copy
            copied = torch.cuda.Event()
            copied.record(self._down)
            copied.synchronize()  # this (encoder) thread waits; the event loop sends on
        self.bytes_to_host += n
        # The payload is the pinned buffer itself (no second host copy); it goes
        # back to the cache when the payload is dropped (see _host_buffer).
        return memoryview(host.numpy())

    def to_device(self, parts: Sequence[Buffer]) -> list[torch.Tensor]:
        """One copy for all ``parts`` (a chunk's scales and values), each aligned."""
        offsets, total = [], 0
        for part in parts:
            offsets.append(total)
            total += -(-len(part) // _ALIGN) * _ALIGN
        if total == 0:
            return [torch.empty(0, dtype=torch.uint8, device=self.device) for _ in parts]
        host = self._host_buffer(total)
        view = memoryview(host.numpy())
        for at, part in zip(offsets, parts, strict=True):
            # One memcpy on the calling thread. torch's threaded copy_ made a lone
            # 2^28-value decode 2.5x faster on the H200 machine (130.7 -> 53.1 ms), but
            # with it a loopback round of the engine, 1 GB per site, went from 5.7 to
            # 9.7 s (docs/benchmarks.md, GPU sites). The engine decodes many chunks
            # at once on its own threads, which supply the parallelism; each copy_
            # opening an OpenMP team beside them is the likely cause (not isolated).
            view[at : at + len(part)] = part
        if self._up is None:
            device = host.to(self.device, copy=True)
        else:
            with torch.cuda.stream(self._up):
                device = torch.empty(total, dtype=torch.uint8, device=self.device)
                # torch records this copy on the pinned block: the cache does not
                # hand it out again before the copy is done.
                device.copy_(host, non_blocking=True)
            copied = torch.cuda.Event()
            copied.record(self._up)
            current = torch.cuda.current_stream(self.device)
            current.wait_event(copied)  # decoding (on the current stream) waits for it
            device.record_stream(current)
        self.bytes_to_device += total
        return [device[at : at + len(part)] for at, part in zip(offsets, parts, strict=True)]

    def settle(self) -> None:
        if self._cuda:
            torch.cuda.current_stream(self.device).synchronize()

    def _host_buffer(self, nbytes: int) -> torch.Tensor:
        """A host buffer for one chunk's bytes. On CUDA it is pinned, from torch's
        caching host allocator: a freed block is kept and handed out again for the
        next chunk of its size (class) once its copies are done, so after the first
        round no chunk pays for pinning memory (cudaHostAlloc is slow)."""
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=self._cuda)


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
