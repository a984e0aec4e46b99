"""The parts of ``benchmarks/gpu.py``: each measures one group of the GPU-sites figures.

Every part is a function of a :class:`Context` returning ``{"figures": ...,
"targets": [...], "notes": [...]}``; ``gpu.py`` runs the ones asked for, prints
them and writes them into one JSON. Apart from it so that the command line and
the report read in one sitting, and each measurement here reads on its own.

Timing: on a GPU, CUDA events around the work with a device-wide synchronise
before the end event (work on side streams is counted), after warm-ups; the
figure is the median of the repeats. On the CPU, ``time.perf_counter``.

The parts that start processes (``isthmus run`` jobs, a two-process collective)
are in ``gpu_runs.py``.
"""

from __future__ import annotations

import asyncio
import gc
import os
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
LINK_BITS_PER_S = 10e9
"""The exchange target's link: 10 Gbit/s."""

# name substring (first match wins: GH200 before H200, H100 NVL / PCIe before H100)
# -> (bf16 dense peak TFLOP/s, memory bandwidth GB/s), from the vendors' data sheets.
GPU_SPECS: tuple[tuple[str, float, float], ...] = (
    ("GH200", 989.4, 4000.0),
    ("H200", 989.4, 4800.0),
    ("H100 NVL", 835.0, 3900.0),
    ("H100 PCIe", 756.0, 2000.0),
    ("H100", 989.4, 3350.0),  # SXM: "NVIDIA H100 80GB HBM3"
    ("A100-SXM4-80GB", 312.0, 2039.0),
    ("A100 80GB PCIe", 312.0, 1935.0),
    ("A100", 312.0, 1555.0),  # the 40 GB parts
    ("L40S", 362.0, 864.0),
)


@dataclass(kw_only=True)
class Context:
    """What every part needs: the device, the sizes and where run folders go."""

    device: torch.device
    quick: bool
    repeats: int
    workdir: Path
    say: Callable[[str], None]
    codec_values: int
    exchange_values: int
    exchange_rounds: int
    model: str
    batch_size: int
    inner_steps: int
    inner_skip: int
    runs: int
    compile: bool
    peak_flops: float | None
    memory_GBps: float | None
    run_timeout_s: float

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"


# -- measuring -------------------------------------------------------------------------
def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_seconds(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    """Median wall time of ``fn`` after two warm-ups, device work included."""
    for _ in range(2):
        fn()
    synchronize(device)
    samples = []
    for _ in range(repeats):
        if device.type == "cuda":
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            torch.cuda.synchronize(device)  # side streams too, not only the current one
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) / 1e3)
        else:
            started = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - started)
    return statistics.median(samples)


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def target(name: str, figure: float | None, op: str, bound: float, unit: str = "") -> dict:
    passed = figure is not None and (figure >= bound if op == ">=" else figure <= bound)
    return {"name": name, "figure": figure, "target": f"{op} {bound:g}{unit}", "pass": passed}


def check(name: str, ok: bool, detail: str = "") -> dict:
    return {"name": name, "figure": bool(ok), "target": "true", "pass": bool(ok), "detail": detail}


def error_text(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}".strip()[:2000]


# -- the machine -----------------------------------------------------------------------
def gpu_spec(name: str) -> tuple[float | None, float | None]:
    """(bf16 dense peak FLOP/s, memory bandwidth GB/s) of a GPU by name; None unknown."""
    for key, tflops, bandwidth in GPU_SPECS:
        if key.lower() in name.lower():
            return tflops * 1e12, bandwidth
    return None, None


