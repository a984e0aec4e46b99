"""The performance model against emulated runs on this machine: predicted vs measured.

    python benchmarks/perf_model_validation.py [--set fit|held-out|both] [--out DIR] [--write-docs]
    python benchmarks/perf_model_validation.py --replay DIR/validation.json   # re-predict only

1. Calibration (not part of the validation): the compute time of a step
   right before and right after each run (their mean), on its job file
   (``isthmus.deploy.bench.calibrate.calibrate``, as ``isthmus sim --calibrate``: a
   short run synchronising as the job does, with the emulator, launcher and
   broker running as in the runs; this machine's speed drifts too much over
   minutes for one calibration at the start), with how much it varies from
   step to step; and the host work of one exchange, (a + b (S - 1)) x
   processes per core for S sites (a: DiLoCo's outer step; b: per peer), from
   DiLoCo runs of 2 and of 4 sites on a 1 ms, 1 Gbit/s link (their measured
   syncing time per round minus the model's wire time and its wait for the
   last site).
2. Validation, in sets kept apart (``perf_model_cases.py``). The fit set
   (``FIT``: 2-4 one-rank sites, uniform links, sync, DiLoCo and Streaming
   DiLoCo) is what the model's choices were made on; three diagnosis sets
   (``DIAGNOSED``, ``SECOND_DIAGNOSIS``, ``THIRD_DIAGNOSIS``) were held out
   once and found faults, so they are no longer. The held-out set
   (``HELD_OUT``) was chosen after every change and is never used to fit
   anything: sites of 2 ranks beside sites of 1 and two sites of 2 ranks,
   uneven links, link jitter, every strategy (async too), 30-300 steps. Each
   run's measured time per inner step and compute utilisation against what
   ``isthmus sim`` predicts for its job file
   (``isthmus.deploy.cli.sim.job_scenario``: the same path); the error of
   each. Target: within 10% on every run. The runs evaluate only at
   the end (``eval_every: 0``): the model has no evaluation, and one in the
   middle of a run stops the training thread while a Streaming fragment's
   exchange goes on uncounted.

Prints the table; with ``--write-docs`` rewrites the table in
docs/performance-model.md between its markers. Every run's calibrations and
measurements are kept in the JSON, so ``--replay`` predicts them again with
the current model without running anything.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from isthmus.deploy.bench.calibrate import (
    calibrate,
    model_share,
    second_slowest,
    steady_calibration,
    steps_between_syncs,
)
from isthmus.deploy.cli.sim_scenario import job_scenario
from isthmus.deploy.launch.summary import training_figures
from isthmus.sim.perf_model import Scenario, exchange_seconds, predict_run
from isthmus.training.records import read_records

# The runs live beside this script (run as a script, or loaded by path in the tests).
sys.path.insert(0, str(Path(__file__).resolve().parent))
from perf_model_cases import CALIBRATIONS, SETS, Case

BATCH = 8
FRAGMENTS = 2
"""Streaming's fragments: the job files leave them at the default."""
MARKERS = ("<!-- validation:start -->", "<!-- validation:end -->")


def job_text(case: Case) -> str:
    names = [f"s{i}" for i in range(case.sites)]
    sites = ", ".join(
        f"{{name: {n}, ranks: {r}}}" for n, r in zip(names, case.site_ranks, strict=True)
    )
    links = "".join(
        f", {{between: [s{a}, s{b}], bandwidth_mbit: {mbit}, rtt_ms: {rtt}"
        + (f", jitter_ms: {jitter}" if jitter else "")
        + "}"
        for a, b, mbit, rtt, jitter in case.links
    )
    return (
        "name: validation\n"
        f"sites: [{sites}]\n"
        f"wan: {{default: {{rtt_ms: {case.rtt_ms}, bandwidth_mbit: {case.bandwidth_mbit}}}"
        + (f", links: [{links[2:]}]" if links else "")
        + "}\n"
        # Float32 exchanges, as every run here was measured (the DiLoCo family's default
        # became int2+zstd since): the model costs codecs as host work, from their own
        # benchmark (isthmus bench codec).
        f"train: {{strategy: {case.strategy}, steps: {case.steps}, "
        f"sync_every: {case.sync_every}, batch_size: {BATCH}, eval_every: 0, codec: none}}\n"
    )


