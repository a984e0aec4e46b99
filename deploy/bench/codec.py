"""The codec benchmark behind ``isthmus bench codec``.

Speed is measured on one core (``torch.set_num_threads(1)``), as GB/s of float32
input, encode and decode separately and together, decoding into a reused
buffer as the collective engine does. Compression ratio and error are measured
on a real pseudo-gradient: a small byte-level transformer trained for a few
DiLoCo inner steps on the Python standard library's source, global minus
local parameters. Targets (collective engine issue): int8 encode + decode
>= 1 GB/s per core; byte-shuffle + zstd gains >= 1.3x on bf16 pseudo-gradients.
"""

from __future__ import annotations

import statistics
import sysconfig
import time
from pathlib import Path
from typing import Any

import torch

from isthmus.inter.codecs import parse_codec
from isthmus.job.basics import CODECS

SPECS = (
    *CODECS,
    *("none+zstd", "bf16+zstd", "int8+zstd", "int4+zstd", "int2+zstd"),
)


def stdlib_bytes(limit: int = 4 << 20) -> torch.Tensor:
    """Bytes of the Python standard library's source: real text on every machine."""
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks, total = [], 0
    for path in sorted(root.glob("*.py")):
        data = path.read_bytes()
        chunks.append(data)
        total += len(data)
        if total >= limit:
            break
    return torch.frombuffer(bytearray(b"".join(chunks)[:limit]), dtype=torch.uint8).long()


def pseudo_gradient(*, steps: int = 20, seed: int = 0, width: int = 128) -> torch.Tensor:
    """Global minus local parameters of a small byte-level transformer after ``steps``
    AdamW steps: what DiLoCo sends across the WAN."""
    torch.manual_seed(seed)
    layer = torch.nn.TransformerEncoderLayer(
        width, nhead=4, dim_feedforward=4 * width, batch_first=True, dropout=0.0
    )
    model = torch.nn.Sequential(
        torch.nn.Embedding(256, width),
        torch.nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False),
        torch.nn.Linear(width, 256),
    )
    start = torch.nn.utils.parameters_to_vector(model.parameters()).detach().clone()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    text = stdlib_bytes()
    generator = torch.Generator().manual_seed(seed)
    mask = torch.nn.Transformer.generate_square_subsequent_mask(64)
    for _ in range(steps):
        offsets = torch.randint(0, text.numel() - 65, (16,), generator=generator)
        batch = torch.stack([text[o : o + 65] for o in offsets])
        hidden = model[1](model[0](batch[:, :-1]), mask=mask, is_causal=True)
        logits = model[2](hidden)
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 256), batch[:, 1:].reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    end = torch.nn.utils.parameters_to_vector(model.parameters()).detach()
    return (start - end).float().contiguous()


def _time(fn: Any, repeats: int) -> float:
    fn()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def run_codec_bench(*, size_mib: float = 64.0, repeats: int = 5) -> dict[str, Any]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        values = torch.randn(int(size_mib * 2**20 / 4), generator=torch.Generator().manual_seed(0))
        grad = pseudo_gradient()
        out = torch.empty_like(values)
        rows = []
        for spec in SPECS:
            codec = parse_codec(spec)
            encoded = codec.encode(values)
            encode_s = _time(lambda codec=codec: codec.encode(values), repeats)
            decode_s = _time(lambda codec=codec, e=encoded: codec.decode(e, out=out), repeats)
            g_encoded = codec.encode(grad)
            error = (codec.decode(g_encoded).double() - grad.double()).abs()
            bound = codec.max_error(grad)
            gb = values.numel() * 4 / 1e9
            rows.append(
                {
                    "codec": spec,
                    "encode_gb_per_s": round(gb / encode_s, 3),
                    "decode_gb_per_s": round(gb / decode_s, 3),
                    "encode_decode_gb_per_s": round(gb / (encode_s + decode_s), 3),
                    "ratio": round(grad.numel() * 4 / len(g_encoded.payload), 3),
                    "max_abs_error": float(error.max()),
                    "max_error_over_bound": (
                        float((error / bound.clamp_min(1e-300)).max())
                        if spec.split("+")[0] != "none"
                        else 0.0
                    ),
                }
            )
    finally:
        torch.set_num_threads(threads)
    by = {row["codec"]: row for row in rows}
    int8_speed = by["int8"]["encode_decode_gb_per_s"]
    zstd_gain = by["bf16+zstd"]["ratio"] / by["bf16"]["ratio"]
    return {
        "size_mib": size_mib,
        "pseudo_gradient_values": grad.numel(),
        "codecs": rows,
        "int8_encode_decode_gb_per_s": int8_speed,
        "bf16_zstd_gain": round(zstd_gain, 3),
        "ok": int8_speed >= 1.0 and zstd_gain >= 1.3,
    }


def format_codec_report(r: dict[str, Any]) -> str:
    out = [
        f"codecs on one core ({r['size_mib']:g} MiB of float32; ratio and error on a real "
        f"pseudo-gradient of {r['pseudo_gradient_values']} values)",
        "  codec        encode GB/s  decode GB/s  enc+dec GB/s   ratio   max |err|  err/bound",
    ]
    for row in r["codecs"]:
        out.append(
            f"  {row['codec']:<11} {row['encode_gb_per_s']:>11.2f}  {row['decode_gb_per_s']:>11.2f}"
            f"  {row['encode_decode_gb_per_s']:>12.2f}  {row['ratio']:>6.2f}"
            f"  {row['max_abs_error']:>10.2e}  {row['max_error_over_bound']:>9.3f}"
        )
    out.append(
        f"int8 encode+decode: {r['int8_encode_decode_gb_per_s']:.2f} GB/s per core (target >= 1)"
    )
    out.append(
        f"byte-shuffle + zstd on bf16 pseudo-gradients: {r['bf16_zstd_gain']:.2f}x (target >= 1.3)"
    )
    out.append("all targets met" if r["ok"] else "some targets MISSED")
    return "\n".join(out)
