"""CPU time of one chunk's way through a site, with and without the allocator settings.

Encodes, serialises, parses, verifies and decodes a slice's chunks the way the
peer service does (one core, no network), in a fresh process for each setting
of ``ISTHMUS_KEEP_FREED_MEMORY`` (:mod:`isthmus.inter.allocator`), and prints the
median milliseconds of each, alternating, and their ratio.

    python benchmarks/chunk_path.py [--chunks 6] [--chunk-mib 4] [--repeats 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys

MEASURE = """
import sys, time, torch
from isthmus.inter.allocator import keep_freed_memory
from isthmus.inter.chunks import ReceivedChunk, encode_chunk, verify
from isthmus.inter.codecs import parse_codec
from isthmus.proto import wire_pb2
torch.set_num_threads(1)
keep_freed_memory()
chunks, values = int(sys.argv[1]), int(float(sys.argv[2]) * 2**20 / 4)
codec = parse_codec("none")
slices = [torch.randn(values) for _ in range(chunks)]
into = torch.empty(chunks * values)

def once():
    for index, piece in enumerate(slices):
        sent = encode_chunk(codec, piece, round=1, shard=0, offset=index * values,
                            index=index, count=chunks, weight=1.0)
        got = wire_pb2.Chunk.FromString(sent.SerializeToString())
        payload = got.payload
        ReceivedChunk.from_wire(got, payload, verify(got, payload), "peer", 0).decode_into(into)

once()
times = []
for _ in range(10):
    start = time.perf_counter()
    once()
    times.append(time.perf_counter() - start)
print(sorted(times)[len(times) // 2] * 1e3)
"""


def run(keep: bool, chunks: int, chunk_mib: float) -> float:
    env = {**os.environ, "ISTHMUS_KEEP_FREED_MEMORY": "1" if keep else "0"}
    out = subprocess.run(
        [sys.executable, "-c", MEASURE, str(chunks), str(chunk_mib)],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    return float(out.stdout)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chunks", type=int, default=6)
    parser.add_argument("--chunk-mib", type=float, default=4.0)
    parser.add_argument("--repeats", type=int, default=5, help="processes per setting")
    args = parser.parse_args()
    if args.chunks < 1 or args.chunk_mib <= 0 or args.repeats < 1:
        parser.error("--chunks and --repeats must be >= 1, --chunk-mib > 0")
    timings: dict[bool, list[float]] = {False: [], True: []}
    for i in range(args.repeats):
        for keep in (False, True):
            timings[keep].append(run(keep, args.chunks, args.chunk_mib))
        print(f"  run {i + 1}/{args.repeats}", file=sys.stderr, flush=True)
    default, kept = (statistics.median(timings[k]) for k in (False, True))
    print(f"{args.chunks} chunks of {args.chunk_mib:g} MiB through one site, median ms:")
    print(f"  malloc's defaults              {default:7.1f}")
    print(f"  ISTHMUS_KEEP_FREED_MEMORY=1    {kept:7.1f}   ({default / kept:.2f}x less CPU)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