def run(case: Case, folder: Path) -> dict[str, float]:
    """Run the case; its measured step time, utilisation and syncing time per round."""
    folder.mkdir(parents=True, exist_ok=True)
    job = folder / "job.yaml"
    job.write_text(job_text(case))
    out = folder / "run"
    done = subprocess.run(
        [sys.executable, "-m", "isthmus", "run", str(job), "--out", str(out), "--no-report"],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=folder,  # isthmus run writes JOB.control.json where it starts
    )
    if done.returncode:
        raise RuntimeError(f"{case.name}: run failed: {done.stderr[-2000:]}")
    summary = json.loads((out / "summary.json").read_text())
    records = read_records(out / "metrics.jsonl")
    steady = steady_calibration(
        out / "metrics.jsonl", every=between_syncs(case), model_share=share(case)
    )
    figures = training_figures(out, summary)
    steps = [f["step_s"] for f in figures.values()]
    utilisation = [f["utilization"] for f in figures.values()]
    compute = {name: f["step_s"] * f["utilization"] for name, f in figures.items()}
    syncing = []
    for name in summary["sites"]:
        spans = [
            r["seconds"]
            for r in records
            if r["site"] == name and r["kind"] == "blocked" and r["what"] == "syncing"
        ]
        if spans:
            syncing.append(statistics.median(spans))
    return {
        "step_s": statistics.fmean(steps),
        "utilization": statistics.fmean(utilisation),
        "syncing_s": statistics.fmean(syncing) if syncing else 0.0,
        "compute_s_by_site": compute,
        "jitter_s": steady.jitter_s,
        "outside_s_by_site": steady.outside_s_by_site,
    }


def between_syncs(case: Case) -> int:
    return steps_between_syncs(
        {"strategy": case.strategy, "sync_every": case.sync_every, "fragments": FRAGMENTS}
    )


def share(case: Case) -> float:
    return model_share({"strategy": case.strategy, "fragments": FRAGMENTS})


def contention(sites: int) -> float:
    """One process per site on this machine's cores (the calibration runs: one rank each)."""
    return max(1.0, sites / (os.cpu_count() or 1))


@functools.cache
def job_file_scenario(case: Case) -> Scenario:
    """What ``isthmus sim JOB`` reads from the case's job file, made once per case;
    the compute per step is set by :func:`scenario`."""
    with tempfile.TemporaryDirectory() as folder:
        job = Path(folder) / "validation.yaml"
        job.write_text(job_text(case))
        return job_scenario(job, 1.0)


def scenario(
    case: Case,
    step_s: float,
    outer_s: float,
    peer_s: float = 0.0,
    slowest_s: float | None = None,
    jitter_s: float = 0.0,
    runner_up_s: float | None = None,
) -> Scenario:
    """What ``isthmus sim JOB --step-ms --step-jitter-ms`` predicts from for the case's
    job file, with the fitted host work, the slowest site's pace and the second
    slowest site's."""
    apart = slowest_s is not None and slowest_s > step_s
    return dataclasses.replace(
        job_file_scenario(case),
        step_s=step_s,
        step_jitter_s=jitter_s,
        slowest_step_s=slowest_s if apart else None,
        runner_up_step_s=runner_up_s if apart else None,
        outer_step_s=outer_s,
        peer_overhead_s=peer_s,
    )


def fit_host_work(root: Path) -> dict[str, float]:
    """Host work of a DiLoCo exchange, (a + b (S - 1)) x processes per core: the outer
    step a and b per peer, from DiLoCo on a fast link with 2 and with 4 sites (the
    syncing time per round beyond the model's wire time and its wait for the last
    site, from the variation of the run's own steps)."""
    beyond = {}
    for case in CALIBRATIONS:
        measured = run(case, root / f"calibration-{case.sites}")
        fit = scenario(case, 0.1, 0.0, jitter_s=measured["jitter_s"])
        wire_only, _ = exchange_seconds(fit, 4 * 471_000)
        late = fit.late_s(between_syncs(case))
        left = measured["syncing_s"] - wire_only - late
        beyond[case.sites] = max(0.0, left) / contention(case.sites)
        print(
            f"calibration: {case.name}: syncing {measured['syncing_s'] * 1e3:.0f} ms per "
            f"round, wire {wire_only * 1e3:.0f} ms, last site {late * 1e3:.0f} ms -> "
            f"{beyond[case.sites] * 1e3:.0f} ms beyond",
            flush=True,
        )
    peer = max(0.0, (beyond[4] - beyond[2]) / 2)
    overhead = max(0.0, beyond[2] - peer)
    print(
        f"calibration: outer step {overhead * 1e3:.0f} ms + {peer * 1e3:.0f} ms per peer, "
        "times processes per core",
        flush=True,
    )
    return {"outer_step_ms": overhead * 1e3, "peer_overhead_ms": peer * 1e3}


