"""What a run records is what ran: a script's run states only the settings Isthmus
applied and names the script's own model, optimizer and data; it saves the
script's final model; live changes are part of the description; a script that
logs no usable loss or tokens is warned once and recorded as null; every JSON
file a run writes parses strictly."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from isthmus.deploy.launch.report import _markdown
from isthmus.job.settings import (
    BUILTIN_LOOP_SETTINGS,
    STRATEGIES,
    TrainSettings,
    applied_keys,
    applied_settings,
    strategy_keys,
)
from isthmus.training.site_control import apply_settings

SCRIPT = Path(__file__).parent / "workers" / "script_train.py"

# Every built-in loop setting set away from its default: none may show in a script's
# records (a reader would take them for what trained).
JOB = """\
name: records
sites:
  - {name: a, ranks: 1}
  - {name: b, ranks: 1}
train: {strategy: diloco, steps: STEPS, sync_every: 4, batch_size: 16, inner_optimizer: adamw,
        inner_lr: 0.02, lr_schedule: constant, grad_clip: 0.5, warmup_steps: 2}
"""


def _run(tmp_path: Path, *flags: str, steps: int = 8, env: dict | None = None):
    job = tmp_path / "job.yaml"
    job.write_text(JOB.replace("STEPS", str(steps)))
    out = tmp_path / "run"
    command = [sys.executable, "-m", "isthmus", "run", str(job), "--out", str(out), *flags]
    command += ["--", sys.executable, str(SCRIPT)]
    done = subprocess.run(
        command,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **(env or {})},
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return out


def _strict(path: Path) -> object:
    """JSON as a strict parser reads it: NaN and Infinity refused."""

    def refuse(constant: str) -> None:
        raise ValueError(f"{path}: {constant} is not JSON")

    return json.loads(path.read_text(), parse_constant=refuse)


def _builtin_only(strategy: str) -> set[str]:
    return set(BUILTIN_LOOP_SETTINGS) - set(strategy_keys(strategy))


def test_a_scripts_run_states_only_what_applied():
    for strategy in STRATEGIES:
        builtin = set(applied_keys(strategy))
        script = set(applied_keys(strategy, builtin_loop=False))
        assert not script & _builtin_only(strategy), strategy
        assert set(BUILTIN_LOOP_SETTINGS) <= builtin  # the built-in loop applies them all
        others = {k for s in STRATEGIES if s != strategy for k in strategy_keys(s)}
        mine = {*strategy_keys(strategy), *BUILTIN_LOOP_SETTINGS, "sync_every"}
        assert not (builtin & others) - mine, strategy  # never another strategy's own
    assert "fragments" not in applied_settings(TrainSettings(strategy="diloco"))
    assert "grad_clip" in applied_keys("sync", builtin_loop=False)  # sync clips the average


def test_a_live_change_that_cannot_apply_is_left_out_of_the_record():
    outer = SimpleNamespace(lr=1.0, optimizer=SimpleNamespace(param_groups=[{}]))
    strategy = SimpleNamespace(sync_every=4, codec="int8", outer=outer)
    settings = TrainSettings(strategy="diloco", sync_every=4)
    change = {"sync_every": 2, "inner_lr": 0.1, "outer_lr": 0.5}
    new, applied = apply_settings(change, settings, strategy, "a", builtin_loop=False)
    assert applied == {"sync_every": 2, "outer_lr": 0.5}
    assert (new.sync_every, new.inner_lr, outer.lr) == (2, settings.inner_lr, 0.5)
    _, applied = apply_settings(change, settings, strategy, "a", builtin_loop=True)
    assert applied == change  # the built-in loop's schedule reads inner_lr every step
    no_outer = SimpleNamespace(sync_every=4, codec="int8")
    _, applied = apply_settings({"outer_lr": 0.5}, settings, no_outer, "a", builtin_loop=True)
    assert applied == {}


def test_the_report_lists_live_changes_and_what_trained():
    site = {
        "status": "finished", "final_loss": 1.0, "eval_loss": None, "tokens": 10,
        "inner_steps": 8, "outer_steps": 2, "compute_seconds": 1.0, "wall_seconds": 2.0,
        "eval_seconds": 0.0, "param_sha256": "ab" * 32,
        "ran": {"model": "mlp", "optimizer": {"name": "SGD", "settings": {"lr": 0.05}},
                "parameters": 321, "tokens_counted_from": "site.log"},
    }  # fmt: skip
    summary = {
        "job": "j", "strategy": "diloco", "status": "finished", "wall_seconds": 2.0,
        "compute_utilization": 0.5, "wan_bytes": 0, "wan_bytes_by_link": {},
        "command": ["python", "train.py"], "model": "mlp", "data": "the script's own",
        "settings": {"strategy": "diloco", "sync_every": 4},
        "live_changes": [{"round": 3, "step": 12, "settings": {"sync_every": 2},
                          "sites": ["a", "b"]}],
        "sites": {"a": site, "b": site},
    }  # fmt: skip
    report = _markdown(summary, [])
    assert "from round 3 (step 12): sync_every=2 (a, b)" in report
    assert "The script `python train.py`" in report
    assert "- inner optimizer: SGD (lr=0.05)" in report and "- parameters: 321" in report


@pytest.mark.slow
def test_a_scripts_compare_summaries_reports_and_model_name_what_the_script_ran(tmp_path):
    out = _run(tmp_path, "--compare", "sync,diloco", env={"SCRIPT_SGD": "1"})
    for strategy in ("sync", "diloco"):
        run = out / strategy
        summary = _strict(run / "summary.json")
        assert summary["status"] == "finished"
        assert summary["command"][-1] == str(SCRIPT)
        assert summary["settings"]["strategy"] == strategy
        assert not set(summary["settings"]) & _builtin_only(strategy), summary["settings"]
        assert (summary["model"], summary["data"]) == ("mlp-8-32-1", "sin of sums")
        for site in summary["sites"].values():
            ran = site["ran"]
            assert ran["optimizer"]["name"] == "SGD"
            assert ran["optimizer"]["settings"]["lr"] == 0.05
            assert ran["optimizer"]["settings"]["momentum"] == 0.9
            assert ran["parameters"] == 8 * 32 + 32 + 32 + 1
            assert ran["tokens_counted_from"] == "site.log"
            assert site["tokens"] == 8 * 16  # what the script logged, not batch_size's
        report = (run / "report.md").read_text()
        assert "- inner optimizer: SGD (lr=0.05, momentum=0.9" in report
        for word in ("adamw", "lr_schedule", "batch_size", "warmup_steps", "inner_lr"):
            assert word not in report, word
        for path in run.rglob("*.json"):
            _strict(path)
        # The script's final model, as every site holds it, with the run's file mode.
        from safetensors import safe_open

        weights = run / "model.safetensors"
        with safe_open(str(weights), "pt") as saved:
            assert sorted(saved.keys()) == ["0.bias", "0.weight", "2.bias", "2.weight"]
            assert saved.metadata()["loop"] == "script"
            assert saved.metadata()["param_sha256"] == summary["sites"]["a"]["param_sha256"]
        assert weights.stat().st_mode & 0o777 == (run / "summary.json").stat().st_mode & 0o777
    compare = (out / "compare.md").read_text()
    assert "inner optimizer=SGD (lr=0.05, momentum=0.9" in compare
    for word in ("adamw", "site_adamw", "lr_schedule", "batch_size"):
        assert word not in compare, word
    evaluated = subprocess.run(
        [sys.executable, "-m", "isthmus", "eval", str(out / "diloco")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert evaluated.returncode == 2
    assert "ran a script" in evaluated.stderr and "model.safetensors" in evaluated.stderr
    assert "Traceback" not in evaluated.stderr


@pytest.mark.slow
def test_a_script_that_logs_a_nan_loss_and_no_tokens_is_warned_once_and_finishes(tmp_path):
    out = _run(tmp_path, steps=12, env={"SCRIPT_LOG": "nan"})
    summary = _strict(out / "summary.json")
    assert summary["status"] == "finished"
    for name, site in summary["sites"].items():
        assert site["final_loss"] is None
        assert site["tokens"] == 12 * 16  # train.batch_size a step, as warned
        assert site["ran"]["tokens_counted_from"] == "train.batch_size"
        log = (out / "logs" / f"{name}-r0.log").read_text()
        assert log.count("logged a loss that is not finite") == 1, log
        assert log.count("tokens are counted as train.batch_size (16) a step") == 1, log
    for record in (out / "metrics.jsonl").read_text().splitlines():
        json.loads(record, parse_constant=lambda c: pytest.fail(f"{c} in metrics.jsonl"))
    assert "counted as train.batch_size" in (out / "report.md").read_text()
