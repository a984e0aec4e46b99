"""The sparse codec (``topk``) beside the dense ones: bytes per value, speed, device bytes.

For each codec: the payload's bytes per float32 value, the median time of one
encode + decode of the same values (one call each, what an owner does per
chunk), as GB/s of float32, and on a GPU whether the device wrote the bytes the
CPU writes (every site must decode the same values, whatever it runs on)::

    python benchmarks/sparse_codec.py                       # CPU, 2**22 values
    python benchmarks/sparse_codec.py --device cuda --values 67108864
    python benchmarks/sparse_codec.py --json FILE
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from isthmus.inter.codecs import parse_codec

SPECS = ["int8", "int2", "int2+zstd", "topk", "topk:density=0.01", "topk:bits=4", "topk+zstd"]


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def measure(spec: str, values: torch.Tensor, repeats: int) -> dict:
    codec = parse_codec(spec)
    device = str(values.device)
    out = torch.empty_like(values)
    encoded = codec.encode(values)  # warm: the first call allocates and compiles nothing later
    codec.decode(encoded, out=out)
    times = []
    for _ in range(repeats):
        _sync(device)
        started = time.perf_counter()
        codec.decode(codec.encode(values), out=out)
        _sync(device)
        times.append(time.perf_counter() - started)
    median = statistics.median(times)
    row = {
        "codec": codec.spec,
        "bytes_per_value": len(bytes(encoded.payload)) / values.numel(),
        "encode_decode_s": median,
        "float32_gb_per_s": values.numel() * 4 / median / 1e9,
    }
    if device != "cpu":
        row["device_bytes_equal_cpu"] = bytes(encoded.payload) == bytes(
            codec.encode(values.cpu()).payload
        )
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--values", type=int, default=1 << 22)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args()
    generator = torch.Generator(args.device).manual_seed(0)
    values = torch.randn(args.values, device=args.device, generator=generator)
    rows = []
    for spec in SPECS:
        rows.append(measure(spec, values, args.repeats))
        r = rows[-1]
        same = (
            f", device bytes = CPU bytes: {r['device_bytes_equal_cpu']}"
            if "device_bytes_equal_cpu" in r
            else ""
        )
        print(
            f"{r['codec']:44} {r['bytes_per_value']:.4f} B/value ({4 / r['bytes_per_value']:6.1f}x)"
            f"  encode+decode {r['encode_decode_s'] * 1e3:8.1f} ms"
            f" = {r['float32_gb_per_s']:6.2f} GB/s{same}",
            flush=True,
        )
    if args.json:
        machine = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
        record = {"device": args.device, "machine": machine, "values": args.values, "rows": rows}
        with open(args.json, "w") as f:
            json.dump(record, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