def measure(case: Case, folder: Path) -> dict:
    """The case's run between two calibrations on its own job file. This machine's
    speed drifts (the same 2-site step measured 83 and 130 ms twenty minutes apart),
    so each case's step is calibrated right before and right after it, as ``isthmus
    sim --calibrate`` would, and the mean used: a drift during the run is bracketed
    instead of carried in whole."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "calibrate.yaml").write_text(job_text(case))
    before = calibrate(folder / "calibrate.yaml", keep=folder / "calibration-before")
    measured = run(case, folder)
    after = calibrate(folder / "calibrate.yaml", keep=folder / "calibration-after")
    return {
        "before": {
            "by_site": before.step_s_by_site,
            "jitter_s": before.jitter_s,
            "outside_s_by_site": before.outside_s_by_site,
        },
        "after": {
            "by_site": after.step_s_by_site,
            "jitter_s": after.jitter_s,
            "outside_s_by_site": after.outside_s_by_site,
        },
        "measured": measured,
    }


def predict(case: Case, raw: dict, host: dict[str, float]) -> dict:
    """The row of one case: its calibration, measurement and the model's prediction."""
    before, after, measured = raw["before"], raw["after"], raw["measured"]
    before_s = statistics.median(before["by_site"].values())
    after_s = statistics.median(after["by_site"].values())
    step_s = (before_s + after_s) / 2
    jitter_s = (before["jitter_s"] + after["jitter_s"]) / 2
    by_site = {
        site: (t + after["by_site"].get(site, t)) / 2 for site, t in before["by_site"].items()
    }
    slowest_s = max(step_s, *by_site.values())
    runner_up_s = second_slowest(by_site.values())
    outer_s, peer_s = host["outer_step_ms"] / 1e3, host["peer_overhead_ms"] / 1e3
    predicted = predict_run(
        scenario(case, step_s, outer_s, peer_s, slowest_s, jitter_s, runner_up_s)
    )
    uniform = predict_run(scenario(case, step_s, outer_s, peer_s))
    steady = predict_run(scenario(case, step_s, outer_s, peer_s, slowest_s, 0.0, runner_up_s))
    endless = predict_run(
        dataclasses.replace(
            scenario(case, step_s, outer_s, peer_s, slowest_s, jitter_s, runner_up_s),
            steps=None,
        )
    )
    # The same model fed with the run's own compute per site and its variation: what
    # is left is the model's error alone, not this machine's drift between the
    # calibrations and the run (docs/performance-model.md, "Validation").
    own = measured["compute_s_by_site"]
    own_step_s = statistics.median(own.values())
    own_scenario = scenario(
        case,
        own_step_s,
        outer_s,
        peer_s,
        max(own.values()),
        measured["jitter_s"],
        second_slowest(own.values()),
    )
    from_run = predict_run(own_scenario)
    return {
        "case": case.name,
        "multi_rank": any(r > 1 for r in case.site_ranks),
        "run_compute_step_ms": own_step_s * 1e3,
        "run_outside_ms_per_exchange": {
            site: v * 1e3 for site, v in sorted(measured.get("outside_s_by_site", {}).items())
        },
        "predicted_step_ms_from_run_compute": from_run.step_s * 1e3,
        "step_error_from_run_compute": from_run.step_s / measured["step_s"] - 1,
        "predicted_utilization_from_run_compute": from_run.utilization,
        "utilization_error_from_run_compute": from_run.utilization / measured["utilization"] - 1,
        "strategy": case.strategy,
        "steps": case.steps,
        "calibrated_step_ms": step_s * 1e3,
        "calibrated_before_ms": before_s * 1e3,
        "calibrated_after_ms": after_s * 1e3,
        "calibrated_by_site_ms": {site: t * 1e3 for site, t in sorted(by_site.items())},
        "calibrated_slowest_ms": slowest_s * 1e3,
        "calibrated_jitter_ms": jitter_s * 1e3,
        "measured_jitter_ms": measured["jitter_s"] * 1e3,
        "predicted_step_ms_all_sites_alike": uniform.step_s * 1e3,
        "predicted_utilization_all_sites_alike": uniform.utilization,
        "predicted_step_ms_without_jitter": steady.step_s * 1e3,
        "predicted_step_ms_steady_state": endless.step_s * 1e3,
        "predicted_utilization_steady_state": endless.utilization,
        "predicted_utilization_without_jitter": steady.utilization,
        "measured_compute_by_site_ms": {
            site: v * 1e3 for site, v in sorted(measured["compute_s_by_site"].items())
        },
        "measured_step_ms": measured["step_s"] * 1e3,
        "predicted_step_ms": predicted.step_s * 1e3,
        "step_error": predicted.step_s / measured["step_s"] - 1,
        "measured_utilization": measured["utilization"],
        "predicted_utilization": predicted.utilization,
        "utilization_error": predicted.utilization / measured["utilization"] - 1,
    }