def _command(*argv: str) -> str | None:
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=30, cwd=ROOT)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def machine(device: torch.device, quick: bool) -> dict[str, Any]:
    from isthmus import __version__

    dirty = _command("git", "status", "--porcelain", "--untracked-files=no")
    info: dict[str, Any] = {
        "host": socket.gethostname(),
        "cpus": os.cpu_count(),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "isthmus": __version__,
        # A lent machine's copy of the tree may carry a stale .git: the caller can
        # name the commit it sent (benchmarks/gpu_device.sh passes ISTHMUS_COMMIT on).
        "commit": os.environ.get("ISTHMUS_COMMIT") or _command("git", "rev-parse", "HEAD"),
        "commit_dirty": bool(dirty) if dirty is not None else None,
        "gpu": None,
    }
    if device.type != "cuda":
        return info
    props = torch.cuda.get_device_properties(device)
    peak, bandwidth = gpu_spec(props.name)
    try:
        nccl: str | None = str(torch.cuda.nccl.version())
    except Exception:  # a build without NCCL
        nccl = None
    info["gpu"] = {
        "name": props.name,
        "count": torch.cuda.device_count(),
        "memory_GiB": round(props.total_memory / 2**30, 1),
        "sms": props.multi_processor_count,
        "capability": f"{props.major}.{props.minor}",
        "driver": _command("nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"),
        "nccl": nccl,
        "bf16_dense_peak_tflops": peak / 1e12 if peak else None,
        "memory_bandwidth_GBps_spec": bandwidth,
        "memory_bandwidth_GBps_measured_copy": copy_bandwidth(device, quick),
    }
    return info


def copy_bandwidth(device: torch.device, quick: bool) -> float:
    """GB/s of a device-to-device copy (read + write), the practical ceiling."""
    n = 1 << (22 if quick else 28)
    src = torch.ones(n, device=device)
    dst = torch.empty_like(src)
    seconds = median_seconds(lambda: dst.copy_(src), device, 10)
    return 2 * 4 * n / seconds / 1e9  # src and dst go with the frame: gpu.py frees the cache


# -- codecs ----------------------------------------------------------------------------
def _payload_bytes(payload: Any) -> bytes:
    if isinstance(payload, torch.Tensor):
        return payload.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes()
    return bytes(payload)


def _payload_where(payload: Any) -> str:
    return str(payload.device) if isinstance(payload, torch.Tensor) else "host bytes"


def _payload_len(payload: Any) -> int:
    if isinstance(payload, torch.Tensor):
        return payload.numel() * payload.element_size()
    return memoryview(payload).nbytes


def copy_seconds(nbytes: int, device: torch.device, repeats: int) -> dict[str, float]:
    """Pinned host <-> device copies of ``nbytes``: what moving an encoded payload
    across PCIe costs (0 on the CPU, where the bytes are already on the host)."""
    if device.type != "cuda":
        return {"device_to_host": 0.0, "host_to_device": 0.0}
    on_device = torch.empty(nbytes, dtype=torch.uint8, device=device)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    return {
        "device_to_host": median_seconds(
            lambda: host.copy_(on_device, non_blocking=True), device, repeats
        ),
        "host_to_device": median_seconds(
            lambda: on_device.copy_(host, non_blocking=True), device, repeats
        ),
    }


