"""Keep freed chunk buffers in the process instead of handing them back to the kernel.

Every chunk that crosses a site boundary passes through several buffers of
megabytes: the encoded payload, the protobuf message, gRPC's serialised copy,
the received message and its payload. glibc's malloc serves blocks above its
mmap threshold (128 KiB to start with) with a fresh ``mmap`` and returns them
with ``munmap`` when freed, so every new buffer is memory the kernel has to
fault in and zero again, one 4 KiB page at a time: about 3 ms of CPU for a
4 MiB chunk, more than the checksum and every copy together. On a machine
whose cores also run the other ranks (or the WAN emulator) that is time the
links stand idle.

:func:`keep_freed_memory` raises the mmap threshold to glibc's largest (32 MiB,
above the largest chunk message) and stops the heap from being trimmed, so
freed buffers are reused from the heap: half the CPU of a chunk's way through
a site (``benchmarks/chunk_path.py``). The process keeps its peak heap instead
of returning it; the peak itself does not grow. Set
``ISTHMUS_KEEP_FREED_MEMORY=0`` to leave malloc as it is.

The setting is process-wide and cannot be undone, so no library call makes it
(starting a peer server leaves malloc alone): whoever owns the process does,
once, at its start: the rank worker of ``isthmus run`` and ``isthmus site``,
the site and all-reduce workers, the WAN proxy, the benchmarks that start
peers. A script of one's own that carries chunks may call it too.
"""

from __future__ import annotations

import ctypes
import logging
import os

log = logging.getLogger(__name__)

# mallopt's parameter numbers (glibc's malloc.h).
M_TRIM_THRESHOLD = -1
M_TOP_PAD = -2
M_MMAP_THRESHOLD = -3

MMAP_THRESHOLD_BYTES = 32 * 2**20
"""glibc's largest accepted mmap threshold on 64-bit (HEAP_MAX_SIZE / 2)."""
TRIM_THRESHOLD_BYTES = 2**30
"""Free heap above this much is returned to the kernel; below, it is kept for reuse."""
TOP_PAD_BYTES = 64 * 2**20
"""Grow the heap by this much more than asked: fewer brk calls while buffers churn."""

_applied: bool | None = None


def keep_freed_memory() -> bool:
    """Tune glibc's malloc for the data path, once per process. True if it applies
    (glibc and not turned off by ``ISTHMUS_KEEP_FREED_MEMORY=0``), else False."""
    global _applied
    if _applied is not None:
        return _applied
    _applied = False
    if os.environ.get("ISTHMUS_KEEP_FREED_MEMORY", "1") == "0":
        return False
    try:
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False  # not glibc (musl, macOS): their allocators behave otherwise
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    settings = (
        (M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES),
        (M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES),
        (M_TOP_PAD, TOP_PAD_BYTES),
    )
    if not all(mallopt(param, value) == 1 for param, value in settings):
        log.debug("mallopt refused some of the data-path settings; malloc partly tuned")
        return False
    _applied = True
    return True