def print_row(row: dict) -> None:
    print(
        f"{row['case']:80s} calibrated {row['calibrated_before_ms']:.1f} ms before, "
        f"{row['calibrated_after_ms']:.1f} ms after; step {row['measured_step_ms']:7.1f} ms "
        f"measured, {row['predicted_step_ms']:7.1f} predicted ({row['step_error']:+.1%}); "
        f"utilisation {row['measured_utilization']:.1%} vs "
        f"{row['predicted_utilization']:.1%} ({row['utilization_error']:+.1%}); from the run's "
        f"own compute ({row['run_compute_step_ms']:.1f} ms): step "
        f"{row['step_error_from_run_compute']:+.1%}, utilisation "
        f"{row['utilization_error_from_run_compute']:+.1%}",
        flush=True,
    )


def summarise(result: dict) -> None:
    for name in [*SETS, "async-recheck"]:
        rows = [r for r in result["rows"] if r.get("set") == name]
        if not rows:
            continue
        multi = sum(r["multi_rank"] for r in rows)
        for label, suffix in (("calibrated", ""), ("the run's own compute", "_from_run_compute")):
            errors = [(r[f"step_error{suffix}"], r[f"utilization_error{suffix}"]) for r in rows]
            worst = max(max(abs(a), abs(b)) for a, b in errors)
            within = sum(abs(a) <= 0.10 and abs(b) <= 0.10 for a, b in errors)
            print(
                f"{name}, from {label}: {within} of {len(rows)} runs within 10% "
                f"({multi} with a multi-rank site); largest error {worst:.1%}"
            )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--set",
        choices=[*SETS, "both"],
        default="both",
        help="which runs: fit, diagnosis, diagnosis-2, diagnosis-3, held-out, or both "
        "(fit and held-out; default)",
    )
    parser.add_argument(
        "--strategy",
        help="only the runs of this strategy (e.g. to check a change to its calibration)",
    )
    parser.add_argument("--out", type=Path, help="keep the runs here (default: a temp dir)")
    parser.add_argument(
        "--replay", type=Path, help="a validation.json: predict its runs again, run nothing"
    )
    parser.add_argument("--write-docs", action="store_true")
    args = parser.parse_args()
    if args.replay:
        result = json.loads(args.replay.read_text())
        cases = {c.name: c for cases in SETS.values() for c in cases}
        for row in result["rows"]:
            if "raw" in row and row["case"] in cases:
                kept = {k: row[k] for k in ("set", "raw")}
                row.clear()
                row.update(
                    kept | predict(cases[kept["raw"]["case"]], kept["raw"], result["calibration"])
                )
                print_row(row)
        summarise(result)
        args.replay.write_text(json.dumps(result, indent=2))
        if args.write_docs:
            write_docs(result)
        return 0
    # Absolute: the calibration runs start in their own folder.
    root = (args.out or Path(tempfile.mkdtemp(prefix="isthmus-validation-"))).resolve()
    root.mkdir(parents=True, exist_ok=True)
    result: dict = {"calibration": fit_host_work(root), "rows": []}
    chosen = ["fit", "held-out"] if args.set == "both" else [args.set]
    for name in chosen:
        for index, case in enumerate(SETS[name]):
            if args.strategy and case.strategy != args.strategy:
                continue
            raw = measure(case, root / f"{name}-{index}") | {"case": case.name}
            row = {"set": name, "raw": raw} | predict(case, raw, result["calibration"])
            result["rows"].append(row)
            (root / "validation.json").write_text(json.dumps(result, indent=2))
            print_row(row)
    summarise(result)
    print(f"runs and JSON in {root}")
    if args.write_docs:
        write_docs(result)
    return 0