def pseudo_gradient(n: int, device: torch.device, seed: int = 0) -> torch.Tensor:
    """Values with the shape of a pseudo-gradient: scales that vary by block over
    five decades, and a run of zero blocks (a frozen or unused parameter)."""
    generator = torch.Generator(device=device).manual_seed(seed)
    values = torch.randn(n, device=device, generator=generator)
    blocks = max(1, n // 4096)
    scales = torch.logspace(-5, 0, blocks, device=device)
    values[: blocks * 4096].view(blocks, 4096).mul_(scales[:, None])
    values[n // 2 : n // 2 + min(1024, n // 8)] = 0
    return values


def same_as_cpu(spec: str, device: torch.device, n: int) -> tuple[bool, str]:
    """Whether the codec gives the same payload bytes and decoded bits on ``device``
    as on the CPU for the same tensor (n values, with a partial last block)."""
    from isthmus.inter.codecs import parse_codec

    codec = parse_codec(spec)
    values = pseudo_gradient(n, device, seed=1)
    on_device = codec.encode(values)
    on_cpu = codec.encode(values.cpu())
    if _payload_bytes(on_device.payload) != _payload_bytes(on_cpu.payload):
        return False, f"payload bytes differ ({_payload_len(on_device.payload)} values)"
    decoded = codec.decode(on_device, out=torch.empty(n, device=device))
    reference = codec.decode(on_cpu, out=torch.empty(n))
    if not torch.equal(decoded.cpu().view(torch.int32), reference.view(torch.int32)):
        return False, "payloads equal, decoded values differ"
    return True, f"{n} values: same payload bytes and decoded bits"


def codecs(ctx: Context) -> dict[str, Any]:
    from isthmus.inter.codecs import parse_codec

    n = ctx.codec_values
    values = pseudo_gradient(n, ctx.device)
    out = torch.empty_like(values)
    rows: dict[str, Any] = {}
    for spec in ("int8", "int4", "int2"):
        codec = parse_codec(spec)
        try:
            encoded = codec.encode(values)
        except Exception as error:  # the codec refuses this device: the figure says so
            rows[spec] = {"error": error_text(error)}
            ctx.say(f"  {spec}: {rows[spec]['error']}")
            continue
        encode_s = median_seconds(lambda c=codec: c.encode(values), ctx.device, ctx.repeats)
        decode_s = median_seconds(
            lambda c=codec, e=encoded: c.decode(e, out=out), ctx.device, ctx.repeats
        )
        both_s = median_seconds(
            lambda c=codec: c.decode(c.encode(values), out=out), ctx.device, ctx.repeats
        )
        rate = 4 * n / both_s / 1e9
        size = _payload_len(encoded.payload)
        copies = copy_seconds(size, ctx.device, ctx.repeats) if spec == "int8" else {}
        on_device_s = both_s - sum(copies.values())
        try:
            identical, detail = same_as_cpu(spec, ctx.device, min(n, 1 << 24) + 77)
        except Exception as error:
            identical, detail = False, error_text(error)
        rows[spec] = {
            "encode_s": encode_s,
            "decode_s": decode_s,
            "encode_decode_s": both_s,
            "GBps": rate,
            "encode_GBps": 4 * n / encode_s / 1e9,
            "decode_GBps": 4 * n / decode_s / 1e9,
            "fraction_of_memory_bandwidth": rate / ctx.memory_GBps if ctx.memory_GBps else None,
            "encoded_bytes": size,
            "payload_copies_s": copies or None,
            # What the device's own kernels would reach if the payload stayed there:
            # the figure less the pinned copies of the encoded bytes (int8 only).
            "GBps_without_copies": 4 * n / on_device_s / 1e9
            if copies and on_device_s > 0
            else None,
            "payload_on": _payload_where(encoded.payload),
            "identical_to_cpu": identical,
            "identical_detail": detail,
        }
        ctx.say(
            f"  {spec}: encode+decode {both_s * 1e3:.2f} ms = {rate:,.1f} GB/s of float32 "
            f"(encode {rows[spec]['encode_GBps']:,.1f}, decode {rows[spec]['decode_GBps']:,.1f}); "
            f"payload on {rows[spec]['payload_on']}; same as CPU: {identical}"
        )
    figures = {"values": n, "input_bytes": 4 * n, "codecs": rows}
    int8 = rows.get("int8", {})
    same = [rows[s].get("identical_to_cpu") is True for s in ("int8", "int4", "int2")]
    targets = [
        target("int8 encode + decode, GB/s of float32 input", int8.get("GBps"), ">=", 200, " GB/s"),
        check(
            "int8, int4, int2 give the CPU codec's bytes on the same tensors",
            all(same),
            "; ".join(f"{s}: {r.get('identical_detail', r.get('error'))}" for s, r in rows.items()),
        ),
    ]
    return {"figures": figures, "targets": targets, "notes": []}


# -- the exchange of a pseudo-gradient ---------------------------------------------------
def exchange(ctx: Context) -> dict[str, Any]:
    """The work beside the wire of one DiLoCo round between two sites, per site.

    With the direct algorithm and two sites, each site encodes the other's half
    (its contribution) and its own half's average (the result): n values encoded,
    n decoded, and the encoded n values are what it sends. Each piece is timed on
    its own, once over the whole tensor: work that overlaps the wire in the
    engine (chunks encoded while others are on the wire) is counted once, as if
    none of it overlapped, an upper bound."""
    n, device = ctx.exchange_values, ctx.device
    grad = pseudo_gradient(n, device)
    # Each group of pieces in its own function: its buffers are freed on return,
    # before the next group allocates (1B values are 4 GB a copy).
    pieces, size, notes, copies = _codec_pieces(ctx, grad)
    free_memory()
    pieces["outer_step"] = _outer_step_s(ctx, grad)
    free_memory()
    beside = sum(pieces.values())
    wire_s = size * 8 / LINK_BITS_PER_S
    ratio = beside / wire_s
    ctx.say(
        "  pieces: "
        + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in pieces.items())
        + f"; beside the wire {beside * 1e3:.1f} ms vs {size / 1e9:.3f} GB on 10 Gbit/s "
        f"{wire_s * 1e3:.0f} ms: {ratio:.3f}"
    )
    engine = engine_rounds(ctx, grad, wire_s)
    figures = {
        "values": n,
        "codec": "int8",
        "encoded_bytes_sent_per_site": size,
        "pieces_s": pieces,
        "payload_copies_s": copies,
        "beside_wire_s": beside,
        "wire_10gbit_s": wire_s,
        "beside_wire_over_wire": ratio,
        "engine": engine,
    }
    targets = [
        target(f"work beside the wire / 10 Gbit/s wire, {n:,} values int8", ratio, "<=", 0.10),
        check(
            "the loopback round through the engine: both sites hold the same average",
            engine.get("identical") is True,
            engine.get("error", engine.get("input", "")),
        ),
    ]
    return {"figures": figures, "targets": targets, "notes": notes}


def _codec_pieces(ctx: Context, grad: torch.Tensor) -> tuple[dict, int, list[str], dict]:
    """Encode, the copies between device and host, decode and the average, timed
    apart; and the encoded size."""
    from isthmus.inter.codecs import parse_codec

    device, repeats, n = ctx.device, ctx.repeats, grad.numel()
    codec = parse_codec("int8")
    pieces: dict[str, float] = {}
    notes = []
    encoded = codec.encode(grad)
    pieces["encode"] = median_seconds(lambda: codec.encode(grad), device, repeats)
    payload = encoded.payload
    size = _payload_len(payload)
    copies = copy_seconds(size, device, repeats)
    if isinstance(payload, torch.Tensor) and payload.device.type == "cuda":
        pieces.update(copies)  # the payload stays on the device: the copies are apart
    elif ctx.cuda:  # host bytes: encode and decode make the copies, already timed
        notes.append(
            "the codec's payload is host bytes: the device-host copies are inside encode and "
            "decode (timed apart, not added again: "
            + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in copies.items())
            + ")"
        )
    out = torch.empty_like(grad)
    pieces["decode"] = median_seconds(lambda: codec.decode(encoded, out=out), device, repeats)
    half = n // 2
    average = torch.empty(half, device=device)
    pieces["average"] = median_seconds(
        lambda: torch.add(out[:half], grad[:half], out=average).mul_(0.5), device, repeats
    )
    return pieces, size, notes, copies


