"""The calibration's run settings and what it reads from a run's records."""

from __future__ import annotations

import json
import math
import statistics

import pytest

from isthmus.deploy.bench.calibrate import (
    MIN_STEPS,
    ROUND_CAP,
    WARM_UP_STEPS,
    calibration_steps,
    calibration_train,
    steady_calibration,
    steps_between_syncs,
)
from isthmus.training.records import RecordWriter


def test_the_calibration_synchronises_as_the_job_does():
    # Sync: every step, its buckets beside the backward pass.
    sync = calibration_train({"strategy": "sync", "codec": "int8", "steps": 50, "lr": 0.01})
    assert sync["strategy"] == "sync" and sync["lr"] == 0.01
    # The codec is host work in the model, not compute: never in the calibration,
    # nor the sparse codec's settings (refused without their codec).
    assert sync["codec"] == "none"
    sparse = calibration_train(
        {"strategy": "diloco", "codec": "topk", "compressor": {"density": 0.02}}
    )
    assert sparse["codec"] == "none" and "compressor" not in sparse
    # Every other strategy as itself, at its own interval: the sites' duty cycle (how
    # much of a round they wait) sets how many compute at once on shared cores.
    for strategy in ("diloco", "async", "streaming"):
        same = calibration_train(
            {"strategy": strategy, "sync_every": 25, "fragments": 5, "overlap_steps": 2}
        )
        assert same["strategy"] == strategy and same["sync_every"] == 25
        assert same["fragments"] == 5 and same["overlap_steps"] == 2
    # Streaming's sites meet at every fragment: its fragments' interval is capped, and
    # each exchange's overlap stays within it.
    long = calibration_train(
        {"strategy": "streaming", "sync_every": 400, "fragments": 4, "overlap_steps": 80}
    )
    assert long["sync_every"] == 4 * ROUND_CAP and long["overlap_steps"] == ROUND_CAP
    # ... up to ROUND_CAP steps, where sites compute nearly all the time anyway.
    capped = calibration_train({"strategy": "diloco", "sync_every": 500})
    assert capped["sync_every"] == ROUND_CAP
    assert calibration_train({"strategy": "diloco"})["sync_every"] == min(50, ROUND_CAP)
    # A job that leaves them to the defaults: written out, so the steps can be planned.
    default = calibration_train({})
    assert default["strategy"] == "diloco" and default["sync_every"] == 50
    assert calibration_steps(default) == (200, 50)


@pytest.mark.parametrize(
    ("train", "steps", "warm_up"),
    [
        # Sync: the first WARM_UP_STEPS left out, MIN_STEPS in all.
        ({"strategy": "sync"}, MIN_STEPS, WARM_UP_STEPS),
        ({"strategy": "diloco", "sync_every": 5}, MIN_STEPS, WARM_UP_STEPS),
        # A whole first round left out, then three rounds.
        ({"strategy": "diloco", "sync_every": 40}, 160, 40),
        ({"strategy": "async", "sync_every": 25}, 100, 25),
        # Streaming synchronises a fragment every sync_every / fragments steps.
        ({"strategy": "streaming", "sync_every": 30, "fragments": 2}, 60, 15),
    ],
)
def test_the_calibration_leaves_out_its_first_round_and_measures_three(train, steps, warm_up):
    assert calibration_steps(train) == (steps, warm_up)
    every = steps_between_syncs(train)
    # Whole rounds measured: the warm-up ends at a synchronisation.
    assert (steps - warm_up) // every >= 3 and warm_up % every == 0


def write_steps(metrics, steps: dict[str, list[float]]) -> None:
    """Step records as a run writes them: cumulative compute seconds per step."""
    for site, each in steps.items():
        writer = RecordWriter(metrics, site)
        total = 0.0
        for number, seconds in enumerate(each, 1):
            total += seconds
            writer.write("step", step=number, compute_s=total, loss=1.0)
            writer.write("blocked", what="syncing", seconds=0.3)  # not compute: ignored
        writer.close()


def test_each_sites_step_and_how_late_the_last_one_arrives(tmp_path):
    """Two sites synchronising every 2 steps, the first 2 left out. Site a's windows
    run 0.04 s over, 0.04 s under and level with its mean pace (0.1 s per step),
    site b's level with its own (0.2 s): the last site is 0.02, 0.02 and 0 s past
    the average one, 0.04 / 3 s on average, which independent steps would give
    with sigma = (0.04 / 3) / (sqrt 2 e(2)), e(2) = 1 / sqrt(pi)."""
    metrics = tmp_path / "metrics.jsonl"
    write_steps(
        metrics,
        {
            "a": [0.5, 0.5, 0.10, 0.14, 0.10, 0.06, 0.12, 0.08],
            "b": [0.9, 0.9, 0.2, 0.2, 0.2, 0.2, 0.2, 0.2],
        },
    )
    calibration = steady_calibration(metrics, every=2, warm_up=2)
    assert calibration.step_s_by_site == pytest.approx({"a": 0.1, "b": 0.2})
    assert calibration.slowest_step_s == pytest.approx(0.2)
    assert calibration.step_s == pytest.approx(0.15)
    sigma = (0.04 / 3) / (math.sqrt(2) / math.sqrt(math.pi))
    assert calibration.jitter_s == pytest.approx(sigma)


