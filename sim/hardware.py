"""Host work of one site from its hardware: the codec, the device-host copies and the
outer step, per value exchanged.

The performance model counts as host work what a site's training process does
beside the wire in every exchange: encode and decode the values, move the
encoded bytes between the accelerator and pinned host memory, and (DiLoCo
family) the outer step. How long that takes depends on where it runs:

* ``cpu``: this project's CPU sites, the emulated runs the model is validated
  on: a codec at the rate ``isthmus bench codec`` measures on one core, the
  outer step as timed on the tiny model, scaled by the values it updates.
* a GPU: the codec's kernels and the outer step at the GPU's memory bandwidth,
  and the encoded bytes over PCIe, each way once.

Every number says whether it was measured (where, when) or assumed (from
what). The GPU numbers come from one run on an H200 (``bash
benchmarks/gpu_device.sh``, docs/benchmarks.md "GPU sites"); other GPUs are
scaled from it by their data-sheet memory bandwidth at the fraction of it the
H200 reached.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from isthmus.sim.perf_model import CODEC_BYTES_PER_VALUE as CODEC_WIRE_BYTES

CODEC_KERNEL_BYTES = {
    "none": 8.0,
    "fp16": 12.0,
    "bf16": 12.0,
    "int8": 42.0,
    "int4": 50.0,
    "int2": 56.0,
}
"""Device-memory bytes per value that encode and decode move together, counted from
``inter/codecs.py``'s torch ops: int8 encode reads the values for the block maxima
and minima (8), scales them into a scratch buffer (4 + 4), rounds it in place
(4 + 4) and casts it to int8 (4 + 1); decode widens the bytes (1 + 4) and scales
them in place (4 + 4). int4 and int2 add their packing and unpacking passes. An
assumption from the code, not a measurement; the blockwise codecs now take the H200's
measured times (:data:`H200_CODEC_S_PER_VALUE`), the float ones still this."""

H200_HOST_LINK_BYTES_PER_S = 54.7e9
"""Pinned device-to-host copy of 1.016 GB in 18.6 ms on the H200 (host-to-device the
same): measured 2026-11-28."""
H200_CODEC_S_PER_VALUE = {
    "int8": (47.19e-3 - 2 * 5.10e-3) / 2**28,
    "int4": (33.66e-3 - 2 * 138_412_032 / H200_HOST_LINK_BYTES_PER_S) / 2**28,
    "int2": (20.73e-3 - 2 * 71_303_168 / H200_HOST_LINK_BYTES_PER_S) / 2**28,
}
"""Encode plus decode on the H200, 2^28 values, less the two pinned copies of the
payload (measured for int8, 5.1 ms each way; for int4 and int2 their payload at
54.7 GB/s): ``benchmarks/gpu.py`` codecs part, 2026-11-28, commit ``bb8c66f``
(docs/benchmarks.md, "Second run"). 0.138 ns per value for int8, 13x the kernels'
memory traffic at the copy bandwidth: most of it is host work (decode's one-core
copy into pinned memory; a threaded one slowed the engine and was reverted), so
other GPUs take the H200's figure rather than one scaled by memory bandwidth."""

CPU_CODEC_BYTES_PER_S = 1.45e9
"""int8 encode + decode per core on this project's 2-core machine, bytes of float32
per second (``isthmus bench codec``)."""
CPU_OUTER_STEP_S_PER_VALUE = 0.003 / 471_000
"""DiLoCo's outer step on the CPU, per value: 3.1-3.6 ms over the tiny model's 0.47 M
parameters, one thread (pseudo-gradients, Nesterov SGD on the CPU copies, the copy
back), timed 2026-11-24."""

H200_COPY_BYTES_PER_S = 4.033e12
"""A device-to-device copy on the H200, bytes read plus written: measured 2026-11-28."""
H200_OUTER_STEP_S_PER_VALUE = 16.5e-3 / 1e9
"""The outer step over 1e9 float32 values on the H200 (pseudo-gradient, Nesterov SGD,
model reset): 16.5 ms, measured 2026-11-28 (``benchmarks/gpu.py`` exchange part)."""
MEMORY_FRACTION = H200_COPY_BYTES_PER_S / 4.8e12
"""The share of its data-sheet memory bandwidth the H200 reached in a copy (0.84);
other GPUs are assumed to reach the same share of theirs."""

GPU_MEMORY_BYTES_PER_S = {"h100": 3.35e12, "h200": 4.8e12, "a100": 2.039e12, "b200": 8.0e12}
"""Data-sheet memory bandwidth (SXM parts)."""
GPU_HOST_LINK_BYTES_PER_S = {"h100": 54.7e9, "h200": 54.7e9, "a100": 27.3e9, "b200": 54.7e9}
"""Pinned host copies: PCIe 5.0 x16 as measured on the H200; the A100's PCIe 4.0 at
half of that (assumed)."""


