"""Checkpoints and ``isthmus run --resume``: a kill mid-write leaves the previous
checkpoint usable, and a stopped run goes on to the same parameters, bit for bit,
as a run that was never stopped."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from test_cli import in_process
from test_run import explain, isthmus, start_run, write_job

from isthmus.intra.checkpoint import (
    complete_checkpoints,
    latest_checkpoint,
    load_checkpoint,
    load_extra,
)

# Saves round 1, then dies (SIGKILL, no cleanup) while writing round 2: after
# DCP wrote its files, before the checkpoint's metadata.
_KILLED_WRITER = """
import os, signal, sys
import torch
import torch.distributed.checkpoint as dcp
from isthmus.intra import checkpoint

folder = sys.argv[1]
torch.manual_seed(0)
model = torch.nn.Linear(64, 64)
optimizer = torch.optim.AdamW(model.parameters())
model(torch.randn(4, 64)).sum().backward()
optimizer.step()
checkpoint.save_checkpoint(folder, 1, model, optimizer, extra={"x": torch.ones(3)}, kind="round")
torch.save(model.state_dict(), os.path.join(folder, "round1.pt"))
with torch.no_grad():
    model.weight.add_(1.0)
save = dcp.save

def save_then_die(*args, **kwargs):
    save(*args, **kwargs)
    os.kill(os.getpid(), signal.SIGKILL)

checkpoint.dcp.save = save_then_die
checkpoint.save_checkpoint(folder, 2, model, optimizer, extra={"x": torch.zeros(3)}, kind="round")
"""


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # one process: as meant
def test_a_kill_mid_write_leaves_the_previous_checkpoint_usable(tmp_path):
    done = subprocess.run(
        [sys.executable, "-c", _KILLED_WRITER, str(tmp_path)], capture_output=True, timeout=120
    )
    assert done.returncode == -signal.SIGKILL, done.stderr
    assert (tmp_path / "round-000002").is_dir()  # written in part ...
    assert not (tmp_path / "round-000002" / "meta.json").exists()  # ... never completed
    assert complete_checkpoints(tmp_path, "round") == [tmp_path / "round-000001"]
    latest = latest_checkpoint(tmp_path, "round")
    assert latest == tmp_path / "round-000001"

    model = torch.nn.Linear(64, 64)
    optimizer = torch.optim.AdamW(model.parameters())
    meta = load_checkpoint(latest, model, optimizer)
    assert meta["round"] == 1
    saved = torch.load(tmp_path / "round1.pt")
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in saved.items())
    assert optimizer.state_dict()["state"][0]["step"] == 1
    assert torch.equal(load_extra(latest)["x"], torch.ones(3))


RESUMABLE_JOB = """\
name: resumable
sites:
  - {name: a, ranks: 1}
  - {name: b, ranks: 2}
wan:
  default: {rtt_ms: 10, bandwidth_mbit: 500}
train: {strategy: STRATEGY, steps: STEPS, sync_every: 4, warmup_steps: 2, codec: int8, eval_every: 0,
        error_feedback: true, checkpoint_every: EVERY,
        # Both sites needed: a lost site stops the run instead of leaving it out.
        min_sites: 2, round_deadline_s: 8, collective_timeout_s: 4, rejoin_timeout_s: 10}
