"""The performance model beside published results, with every assumption stated.

    python benchmarks/published_comparison.py [--write-docs]

Three published results, each recomputed with ``isthmus.sim.perf_model`` at
the scale it was measured (thousands of GPUs, 1B-340B parameters): far outside
what the emulated validation covers, so these rows test the model's structure
(what overlaps with what, how bytes scale with H, codec and fragments), not
its calibration. Where a publication does not give an input, the assumption
and its source are printed with the row; where an input is derived from the
same publication, the row says so, since it then checks arithmetic rather than
predicting. ``--write-docs`` rewrites the table in docs/performance-model.md.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from isthmus.sim.cost import LinkCost
from isthmus.sim.perf_model import Scenario, predict_run, step_seconds_from_flops

MARKERS = ("<!-- published:start -->", "<!-- published:end -->")


def links(sites: list[str], *, mbit: float, rtt_ms: float) -> dict[frozenset[str], LinkCost]:
    cost = LinkCost.of(bandwidth_mbit=mbit, rtt_ms=rtt_ms)
    return {frozenset((a, b)): cost for i, a in enumerate(sites) for b in sites[i + 1 :]}


def with_bandwidth(scenario: Scenario, mbit: float) -> Scenario:
    rtt_ms = next(iter(scenario.links.values())).one_way_s * 2e3
    return dataclasses.replace(
        scenario, links=links(list(scenario.sites), mbit=mbit, rtt_ms=rtt_ms)
    )


def bandwidth_for(scenario: Scenario, utilization: float) -> float:
    """The smallest bandwidth (Mbit/s, every link) at which the model reaches
    ``utilization`` (bisection on a log scale)."""
    low, high = 1e-3, 1e9
    if predict_run(with_bandwidth(scenario, high)).utilization < utilization:
        return float("inf")
    for _ in range(200):
        middle = (low * high) ** 0.5
        if predict_run(with_bandwidth(scenario, middle)).utilization >= utilization:
            high = middle
        else:
            low = middle
    return high


def step_for_bandwidth(scenario: Scenario, mbit: float, utilization: float) -> float:
    """The compute time per step at which ``scenario`` at ``mbit`` reaches ``utilization``."""
    low, high = 1e-4, 1e4
    at = with_bandwidth(scenario, mbit)
    for _ in range(200):
        middle = (low * high) ** 0.5
        if predict_run(dataclasses.replace(at, step_s=middle)).utilization >= utilization:
            high = middle
        else:
            low = middle
    return high


def streaming_diloco() -> list[dict]:
    """Streaming DiLoCo (Douillard et al., 2025, arXiv:2501.18512), its simulation:
    bandwidth between two workers for ~95% compute utilisation: data-parallel about
    100/200/300 Gbit/s, Streaming DiLoCo about 1-5 Gbit/s, for 1B/10B/100B."""
    rows = []
    published_dp = {1e9: 100e3, 1e10: 200e3, 1e11: 300e3}  # Mbit/s, as the issue quotes it
    for params, dp_mbit in published_dp.items():
        sites = ["w1", "w2"]
        dp = Scenario(
            params=params,
            step_s=1.0,  # replaced below
            tokens_per_step=1.0,
            sites=sites,
            links=links(sites, mbit=dp_mbit, rtt_ms=10),
            strategy="sync",
            codec="bf16",
        )
        # The step time is not in the summary we quote: take the one at which the
        # model's data-parallel needs the published bandwidth, then predict Streaming.
        step_s = step_for_bandwidth(dp, dp_mbit, 0.95)
        streaming = dataclasses.replace(
            dp, step_s=step_s, strategy="streaming", sync_every=100, fragments=8,
            overlap_steps=1, codec="int4",
        )  # fmt: skip
        predicted = bandwidth_for(streaming, 0.95)
        longer = bandwidth_for(dataclasses.replace(streaming, overlap_steps=5), 0.95)
        rows.append(
            {
                "result": f"Streaming DiLoCo, {params / 1e9:g}B: bandwidth for 95% utilisation",
                "published": f"about 1-5 Gbit/s (data-parallel: {dp_mbit / 1e3:g} Gbit/s)",
                "model": f"{predicted / 1e3:.2f} Gbit/s "
                f"({dp_mbit / predicted:.0f}x less than data-parallel; overlapping 5 steps "
                f"instead of 1: {longer / 1e3:.2f} Gbit/s)",
                "within": 1e3 <= predicted <= 5e3,
                "assumptions": f"2 workers, 10 ms RTT, ideal engine; step time {step_s:.2f} s "
                "derived from the published data-parallel bandwidth (sync, bf16 gradients "
                "overlapped with backward); Streaming: H=100, 8 fragments, overlap 1 inner step, "
                "4-bit values (the paper: FP4 E3M0)",
            }
        )
    return rows


def nvidia_340b() -> dict:
    """NVIDIA's multi-data-center training of Nemotron-4 340B: two data centers about
    1,000 km apart, 96% scaling efficiency against one site (NVIDIA, NeMo
    multi-data-center training, 2025)."""
    sites = ["dc1", "dc2"]
    gpus_per_site = 3072
    tokens_per_step = 2304 * 4096  # Nemotron-4 340B's final global batch
    step_s = step_seconds_from_flops(340e9, tokens_per_step / (2 * gpus_per_site), "h100", 0.4)
    scenario = Scenario(
        params=340e9,
        step_s=step_s,
        tokens_per_step=tokens_per_step,
        sites=sites,
        links=links(sites, mbit=1e6, rtt_ms=10),
        strategy="sync",
        codec="bf16",
    )
    needed = bandwidth_for(scenario, 0.96)
    return {
        "result": "NVIDIA, Nemotron-4 340B across 2 data centers ~1,000 km apart: 96% scaling "
        "efficiency",
        "published": "96% (the inter-site bandwidth is not in the material we quote)",
        "model": f"96% needs {needed / 1e6:.2f} Tbit/s between the sites; with 10 ms RTT the "
        "latency part is negligible",
        "within": None,
        "assumptions": f"{gpus_per_site} H100 per site at 40% MFU (Nemotron-4's reported MFU "
        f"is 41-42%), global batch 2304 x 4096 tokens: {step_s:.1f} s per step; sync "
        "(hierarchical data parallel, bf16 gradients overlapped with backward); "
        "1,000 km of fibre = 10 ms RTT",
    }


def intellect_1() -> list[dict]:
    """INTELLECT-1 (Prime Intellect, 2024): 10B parameters, DiLoCo H=100 with int8
    pseudo-gradients over the public internet; compute utilisation 96% within the US,
    85.6% across the US and Europe, 83% across three continents."""
    rows = []
    # The report's median all-reduce times (103 s US, 382 s transatlantic, 469 s
    # global) and utilisations imply ~23 s per inner step; per-node WAN throughput
    # is not given, so it is derived from the same all-reduce times.
    inner_step_s = 22.9
    nodes = 14
    sites = [f"n{i}" for i in range(nodes)]
    for where, published, mbit, rtt in (
        ("within the US", 0.96, 1600, 40),
        ("US and Europe", 0.856, 430, 100),
        ("three continents", 0.83, 350, 200),
    ):
        scenario = Scenario(
            params=10e9,
            step_s=inner_step_s,
            tokens_per_step=1.0,
            sites=sites,
            links=links(sites, mbit=1e6, rtt_ms=rtt),
            uplink_bytes_per_s={s: mbit * 1e6 / 8 for s in sites},
            strategy="diloco",
            sync_every=100,
            codec="int8",
        )
        predicted = predict_run(scenario)
        rows.append(
            {
                "result": f"INTELLECT-1, 10B, {where}: compute utilisation",
                "published": f"{published:.1%}",
                "model": f"{predicted.utilization:.1%} (exchange {predicted.exchange_s:.0f} s)",
                "within": abs(predicted.utilization - published) <= 0.02,
                "assumptions": f"{nodes} nodes as sites, H=100, int8, {inner_step_s} s per inner "
                f"step; each node's WAN uplink {mbit} Mbit/s, RTT {rtt} ms. Step time and "
                "uplinks are derived from the same report's all-reduce times, so this row "
                "checks the round arithmetic and the all-reduce's cost on 14 nodes, not an "
                "independent prediction",
            }
        )
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--write-docs", action="store_true")
    args = parser.parse_args()
    rows = [*streaming_diloco(), nvidia_340b(), *intellect_1()]
    for row in rows:
        print(f"{row['result']}\n  published: {row['published']}\n  model:     {row['model']}")
        print(f"  assumes:   {row['assumptions']}\n")
    if args.write_docs:
        write_docs(rows)
    return 0


def write_docs(rows: list[dict]) -> None:
    doc = Path(__file__).resolve().parent.parent / "docs" / "performance-model.md"
    lines = [
        MARKERS[0],
        "",
        "| published result | published | model | assumptions |",
        "| --- | --- | --- | --- |",
    ]
    for r in rows:
        lines.append(f"| {r['result']} | {r['published']} | {r['model']} | {r['assumptions']} |")
    lines += ["", MARKERS[1]]
    text = doc.read_text()
    if MARKERS[0] not in text:
        text += f"\n{MARKERS[0]}\n{MARKERS[1]}\n"
    start, end = text.index(MARKERS[0]), text.index(MARKERS[1]) + len(MARKERS[1])
    doc.write_text(text[:start] + "\n".join(lines) + text[end:])


if __name__ == "__main__":
    raise SystemExit(main())
