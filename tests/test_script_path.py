"""A user's own script under ``isthmus run JOB -- CMD``: joined from the
launcher's environment, one agreed model at the start, models that differ
refused, and a killed script restarted and let back in like the built-in loop."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from site_kill import kill_after_rounds, loss_figures
from test_run import explain

from isthmus.training.environment import LaunchEnvironment, NotLaunched

SCRIPT = Path(__file__).parent / "workers" / "script_train.py"

JOB = """\
name: scripts
sites:
  - {name: a, ranks: 1}
  - {name: b, ranks: 1}
SITE_C
wan:
  default: {rtt_ms: 20, bandwidth_mbit: 200}
FAULTS
train: {strategy: diloco, steps: STEPS, sync_every: 5}
"""


def run_script(tmp_path, *, steps=30, env=None, flags=(), sites=2):
    job = tmp_path / "job.yaml"
    job.write_text(
        JOB.replace("STEPS", str(steps))
        .replace("SITE_C\n", "  - {name: c, ranks: 1}\n" if sites == 3 else "")
        .replace("FAULTS\n", "")
    )
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
    return done, out


def test_join_outside_a_launcher_says_how_to_launch():
    with pytest.raises(NotLaunched, match=r"isthmus run JOB.yaml -- python train.py"):
        LaunchEnvironment.from_environ({})
    env = {k: v for k, v in os.environ.items() if not k.startswith("ISTHMUS_")}
    done = subprocess.run(
        [sys.executable, "-c", "import isthmus; isthmus.join()"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert done.returncode != 0
    assert "ISTHMUS_JOB and ISTHMUS_SITE not set" in done.stderr
    assert "isthmus site JOB.yaml --site NAME -- python train.py" in done.stderr


def test_the_environment_round_trips():
    launch = LaunchEnvironment(
        job=Path("/r/job.yaml"), site="a", run_dir=Path("/r"), rejoin=True, resume_round=None
    )
    assert LaunchEnvironment.from_environ(launch.to_environ()) == launch
    with pytest.raises(NotLaunched, match="ISTHMUS_RESUME_ROUND: must be a round number"):
        LaunchEnvironment.from_environ({**launch.to_environ(), "ISTHMUS_RESUME_ROUND": "x"})


@pytest.mark.slow
def test_sites_that_initialise_differently_start_from_the_first_sites_model(tmp_path):
    done, out = run_script(tmp_path, env={"SCRIPT_SEED_BY_SITE": "1"})
    assert done.returncode == 0, done.stderr + explain(out)
    summary = json.loads((out / "summary.json").read_text())
    sites = summary["sites"]
    assert {s["status"] for s in sites.values()} == {"finished"}
    assert len({s["param_sha256"] for s in sites.values()}) == 1, sites
    assert all(s["inner_steps"] == 30 and s["tokens"] == 30 * 16 for s in sites.values())
    assert summary["command"][-1] == str(SCRIPT)
    log = (out / "logs" / "b-r0.log").read_text()
    assert "the model started from site a's parameters (b had others)" in log
    # The script's losses reach the records, the progress and the report.
    steps = [
        json.loads(line)
        for line in (out / "sites" / "b" / "metrics.jsonl").read_text().splitlines()
        if '"kind": "step"' in line
    ]
    assert len(steps) == 30 and all(s["loss"] > 0 for s in steps)
    assert (out / "report.md").exists()


@pytest.mark.slow
def test_a_model_whose_shapes_differ_between_sites_is_refused_naming_the_parameter(tmp_path):
    done, _out = run_script(tmp_path, env={"SCRIPT_WIDE_SITE": "b"})
    assert done.returncode == 1
    assert "parameter 0 '0.weight' (48, 8) on site 'b' is not the one site 'a' has" in done.stderr
    assert "sites that differ from site 'a' in names or shapes: b" in done.stderr


@pytest.mark.slow
def test_a_killed_script_is_restarted_rejoins_and_every_site_ends_identical(tmp_path):
    job = tmp_path / "job.yaml"
    job.write_text(
        JOB.replace("STEPS", "150")
        .replace("SITE_C\n", "  - {name: c, ranks: 1}\n")
        .replace(
            "FAULTS\n",
            # The survivors' link is slow from c's round 4 until c has done two more
            # rounds, so they cannot finish before c is back, however fast the machine.
            "  faults:\n    - {at_round: 4, rounds_of: c, link: [a, b], action: brownout,"
            " changes: {rtt_ms: 500}, for_rounds: 2}\n",
        )
    )
    out = tmp_path / "run"
    run = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "isthmus",
            "run",
            str(job),
            "--out",
            str(out),
            "--restart-lost",
            "--",
            sys.executable,
            str(SCRIPT),
        ],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "SCRIPT_STEP_SLEEP_S": "0.02"},
    )
    try:
        hit = kill_after_rounds(out, "c", 4, timeout_s=300)
        _, err = run.communicate(timeout=600)
    finally:
        run.kill()
    assert run.returncode == 0, err + explain(out)
    summary = json.loads((out / "summary.json").read_text())
    sites = summary["sites"]
    assert len({s["param_sha256"] for s in sites.values()}) == 1, sites
    assert all(s["inner_steps"] == 150 for s in sites.values())
    figures = loss_figures(out, "c", hit)
    members = [v["members"] for v in figures["views"]]
    assert ["a", "b"] in members and ["a", "b", "c"] in members
    assert all(t is not None for t in figures["survivors_next_round_after_kill_s"].values())
    assert figures["state_transfer_bytes"] > 0