@dataclass(frozen=True)
class SiteHardware:
    """Where a site's host work runs, and how fast."""

    name: str
    codec_s_per_value: dict[str, float]
    """Encode plus decode of one float32 value: the kernels (or the CPU's work)."""
    outer_step_s_per_value: float
    host_link_bytes_per_s: float = float("inf")
    """Device-host copies of the encoded bytes, each way (a GPU's PCIe; none on a CPU
    site). They run on the GPU's copy engines chunk by chunk beside the sending, so
    the model overlaps them with the wire instead of adding them to host work."""
    measured: list[str] = field(default_factory=list)
    assumed: list[str] = field(default_factory=list)

    def codec_bytes_per_s(self, codec: str) -> float:
        """The codec's speed as the performance model takes it: float32 bytes per second."""
        per_value = self.codec_s_per_value[codec]
        return 4.0 / per_value if per_value > 0 else float("inf")

    def describe(self) -> dict[str, object]:
        return {
            "hardware": self.name,
            "codec_ns_per_value": {k: v * 1e9 for k, v in self.codec_s_per_value.items()},
            "outer_step_ns_per_value": self.outer_step_s_per_value * 1e9,
            "host_link_GBps": (
                None
                if self.host_link_bytes_per_s == float("inf")
                else self.host_link_bytes_per_s / 1e9
            ),
            "measured": self.measured,
            "assumed": self.assumed,
        }


def cpu_site() -> SiteHardware:
    per_value = 4.0 / CPU_CODEC_BYTES_PER_S
    return SiteHardware(
        name="cpu",
        codec_s_per_value={
            codec: 0.0 if codec == "none" else per_value for codec in CODEC_WIRE_BYTES
        },
        outer_step_s_per_value=CPU_OUTER_STEP_S_PER_VALUE,
        measured=[
            "codec: int8 encode + decode on one core of this project's 2-core machine "
            "(isthmus bench codec), taken for every codec",
            "outer step: timed on the tiny model on the same machine, 2026-11-24",
        ],
    )


def gpu_site(gpu: str) -> SiteHardware:
    """Host work on ``gpu`` (a key of :data:`GPU_MEMORY_BYTES_PER_S`)."""
    if gpu not in GPU_MEMORY_BYTES_PER_S:
        raise KeyError(gpu)
    memory = GPU_MEMORY_BYTES_PER_S[gpu] * MEMORY_FRACTION
    link = GPU_HOST_LINK_BYTES_PER_S[gpu]
    codec = {name: CODEC_KERNEL_BYTES[name] / memory for name in CODEC_WIRE_BYTES}
    codec.update(H200_CODEC_S_PER_VALUE)
    codec["none"] = 0.0  # no kernels: the float32 values themselves cross PCIe
    outer = H200_OUTER_STEP_S_PER_VALUE * H200_COPY_BYTES_PER_S / memory
    measured = [
        "H200 device copy 4,033 GB/s, 2026-11-28",
        "codecs int8, int4, int2: encode + decode on the H200 less the pinned copies, "
        "2026-11-28"
        + ("" if gpu == "h200" else " (taken as they are: mostly host work, not scaled)"),
    ]
    assumed = [
        "codecs fp16 and bf16: device-memory bytes per value counted from the code "
        "(CODEC_KERNEL_BYTES) at the memory bandwidth",
    ]
    if gpu == "h200":
        measured += [
            "host copies: pinned PCIe 54.7 GB/s each way on the H200, 2026-11-28",
            "outer step: 16.5 ms per 1e9 values on the H200, 2026-11-28",
        ]
    else:
        assumed += [
            f"memory bandwidth: {gpu}'s data sheet x {MEMORY_FRACTION:.2f} "
            "(the share the H200 reached)",
            f"host copies: {link / 1e9:.1f} GB/s each way"
            + (
                " (PCIe 5.0, as measured on the H200)"
                if link == H200_HOST_LINK_BYTES_PER_S
                else " (PCIe 4.0: half of PCIe 5.0)"
            ),
            "outer step: the H200's measured 16.5 ms per 1e9 values, scaled by memory bandwidth",
        ]
    return SiteHardware(gpu, codec, outer, link, measured, assumed)


def site_hardware(name: str) -> SiteHardware:
    """``cpu`` or a GPU's name (h100, h200, a100, b200)."""
    return cpu_site() if name == "cpu" else gpu_site(name)