def _outer_step_s(ctx: Context, grad: torch.Tensor) -> float:
    """DiLoCo's outer step on n parameters: the pseudo-gradient (global - local), then
    SGD with Nesterov momentum and the model's reset, on the device."""
    from isthmus.inter.outer import OuterOptimizer

    model = grad.clone()
    outer = OuterOptimizer([model], lr=0.7, momentum=0.9, device=ctx.device)
    return median_seconds(lambda: outer.step(outer.pseudo_gradients()), ctx.device, ctx.repeats)


def engine_rounds(ctx: Context, grad: torch.Tensor, wire_s: float) -> dict[str, Any]:
    """Rounds of the real exchange between two in-process sites over loopback gRPC
    (no emulator, no cap): the device tensor goes in; if the engine refuses it, a
    host copy does, and the figure says which."""
    inputs = {"a": grad, "b": grad.flip(0)}
    try:
        rounds = asyncio.run(_rounds(inputs, ctx.exchange_rounds, ctx.device))
        source = f"{ctx.device.type} tensors"
    except Exception as error:
        if not ctx.cuda:
            return {"error": error_text(error)}
        refused = error_text(error)
        ctx.say(f"  the engine did not take cuda tensors ({refused}); again with host copies")
        host = {k: v.cpu() for k, v in inputs.items()}
        try:
            rounds = asyncio.run(_rounds(host, ctx.exchange_rounds, ctx.device))
        except Exception as again:
            return {"error": f"{refused}; with host copies: {error_text(again)}"}
        source = f"host copies (the engine refused cuda tensors: {refused})"
    timed = [r["seconds"] for r in rounds[1:]] or [rounds[0]["seconds"]]
    seconds = statistics.median(timed)
    result = {
        "input": source,
        "rounds": rounds,
        "round_s": seconds,
        "round_over_10gbit_wire": seconds / wire_s,
        "bytes_sent_per_site": max(r["bytes_sent"] for r in rounds),
        "identical": all(r["identical"] for r in rounds),
        "note": "both sites' work on one host and the loopback wire itself, "
        "the first round left out as a warm-up",
    }
    ctx.say(
        f"  engine over loopback ({source}): round {seconds:.3f} s, "
        f"{result['bytes_sent_per_site'] / 1e9:.3f} GB sent per site, same average: "
        f"{result['identical']}"
    )
    return result


