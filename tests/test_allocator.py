"""The data path's malloc settings (isthmus.inter.allocator), each in a fresh process:
they are process-wide and cannot be undone."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

PROBE = """
import resource
from isthmus.inter.allocator import keep_freed_memory
applied = keep_freed_memory()
again = keep_freed_memory()
# Buffers of megabytes, each freed before the next: chunk messages, payloads and
# their copies. Reused from the heap they cost no new page faults; mapped anew
# they cost one per 4 KiB page every time.
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for mib in range(1, 25):
    buffer = bytearray(mib << 20)
    del buffer
faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
print(applied, again, faults)
"""

glibc = pytest.mark.skipif(
    platform.system() != "Linux" or platform.libc_ver()[0] != "glibc",
    reason="the settings are glibc's mallopt",
)


def probe(keep: str) -> tuple[bool, bool, int]:
    out = subprocess.run(
        [sys.executable, "-c", PROBE],
        env={**os.environ, "ISTHMUS_KEEP_FREED_MEMORY": keep},
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    return out[0] == "True", out[1] == "True", int(out[2])


@glibc
def test_freed_buffers_are_reused_instead_of_faulted_in_again() -> None:
    applied, again, kept = probe("1")
    assert applied and again  # once per process; the second call says so too
    off, off_again, default = probe("0")
    assert not off and not off_again
    # 1 + 2 + ... + 24 MiB is 76,800 pages if every buffer is mapped anew; reused,
    # only the heap's growth to the largest faults (24 MiB, 6,144 pages).
    assert default > 4 * kept, (default, kept)


SERVER_PROBE = """
import asyncio, resource, sys
from isthmus.inter.peer import Identity, PeerServer

async def serve():
    server = PeerServer(Identity(job="j", site="a", rank=0), ["a"], lambda chunk: None)
    await server.start("127.0.0.1", 0)
    await server.stop(0)

asyncio.run(serve())
if sys.argv[1] == "launcher":  # what a launcher that owns the process does
    from isthmus.inter.allocator import keep_freed_memory
    keep_freed_memory()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for mib in range(1, 25):
    buffer = bytearray(mib << 20)
    del buffer
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def server_probe(who: str) -> int:
    env = {k: v for k, v in os.environ.items() if k != "ISTHMUS_KEEP_FREED_MEMORY"}
    out = subprocess.run(
        [sys.executable, "-c", SERVER_PROBE, who],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    return int(out.stdout.split()[-1])


@glibc
def test_starting_a_peer_server_leaves_malloc_as_it_is() -> None:
    """A library call must not change the whole process's allocator: that is the
    choice of whoever owns the process (the launchers call keep_freed_memory)."""
    untouched = server_probe("library")
    tuned = server_probe("launcher")
    assert untouched > 4 * tuned, (untouched, tuned)