def write_docs(result: dict) -> None:
    doc = Path(__file__).resolve().parent.parent / "docs" / "performance-model.md"
    cal = result["calibration"]
    lines = [
        MARKERS[0],
        "",
        "Column 'calibrated': the median site's compute per step, the mean of a "
        "calibration just before and one just after the run (both in brackets), each "
        "synchronising as the run does. 'From its own compute': the same model fed with "
        "the compute per step each site measured in the run itself, which leaves out "
        "this machine's drift between calibration and run. Host work per exchange: "
        f"outer step {cal['outer_step_ms']:.0f} ms + {cal['peer_overhead_ms']:.0f} ms per "
        "peer site, times processes per core (fitted on the fit runs' calibrations).",
    ]
    titles = {
        "fit": "Fit set (the model's choices were made on it)",
        "diagnosis": "Diagnosis set (the first held-out set; it found what was fixed)",
        "diagnosis-2": "Second diagnosis set (the second held-out set; it found the "
        "calibration's duty cycle and the fabric constant)",
        "diagnosis-3": "Third diagnosis set (the third held-out set; with gather it found "
        "the slowest site's wire hidden by the others' lead)",
        "held-out": "Held-out set (never used to change anything)",
        "async-recheck": "The async runs of both sets again, after the async calibration "
        "changed because of them (so no longer held out)",
    }
    for name, title in titles.items():
        rows = [r for r in result["rows"] if r.get("set") == name]
        if not rows:
            continue
        within = sum(
            abs(r["step_error"]) <= 0.10 and abs(r["utilization_error"]) <= 0.10 for r in rows
        )
        own = sum(
            abs(r["step_error_from_run_compute"]) <= 0.10
            and abs(r["utilization_error_from_run_compute"]) <= 0.10
            for r in rows
        )
        lines += [
            "",
            f"**{title}**: {len(rows)} runs, {sum(r['multi_rank'] for r in rows)} with a "
            f"multi-rank site; within 10% on both figures: {within} from the calibration, "
            f"{own} from their own compute.",
            "",
            "| run | calibrated | step measured | predicted | error | utilisation measured "
            "| predicted | error | from its own compute: step, utilisation |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        for r in rows:
            lines.append(
                f"| {r['case']} | {r['calibrated_step_ms']:.1f} ms "
                f"({r['calibrated_before_ms']:.0f}, {r['calibrated_after_ms']:.0f}) | "
                f"{r['measured_step_ms']:.1f} ms | {r['predicted_step_ms']:.1f} ms | "
                f"{r['step_error']:+.1%} | {r['measured_utilization']:.1%} | "
                f"{r['predicted_utilization']:.1%} | {r['utilization_error']:+.1%} | "
                f"{r['step_error_from_run_compute']:+.1%}, "
                f"{r['utilization_error_from_run_compute']:+.1%} |"
            )
    lines += ["", MARKERS[1]]
    text = doc.read_text()
    start, end = text.index(MARKERS[0]), text.index(MARKERS[1]) + len(MARKERS[1])
    doc.write_text(text[:start] + "\n".join(lines) + text[end:])
    (doc.parent / "performance-model-validation.json").write_text(
        json.dumps(result, indent=2) + "\n"
    )


if __name__ == "__main__":
    raise SystemExit(main())
