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


PAPER_TABLE_95 = {
    # Streaming DiLoCo (Douillard et al., 2025, arXiv:2501.18512), Table 4: Gbit/s for a
    # compute utilisation of 95%, two workers. Size: (layers, step seconds, {method: Gbit/s}).
    1e9: (24, 0.1, {"dp": 222.3, "diloco": 23.3, "streaming": 16.0, "overlapped": 9.1, "fp4": 2.0}),
    1e10: (
        48,
        0.8,
        {"dp": 268.3, "diloco": 33.9, "streaming": 13.3, "overlapped": 6.2, "fp4": 1.4},
    ),
    1e11: (
        108,
        4.9,
        {"dp": 390.7, "diloco": 49.4, "streaming": 11.0, "overlapped": 5.2, "fp4": 1.1},
    ),
}
"""The paper sweeps bandwidth on a grid about 21% apart (..., 1.1, 1.4, 1.7, 2.0, 2.4,
...) and reports the first grid point that reaches the utilisation: the threshold
lies between the grid point below and the one given."""
METHODS = {
    "dp": "Data-Parallel",
    "diloco": "Vanilla DiLoCo",
    "streaming": "Streaming DiLoCo",
    "overlapped": "Streaming DiLoCo, overlapped com.",
    "fp4": "Streaming DiLoCo, overlapped FP4 com.",
}
H, LAYERS_PER_FRAGMENT, WITHIN = 100, 3, 0.25


def paper_scenario(params: float, layers: int, step_s: float, method: str) -> Scenario:
    """The paper's stated inputs: its step time (6N FLOPs per token at 60% MFU), H=100,
    fragments of 3 layers, one step of overlap, 4-bit values; its simulator's
    conventions: two workers, every exchange overlapping the backward pass of the
    step that ends it, no host work, an ideal engine, bf16 where not FP4."""
    sites = ["w1", "w2"]
    base = Scenario(
        params=params,
        step_s=step_s,
        tokens_per_step=1.0,
        sites=sites,
        links=links(sites, mbit=1e3, rtt_ms=0),
        strategy="sync",
        codec="bf16",
        outer_overlaps_backward=True,
        host_hardware="none (the paper's simulator counts none)",
    )
    if method == "dp":
        return base
    if method == "diloco":
        return dataclasses.replace(base, strategy="diloco", sync_every=H)
    return dataclasses.replace(
        base,
        strategy="streaming",
        sync_every=H,
        fragments=layers // LAYERS_PER_FRAGMENT,
        overlap_steps=0 if method == "streaming" else 1,
        codec="int4" if method == "fp4" else "bf16",
    )


def _assumptions(method: str, layers: int) -> str:
    shared = "2 workers; no host work; ideal engine; no latency"
    if method == "dp":
        return f"sync, bf16 gradients overlapping the backward pass (2/3 of a step); {shared}"
    outer = f"H={H}; the exchange overlapping the backward pass of the step that ends it"
    if method == "diloco":
        return f"{outer}; bf16; {shared}"
    fragments = f"{layers // LAYERS_PER_FRAGMENT} fragments of {LAYERS_PER_FRAGMENT} layers"
    overlap = "no overlap" if method == "streaming" else "1 step of overlap"
    values = "int4 (4 bits + a float32 scale per 256)" if method == "fp4" else "bf16"
    return f"{outer}; {fragments}; {overlap}; {values}; {shared}"


def streaming_diloco_table() -> list[dict]:
    """Table 4 of the Streaming DiLoCo paper, its 95% column, from the paper's own
    inputs; beside it, the same with Isthmus's exchanges as they run (starting after
    the step, not during its backward pass) and host work on H100 sites."""
    from isthmus.sim.hardware import site_hardware

    h100 = site_hardware("h100")
    rows = []
    for params, (layers, step_s, published) in PAPER_TABLE_95.items():
        for method, gbit in published.items():
            scenario = paper_scenario(params, layers, step_s, method)
            model = bandwidth_for(scenario, 0.95) / 1e3
            as_run = dataclasses.replace(
                scenario,
                outer_overlaps_backward=False,
                codec_bytes_per_s=h100.codec_bytes_per_s(scenario.codec),
                host_link_bytes_per_s=h100.host_link_bytes_per_s,
                outer_step_s=h100.outer_step_s_per_value * params if method != "dp" else 0.0,
                host_hardware="h100",
            )
            isthmus = bandwidth_for(as_run, 0.95) / 1e3
            error = model / gbit - 1
            rows.append(
                {
                    "result": f"Streaming DiLoCo paper, Table 4, {params / 1e9:g}B "
                    f"({step_s:g} s steps): {METHODS[method]}, Gbit/s for 95% utilisation",
                    "published": f"{gbit:g}",
                    "model": f"{model:.2f} ({error:+.0%}); as Isthmus runs it on H100 "
                    "sites: "
                    + (
                        f"{isthmus:.2f}"
                        if isthmus < float("inf")
                        else "never (host work alone exceeds 5% of a step)"
                    ),
                    "error": error,
                    "within": abs(error) <= WITHIN,
                    "assumptions": _assumptions(method, layers),
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
    rows = [*streaming_diloco_table(), nvidia_340b(), *intellect_1()]
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