"""


STREAMING = "streaming, fragments: 2, overlap_steps: 2"
"""With sync_every 5 a fragment's exchange starts at the step another one ends
(steps 7, 12, ...): every other checkpoint catches an exchange in flight."""


def _job(tmp_path: Path, strategy: str, steps: int, every: int) -> Path:
    text = RESUMABLE_JOB.replace("STRATEGY", strategy).replace("EVERY", str(every))
    if strategy == STREAMING:
        text = text.replace("sync_every: 4", "sync_every: 5")
    return write_job(tmp_path, steps=steps, text=text)


def _wait_for_checkpoints(out: Path, sites: list[str], count: int, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all(len(complete_checkpoints(out / "checkpoints" / s, "round")) >= count for s in sites):
            return
        time.sleep(0.1)
    raise AssertionError(f"no {count} checkpoints in {timeout} s:\n{explain(out)}")


@pytest.fixture(scope="module")
def whole_run(tmp_path_factory):
    """The site summaries of a run of a job that was never stopped, by the job's
    text: cases of the same job (sync and sync-sigkill) share one run. The job has
    no paths of its own (the built-in model and data), so the run does not depend
    on the folder it runs in."""
    done: dict[str, dict] = {}

    def run(job: Path) -> dict:
        text = job.read_text()
        if text not in done:
            folder = tmp_path_factory.mktemp("whole")
            shared = write_job(folder, text=text)
            whole = folder / "whole"
            ran = isthmus("run", str(shared), "--out", str(whole), "--no-report", cwd=folder)
            assert ran.returncode == 0, ran.stderr + explain(whole)
            sites = json.loads((whole / "summary.json").read_text())["sites"]
            # The reference must be whole: a site that failed at the end has no digest
            # to compare with (the launcher still calls a run with one finished site
            # "finished", as it must for a job that survives losing sites).
            unfinished = {n: s.get("reason") for n, s in sites.items() if s["status"] != "finished"}
            assert not unfinished, f"the never-stopped run: {unfinished}\n{explain(whole)}"
            done[text] = sites
        return done[text]

    return run


@pytest.mark.slow
@pytest.mark.parametrize(
    "strategy, every, stop",
    # SIGKILL: with min_sites 2 the other site pauses, gives up, and the run stops.
    # Async has its exchange in flight at every checkpoint (see STREAMING).
    [
        ("diloco", 1, "ctrl-c"),
        ("sync", 4, "ctrl-c"),
        ("sync", 4, "sigkill"),
        ("async", 1, "ctrl-c"),
        (STREAMING, 2, "ctrl-c"),
    ],
    ids=["diloco", "sync", "sync-sigkill", "async", "streaming"],
)
def test_a_stopped_run_resumes_to_the_same_parameters_bit_for_bit(
    tmp_path, whole_run, strategy, every, stop
):
    """Stopped with Ctrl-C, or by a SIGKILL of one rank of site b (which may land
    in the middle of writing a checkpoint): the launcher stops the run, and
    ``--resume`` goes on from the newest round every site completed."""
    # int8 with error feedback: the residuals must come back too, or the bits differ.
    job = _job(tmp_path, strategy, steps=28, every=every)
    expected = whole_run(job)  # the same job's run that was never stopped

    out = tmp_path / "stopped"
    run = start_run(job, out)
    _wait_for_checkpoints(out, ["a", "b"], 2)
    if stop == "ctrl-c":
        run.send_signal(signal.SIGINT)
    else:
        os.kill(json.loads((out / "pids.json").read_text())["b"][1], signal.SIGKILL)
    run.communicate(timeout=60)
    status = json.loads((out / "summary.json").read_text())["status"]
    assert status == ("interrupted" if stop == "ctrl-c" else "failed")
    # keep=2: at least the newest two complete checkpoints of each site remain.
    assert all(len(complete_checkpoints(out / "checkpoints" / s, "round")) >= 2 for s in "ab")

    resumed = isthmus("run", "--resume", str(out), "--no-report", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr + explain(out)
    assert "resuming after round" in resumed.stdout
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "finished"
    for name, site in summary["sites"].items():
        assert site["param_sha256"] == expected[name]["param_sha256"]
        assert site["inner_steps"] == expected[name]["inner_steps"] == 28
        assert site["outer_steps"] == expected[name]["outer_steps"]
        assert site["tokens"] == expected[name]["tokens"]
    records = [json.loads(line) for line in (out / "sites" / "a" / "metrics.jsonl").open()]
    (resume,) = [r for r in records if r["kind"] == "resume"]
    steps_after = [r["step"] for r in records[records.index(resume) :] if r["kind"] == "step"]
    assert steps_after == list(range(resume["step"] + 1, 29))

    again = isthmus("run", "--resume", str(out), "--no-report", cwd=tmp_path)
    assert again.returncode == 2 and "finished; nothing to go on with" in again.stderr


@pytest.mark.slow
def test_resume_without_checkpoints_says_how_to_get_them(tmp_path):
    job = _job(tmp_path, "diloco", steps=4, every=0)
    out = tmp_path / "run"
    assert isthmus("run", str(job), "--out", str(out), "--no-report", cwd=tmp_path).returncode == 0
    (out / "summary.json").unlink()  # as if it had been killed
    refused = isthmus("run", "--resume", str(out), cwd=tmp_path)
    assert refused.returncode == 2
    assert "train.checkpoint_every: 0" in refused.stderr
    assert "set it to resume runs" in refused.stderr


@pytest.mark.parametrize(
    "args, message",
    [
        (["--resume", "nowhere"], "not a run directory (no job.yaml)"),
        (["job.yaml", "--resume", "x"], "drop JOB.yaml"),
        ([], "name the job file to run (or --resume RUN_DIR)"),
    ],
)
def test_resume_refuses_bad_arguments_in_one_line(tmp_path, capsys, monkeypatch, args, message):
    monkeypatch.chdir(tmp_path)  # the relative paths in ``args`` are the test's own
    code, _, stderr = in_process(capsys, "run", *args)  # a traceback would raise here
    assert code == 2
    assert message in stderr
    assert "Traceback" not in stderr