async def _rounds(inputs: dict[str, torch.Tensor], rounds: int, device: torch.device) -> list:
    from isthmus.inter.allreduce import CrossSiteAllReduce
    from isthmus.inter.codecs import parse_codec
    from isthmus.inter.peer import Identity

    names = sorted(inputs)
    members, ports = {}, {}
    for name in names:  # as tests/test_allreduce.py connects its engines
        identity = Identity(job="gpu-benchmark", site=name, rank=0, layout_fingerprint="L")
        member = CrossSiteAllReduce(identity, {}, codec=parse_codec("int8"), deadline_s=600.0)
        ports[name] = await member.start("127.0.0.1", 0)
        members[name] = member
    try:
        for name, member in members.items():
            member.peers = {o: f"127.0.0.1:{ports[o]}" for o in names if o != name}
            member.server.servicer.sites = set(names)
        for member in members.values():
            await member.connect()
        records = []
        weights = {name: 1.0 for name in names}
        for number in range(rounds):
            synchronize(device)
            started = time.perf_counter()
            outs = await asyncio.gather(
                *[
                    members[s].allreduce(
                        inputs[s], round=number, participants=names, weights=weights
                    )
                    for s in names
                ]
            )
            synchronize(device)
            seconds = time.perf_counter() - started
            stats = [members[s].last for s in names]
            records.append(
                {
                    "seconds": seconds,
                    "bytes_sent": max(s.bytes_sent for s in stats if s is not None),
                    "phases": stats[0].phases if stats[0] is not None else {},
                    "output_device": str(outs[0].device),
                    "identical": torch.equal(outs[0], outs[1]),
                }
            )
            del outs
        return records
    finally:
        for member in members.values():
            await member.close()
