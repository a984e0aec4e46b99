"""Your own script in every command: ``isthmus sim JOB --calibrate -- CMD`` and
``isthmus tune JOB -- CMD`` calibrate on the script (its step time, its parameter
count as the strategy synchronised it) and name what they calibrated."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parent / "workers" / "script_train.py"
MLP_PARAMETERS = 8 * 32 + 32 + 32 + 1

JOB = """\
name: scripted
sites:
  - {name: a, ranks: 1}
  - {name: b, ranks: 1}
wan:
  default: {rtt_ms: 10, bandwidth_mbit: 200}
train: {strategy: diloco, steps: 40, sync_every: 10}
"""


def _isthmus(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "isthmus", *args],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
    )


@pytest.fixture
def job(tmp_path: Path) -> Path:
    path = tmp_path / "job.yaml"
    path.write_text(JOB)
    return path


def test_a_command_after_sim_needs_calibrate(tmp_path, job):
    done = _isthmus(tmp_path, "sim", str(job), "--step-ms", "5", "--", sys.executable, "x.py")
    assert done.returncode == 2
    assert "a command after -- is what --calibrate measures" in done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.slow
def test_sim_calibrates_on_the_script_and_names_it(tmp_path, job):
    done = _isthmus(
        tmp_path, "sim", str(job), "--calibrate", "--json", "--", sys.executable, str(SCRIPT)
    )
    assert done.returncode == 0, done.stderr[-3000:]
    scenario = json.loads(done.stdout)["scenario"]
    assert scenario["params"] == MLP_PARAMETERS  # the script's model, not the built-in GPT's
    assert scenario["model"].startswith(f"calibrated on the script `{sys.executable}")
    assert f"{MLP_PARAMETERS:,} parameters" in scenario["model"]
    assert scenario["tokens_per_step"] == 2 * 16  # two sites, 16 samples a step each
    assert "calibrating: a short run of the script" in done.stderr


@pytest.mark.slow
def test_tune_calibrates_on_the_script_and_a_script_that_fails_is_one_line(tmp_path, job):
    done = _isthmus(
        tmp_path, "tune", str(job), "--budget-minutes", "0", "--json", "--out",
        str(tmp_path / "tuned"), "--", sys.executable, str(SCRIPT),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout)
    assert result["command"] == [sys.executable, str(SCRIPT)]
    assert "the script" in result["step_source"] and f"{MLP_PARAMETERS:,}" in result["calibrated"]
    assert 0 < result["step_s"] < 1
    failing = [sys.executable, "-c", "raise SystemExit(3)"]
    done = _isthmus(tmp_path, "tune", str(job), "--budget-minutes", "0", "--", *failing)
    assert done.returncode == 2
    (line,) = done.stderr.strip().splitlines()[-1:]
    assert line.startswith("isthmus tune: error: calibration failed: the calibration run failed")
    assert "exit status 3" in line, done.stderr
    log = re.search(r"\(log: (\S+)\)", line)
    assert log and Path(log.group(1)).is_file(), line  # the failed calibration's run stays
    assert "Traceback" not in done.stderr
