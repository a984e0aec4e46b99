"""``isthmus run --compare``'s time to sync's loss, from records as the sites write
them (the whole command runs in test_run.py::test_compare_writes_one_table_for_every_strategy)."""

from __future__ import annotations

import json

import pytest

from isthmus.deploy.launch.compare import (
    comparison_rows,
    held_out_curve,
    seconds_to_loss,
    write_comparison,
)

STARTED = 1_000.0


def _evals(site_losses: dict[str, list[tuple[float, float]]]) -> list[dict]:
    records = []
    for site, points in site_losses.items():
        for step, (t, loss) in enumerate(points, 1):
            records.append(
                {"t": STARTED + t, "site": site, "kind": "eval", "step": step, "tokens": step,
                 "eval_loss": loss, "seconds": 0.1}
            )  # fmt: skip
            records.append({"t": STARTED + t, "site": site, "kind": "step", "step": step})
    return records


def _summary(strategy: str, wan_bytes: int) -> dict:
    return {
        "job": "small",
        "strategy": strategy,
        "status": "finished",
        "started": STARTED,
        "wall_seconds": 100.0,
        "compute_utilization": 0.9,
        "wan_bytes": wan_bytes,
        "settings": {"strategy": strategy, "steps": 8},
        "sites": {
            "a": {"eval_loss": 2.0, "param_sha256": "x"},
            "b": {"eval_loss": 2.0, "param_sha256": "x"},
        },
    }


def test_the_curve_is_the_first_sites_evaluations_in_time_since_the_start():
    records = _evals({"a": [(5.0, 3.0), (9.0, 2.5)], "b": [(4.0, 9.9)]})
    assert held_out_curve(records, STARTED) == [(5.0, 3.0), (9.0, 2.5)]
    assert seconds_to_loss([(5.0, 3.0), (9.0, 2.5)], 2.6) == 9.0
    assert seconds_to_loss([(5.0, 3.0)], 2.0) is None


def test_each_strategy_is_timed_to_the_best_loss_sync_reached():
    summaries = {s: _summary(s, b) for s, b in (("sync", 10**9), ("diloco", 10**7), ("async", 1))}
    curves = {
        "sync": [(10.0, 3.0), (40.0, 2.2), (60.0, 2.3)],  # best 2.2, reached at 40 s
        "diloco": [(8.0, 2.9), (20.0, 2.15)],  # there at 20 s: half sync's time
        "async": [(30.0, 2.5)],  # never
    }
    rows = {r["strategy"]: r for r in comparison_rows(summaries, curves)}
    assert rows["sync"]["sync_best_loss"] == 2.2
    assert rows["sync"]["seconds_to_sync_loss"] == 40.0
    assert rows["sync"]["time_to_sync_loss_vs_sync"] == 1.0
    assert rows["diloco"]["seconds_to_sync_loss"] == 20.0
    assert rows["diloco"]["time_to_sync_loss_vs_sync"] == pytest.approx(0.5)
    assert rows["async"]["seconds_to_sync_loss"] is None
    assert rows["async"]["time_to_sync_loss_vs_sync"] is None
    # Without sync there is nothing to time against: the rows say nothing of it.
    alone = comparison_rows({"diloco": summaries["diloco"]}, {"diloco": curves["diloco"]})
    assert "seconds_to_sync_loss" not in alone[0]


def test_the_report_tables_the_times_and_plots_loss_against_wall_time(tmp_path):
    losses = {"sync": [(10.0, 3.0), (40.0, 2.2)], "diloco": [(12.0, 2.8), (25.0, 2.1)]}
    summaries = {}
    for strategy, points in losses.items():
        (tmp_path / strategy).mkdir()
        records = _evals({"a": points, "b": points})
        (tmp_path / strategy / "metrics.jsonl").write_text(
            "".join(json.dumps(r) + "\n" for r in records)
        )
        summaries[strategy] = _summary(strategy, 10**6)
    report = write_comparison(tmp_path, summaries).read_text()
    assert "| s to sync's best loss |" in report
    assert "| diloco | 2.000 | 1.0 MB | 90% | 100 | 25 (0.62x sync) | finished |" in report
    assert "lowest held-out loss sync reached (2.200)" in report
    rows = json.loads((tmp_path / "compare.json").read_text())
    assert [r["seconds_to_sync_loss"] for r in rows] == [40.0, 25.0]
    assert (tmp_path / "compare.png").stat().st_size > 10_000

    # --no-report: the same table, no plot, and no word of reports that were not written.
    (tmp_path / "compare.png").unlink()
    bare = write_comparison(tmp_path, summaries, plot=False).read_text()
    assert "| diloco | 2.000 | 1.0 MB | 90% | 100 | 25 (0.62x sync) | finished |" in bare
    assert not (tmp_path / "compare.png").exists()
    assert "compare.png" not in bare and "STRATEGY/report.md" not in bare
    assert "isthmus report OUT/STRATEGY" in bare


def test_the_report_states_the_settings_that_differ_by_strategy(tmp_path):
    """A job file that leaves the codec unset gives sync float32 and the DiLoCo
    family int2+zstd: the report must not state the first run's codec for all."""
    summaries = {}
    for strategy, codec in (("sync", "none"), ("diloco", "int2+zstd")):
        (tmp_path / strategy).mkdir()
        (tmp_path / strategy / "metrics.jsonl").write_text("")
        summaries[strategy] = _summary(strategy, 10**6)
        summaries[strategy]["settings"]["codec"] = codec
    report = write_comparison(tmp_path, summaries, plot=False).read_text()
    assert "Settings: steps=8\n" in report
    assert "Where they differ: sync codec=none; diloco codec=int2+zstd" in report