def test_time_neither_compute_nor_blocked_is_measured_per_exchange(tmp_path):
    """Each step record is written 0.1 s of compute plus 0.3 s blocked plus what a
    site spends beside both (a: 0.05 s per step, b: none) after the last one."""
    metrics = tmp_path / "metrics.jsonl"
    for site, extra in (("a", 0.05), ("b", 0.0)):
        lines = []
        t = 1000.0
        for number in range(1, 9):
            started = t
            t += 0.1 + 0.3 + extra
            lines.append(
                {
                    "t": started + 0.1,
                    "site": site,
                    "kind": "blocked",
                    "what": "syncing",
                    "started": started + 0.1,
                    "seconds": 0.3,
                }
            )
            lines.append(
                {
                    "t": t,
                    "site": site,
                    "kind": "step",
                    "step": number,
                    "compute_s": 0.1 * number,
                    "loss": 1.0,
                }
            )
        with metrics.open("a") as out:
            out.writelines(json.dumps(line) + "\n" for line in lines)
    calibration = steady_calibration(metrics, every=2, warm_up=2)
    # 6 steps after the warm-up, 3 synchronisations: 0.3 s beside compute, 0.1 each.
    assert calibration.outside_s_by_site == pytest.approx({"a": 0.1, "b": 0.0}, abs=1e-9)
    assert calibration.in_site_s == pytest.approx(0.1)
    # A Streaming synchronisation exchanges one fragment: per whole model, times P.
    halves = steady_calibration(metrics, every=2, warm_up=2, model_share=0.5)
    assert halves.outside_s_by_site["a"] == pytest.approx(0.2)


def test_steps_slowed_at_every_site_alike_keep_no_one_waiting(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    alike = [0.5, 0.1, 0.3, 0.1, 0.1, 0.25, 0.1, 0.1, 0.4, 0.1, 0.1]
    write_steps(metrics, {"a": alike, "b": alike, "c": alike})
    calibration = steady_calibration(metrics, every=1, warm_up=1)
    assert calibration.jitter_s == pytest.approx(0.0, abs=1e-12)
    assert calibration.step_s == pytest.approx(statistics.fmean(alike[1:]))


def test_windows_start_at_a_synchronisation(tmp_path):
    """Rounds every 3 steps, 4 left out: the windows are (6, 9] and (9, 12], not
    (4, 7] and (7, 10]. Site a took 0.25 s in steps 5 and 6, before the first
    window, so its mean pace (0.1375 s) puts it 0.1125 s ahead in both windows, and
    the last site (b, level with its pace) 0.05625 s past the average one."""
    metrics = tmp_path / "metrics.jsonl"
    write_steps(metrics, {"a": [0.1] * 4 + [0.25, 0.25] + [0.1] * 6, "b": [0.1] * 12})
    calibration = steady_calibration(metrics, every=3, warm_up=4)
    assert calibration.step_s_by_site["a"] == pytest.approx(0.1375)
    sigma = 0.05625 / (math.sqrt(3) / math.sqrt(math.pi))
    assert calibration.jitter_s == pytest.approx(sigma)


def test_the_steps_between_synchronisations():
    assert steps_between_syncs(calibration_train({"strategy": "sync"})) == 1
    assert steps_between_syncs({"strategy": "streaming", "sync_every": 20, "fragments": 4}) == 5
    assert steps_between_syncs(calibration_train({"strategy": "async", "sync_every": 30})) == 30


def test_windows_with_a_missing_step_record_are_left_out(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    write_steps(metrics, {"a": [0.1] * 8, "b": [0.1] * 8})
    kept = [line for line in metrics.read_text().splitlines() if '"step": 6,' not in line]
    metrics.write_text("\n".join(kept) + "\n")
    calibration = steady_calibration(metrics, every=2, warm_up=2)
    assert calibration.step_s == pytest.approx(0.1)
    assert calibration.jitter_s == pytest.approx(0.0, abs=1e-12)


def test_a_run_with_too_few_steps_is_refused(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    writer = RecordWriter(metrics, "a")
    writer.write("step", step=1, compute_s=0.1, loss=1.0)
    writer.close()
    with pytest.raises(RuntimeError, match="too few steps"):
        steady_calibration(metrics, every=1)
