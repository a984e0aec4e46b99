"""``isthmus run``, ``eval`` and ``report`` end to end: real processes, real emulator.

Every run here is a real job: the emulator's proxies, one process per rank
(the 2-rank site is a real Gloo group), the strategy's rounds over gRPC.
"""

from __future__ import annotations

import io
import itertools
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_cli import in_process

from isthmus.job.settings import applied_keys
from isthmus.training.records import RecordTail, parameter_digest, read_records

SMALL_JOB = """\
name: small
sites:
  - {name: a, ranks: 1}
  - {name: b, ranks: 2}
wan:
  default: {rtt_ms: 20, bandwidth_mbit: 200}
train: {strategy: diloco, steps: STEPS, sync_every: 4, warmup_steps: 2}
"""


def write_job(tmp_path: Path, steps: int = 10, text: str = SMALL_JOB) -> Path:
    job = tmp_path / "job.yaml"
    job.write_text(text.replace("STEPS", str(steps)))
    return job


def isthmus(*args: str, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "isthmus", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def start_run(job: Path, out: Path, *flags: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "isthmus", "run", str(job), "--out", str(out), *flags],
        cwd=job.parent,  # what the run leaves beside it stays in the test's folder
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def wait_for_steps(out: Path, site: str, steps: int, timeout: float = 120) -> None:
    tail = RecordTail(out / "sites" / site / "metrics.jsonl")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(r["kind"] == "step" and r["step"] >= steps for r in tail.read()):
            return
        time.sleep(0.1)
    raise AssertionError(f"site {site} did not reach step {steps} in {timeout} s")


def explain(out: Path) -> str:
    """What a failed run left behind: its summaries' reasons and its logs' ends."""
    lines = []
    for summary in sorted(out.rglob("summary.json")):
        sites = json.loads(summary.read_text())["sites"]
        lines += [f"{summary.parent.name}/{n}: {s.get('reason')}" for n, s in sites.items()]
    for log in sorted(out.rglob("*.log")):
        lines += [f"--- {log.relative_to(out)}", *log.read_text(errors="replace").splitlines()[-8:]]
    return "\n".join(lines)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is gone for every purpose but its exit status.
    return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"


def all_pids(out: Path) -> list[int]:
    return [pid for pids in json.loads((out / "pids.json").read_text()).values() for pid in pids]


def test_a_small_job_end_to_end(tmp_path, capsys, monkeypatch):
    job = write_job(tmp_path, steps=10)
    out = tmp_path / "run"
    done = isthmus("run", str(job), "--out", str(out), cwd=tmp_path)
    assert done.returncode == 0, done.stderr + explain(out)
    assert "every site holds the same model" in done.stdout
    assert f"report: {out / 'report.md'}" in done.stdout

    summary = json.loads((out / "summary.json").read_text())
    assert summary["job"] == "small" and summary["strategy"] == "diloco"
    for path in [*out.rglob("*.json"), *out.rglob("*.jsonl")]:  # strict JSON: no NaN
        text = path.read_text()
        for line in text.splitlines() if path.suffix == ".jsonl" else [text]:
            json.loads(line, parse_constant=lambda c, p=path: pytest.fail(f"{p}: {c}"))
    assert summary["status"] == "finished"
    assert summary["wall_seconds"] > 0 and 0 < summary["compute_utilization"] <= 1
    # 10 steps, sync_every 4: rounds at 4 and 8, and the final synchronisation.
    sites = summary["sites"]
    assert set(sites) == {"a", "b"}
    for site in sites.values():
        assert site["status"] == "finished"
        assert site["inner_steps"] == 10 and site["outer_steps"] == 3
        assert site["final_loss"] > 0 and site["eval_loss"] > 0
        assert site["compute_seconds"] <= site["wall_seconds"]
        assert len(site["param_sha256"]) == 64
        # Emulated links: auto, and two sites' rounds always take one trip (gather
        # moves direct's bytes); each round is its seal and its data.
        assert set(site["all_reduce_rounds"]) == {"gather"}
        assert site["all_reduce_rounds"]["gather"] >= 2 * site["outer_steps"]
    assert sites["b"]["tokens"] == 2 * sites["a"]["tokens"]  # two data-parallel ranks
    assert sites["a"]["param_sha256"] == sites["b"]["param_sha256"]
    assert sites["a"]["eval_loss"] == sites["b"]["eval_loss"]
    # Isthmus's own count of the data plane, and the emulator's wire under it.
    assert summary["wan_bytes"] == summary["wan_bytes_by_link"]["a<->b"] > 0
    assert summary["emulator_wire_bytes"] >= summary["wan_bytes"]

    resolved = (out / "job.yaml").read_text()
    assert "inner_lr:" in resolved and "batch_size:" in resolved  # defaults filled in
    assert set(json.loads((out / "pids.json").read_text())) == {"a", "b"}
    assert not any(p.name.endswith(".tmp") for p in out.rglob("*"))
    records = read_records(out / "metrics.jsonl")
    kinds = {r["kind"] for r in records}
    assert {"start", "step", "state", "blocked", "round", "eval", "link"} <= kinds
    steps = [r["step"] for r in records if r["kind"] == "step" and r["site"] == "a"]
    assert steps == list(range(1, 11))
    assert (out / "tensorboard" / "a").is_dir() and any((out / "tensorboard" / "b").iterdir())
    for plot in ("loss", "wan", "timeline"):
        assert (out / "plots" / f"{plot}.png").stat().st_size > 10_000
    report = (out / "report.md").read_text()
    assert "![Loss](plots/loss.png)" in report and "| a | finished |" in report
    for log in ("a-r0", "b-r0", "b-r1", "wan"):
        assert (out / "logs" / f"{log}.log").exists()

    # The consolidated model is the one every site holds. eval, report and the refused
    # second run run in this process (no fresh interpreter each); eval seeds torch's
    # generator, which is put back for the tests after this one.
    import torch

    monkeypatch.chdir(tmp_path)
    with torch.random.fork_rng():
        code, stdout, stderr = in_process(capsys, "eval", str(out))
    assert code == 0, stderr
    result = json.loads(stdout)
    assert result["matches_summary"] is True
    assert result["param_sha256"] == sites["a"]["param_sha256"]
    assert result["eval_loss"] == pytest.approx(sites["a"]["eval_loss"], rel=1e-6)

    # The report can be made again from the files; a second run never overwrites.
    (out / "report.md").unlink()
    assert in_process(capsys, "report", str(out))[0] == 0
    assert (out / "report.md").exists()
    code, _, stderr = in_process(capsys, "run", str(job), "--out", str(out))
    assert code == 2
    assert "already exists and is not empty" in stderr
    assert json.loads((out / "summary.json").read_text()) == summary


@pytest.mark.slow
def test_time_budgeted_rounds_end_every_site_at_the_same_round(tmp_path):
    # Site b (two ranks, an in-site average every step) is the slower one here. A
    # round's length is a time, so the run must last several of them on any machine:
    # 40 steps took 2 s on a fast one (1.5 s rounds gave one; 0.4 s rounds gave 5,
    # and 2 on a machine twice as fast). 80 steps: about 4 s there, 2 s on a machine
    # twice as fast (5 rounds); a loaded machine makes more, shorter rounds.
    text = SMALL_JOB.replace("sync_every: 4,", "sync_every: 1000, round_seconds: 0.4,")
    job = write_job(tmp_path, steps=80, text=text)
    out = tmp_path / "run"
    done = isthmus("run", str(job), "--out", str(out), "--no-report", cwd=tmp_path)
    assert done.returncode == 0, done.stderr + explain(out)
    sites = json.loads((out / "summary.json").read_text())["sites"]
    assert sites["a"]["param_sha256"] == sites["b"]["param_sha256"]
    assert sites["a"]["outer_steps"] == sites["b"]["outer_steps"] >= 2
    # The first site to take all its steps ended the run for both.
    assert max(s["inner_steps"] for s in sites.values()) == 80
    assert all(0 < s["inner_steps"] <= 80 for s in sites.values())


@pytest.mark.slow
@pytest.mark.parametrize(
    ("strategy", "eval_every", "evaluated_at"),
    # async's default: after every round, which ends a round late (its exchange
    # overlaps the next 4 steps): step 8 only.
    [("sync", 0, []), ("streaming", 3, [3, 6]), ("async", None, [8])],
)
def test_every_strategy_runs_and_ends_identical(tmp_path, strategy, eval_every, evaluated_at):
    text = SMALL_JOB
    if eval_every is not None:
        text = text.replace("warmup_steps: 2}", f"warmup_steps: 2, eval_every: {eval_every}}}")
    job = write_job(tmp_path, steps=8, text=text)
    out = tmp_path / "run"
    done = isthmus(
        "run", str(job), "--out", str(out), "--no-report", "--strategy", strategy, cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr + explain(out)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["strategy"] == strategy
    assert summary["settings"]["strategy"] == strategy
    # The built-in loop's settings all applied, and no other strategy's.
    assert list(summary["settings"]) == list(applied_keys(strategy)), summary["settings"]
    assert {s["ran"]["optimizer"]["name"] for s in summary["sites"].values()} == {"AdamW"}
    assert summary["model"] == "tiny" and summary["live_changes"] == []
    digests = {s["param_sha256"] for s in summary["sites"].values()}
    assert len(digests) == 1 and None not in digests
    assert all(s["inner_steps"] == 8 for s in summary["sites"].values())
    # Held-out loss where train.eval_every says (0: only the final one; the default:
    # after every round), and at the end.
    evals = [r for r in read_records(out / "metrics.jsonl") if r["kind"] == "eval"]
    for site in ("a", "b"):
        mine = [r for r in evals if r["site"] == site]
        assert [r["step"] for r in mine if not r.get("final")] == evaluated_at
        assert [r["step"] for r in mine if r.get("final")] == [8]
    # Compute utilisation leaves the evaluations inside training out (the final one
    # comes after the site's wall time): the figure isthmus sim predicts.
    sites = summary["sites"].values()
    for site, name in zip(sites, summary["sites"], strict=True):
        timed = sum(r["seconds"] for r in evals if r["site"] == name and not r.get("final"))
        assert site["eval_seconds"] == pytest.approx(timed) and (timed > 0) == bool(evaluated_at)
    assert summary["compute_utilization"] == pytest.approx(
        statistics.fmean(
            s["compute_seconds"] / (s["wall_seconds"] - s["eval_seconds"]) for s in sites
        )
    )


@pytest.mark.slow  # a whole run stopped mid-training: 6-17 s
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_ctrl_c_stops_every_process_and_leaves_whole_files(tmp_path, sig):
    job = write_job(tmp_path, steps=100_000)
    out = tmp_path / "run"
    run = start_run(job, out)
    wait_for_steps(out, "b", 3)
    pids = all_pids(out)
    run.send_signal(sig)
    stdout, stderr = run.communicate(timeout=60)
    assert run.returncode == 130, stderr
    assert "interrupted" in stdout
    assert not [pid for pid in pids if alive(pid)], "rank processes left behind"
    assert not any(p.name.endswith(".tmp") for p in out.rglob("*"))
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "interrupted"
    assert {s["status"] for s in summary["sites"].values()} == {"lost"}
    assert all(s["param_sha256"] is None for s in summary["sites"].values())
    # Every line of the merged metrics is a whole record.
    lines = (out / "metrics.jsonl").read_text().splitlines()
    assert lines and all(json.loads(line) for line in lines)
    assert (out / "report.md").exists()
    # The emulator stopped too: its log ends with its final statistics.
    assert "link a<->b" in (out / "logs" / "wan.log").read_text()


def processes_of(out: Path) -> list[int]:
    """Every live process whose command line or environment names the run directory."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            if not proc.name.isdigit():
                continue
            named = str(out) in (proc / "cmdline").read_text(errors="replace")
            # A site's ranks name it in their environment (ISTHMUS_RUN_DIR), not argv.
            environ = (proc / "environ").read_text(errors="replace").split("\0")
            named = named or f"ISTHMUS_RUN_DIR={out}" in environ
            if named and alive(int(proc.name)):
                found.append(int(proc.name))
        except OSError:
            continue  # gone meanwhile
    return found


@pytest.mark.slow
def test_a_killed_launcher_leaves_no_site_or_emulator_behind(tmp_path):
    # The sites and the emulator run in sessions of their own (Ctrl-C reaches the
    # launcher only), so nothing else would stop them once it is SIGKILLed.
    job = write_job(tmp_path, steps=100_000)
    out = tmp_path / "run"
    run = start_run(job, out, "--no-report")
    wait_for_steps(out, "b", 3)
    children = [pid for pid in processes_of(out) if pid != run.pid]
    assert len(children) >= 4  # a, b's two ranks, the emulator
    run.kill()
    run.communicate(timeout=60)
    deadline = time.monotonic() + 60
    while (left := processes_of(out)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not left, f"left running after the launcher was killed: {left}"


@pytest.mark.slow
def test_a_killed_site_stops_the_run_below_quorum_and_is_named(tmp_path):
    # With both sites needed (min_sites: 2), a lost site pauses the other one until
    # it gives up (rejoin_timeout_s); a run above quorum goes on: test_site_loss.
    text = SMALL_JOB.replace(
        "warmup_steps: 2}",
        "warmup_steps: 2,\n        min_sites: 2, round_deadline_s: 8, collective_timeout_s: 4, "
        "rejoin_timeout_s: 10}",
    )
    job = write_job(tmp_path, steps=100_000, text=text)
    out = tmp_path / "run"
    run = start_run(job, out, "--no-report", "--strategy", "sync")
    wait_for_steps(out, "a", 3)
    victim = json.loads((out / "pids.json").read_text())["b"][1]
    os.kill(victim, signal.SIGKILL)
    _, stderr = run.communicate(timeout=60)
    assert run.returncode == 1
    assert "site b lost: rank 1 killed by SIGKILL" in stderr
    assert "b-r1.log" in stderr
    assert not [pid for pid in all_pids(out) if alive(pid)]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "failed"
    assert summary["sites"]["b"]["status"] == "lost"
    assert "SIGKILL" in summary["sites"]["b"]["reason"]
    assert summary["sites"]["a"]["status"] == "failed"
    assert "quorum needs (train.min_sites)" in summary["sites"]["a"]["reason"]
    assert "train.rejoin_timeout_s" in summary["sites"]["a"]["reason"]
    assert summary["sites"]["a"]["inner_steps"] >= 3


@pytest.mark.slow
def test_a_site_that_crashes_is_named_with_its_error_and_log(tmp_path):
    (tmp_path / "broken_model.py").write_text(
        "def model():\n    raise RuntimeError('out of GPU memory (simulated)')\n"
    )
    job = write_job(tmp_path, text=SMALL_JOB + "model: broken_model:model\n")
    out = tmp_path / "run"
    env_run = subprocess.run(
        [sys.executable, "-m", "isthmus", "run", str(job), "--out", str(out)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(tmp_path)},
    )
    assert env_run.returncode == 1
    # Every rank fails; which one the launcher sees first is a matter of timing.
    assert re.search(r"failed: rank \d exit status 1", env_run.stderr), env_run.stderr
    assert "out of GPU memory (simulated)" in env_run.stderr
    assert "Warning" not in env_run.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert "failed" in {s["status"] for s in summary["sites"].values()}


@pytest.mark.parametrize(
    ("extra", "flags", "message"),
    [
        ("train: {strategy: dilocco}\n", [], "train.strategy: unknown strategy 'dilocco'"),
        ("model: tny\n", [], "model: unknown size 'tny'; did you mean 'tiny'?"),
        ("data: missing.txt\n", [], "data: no file"),
        ("model: no_such_module:model\n", [], "model: cannot import 'no_such_module'"),
        ("", ["--steps", "0"], "--steps: must be an integer >= 1"),
        ("", ["--strategy", "fast"], "argument --strategy: invalid choice: 'fast'"),
        ("", ["--compare", "sync,fast"], "--compare: unknown strategy 'fast'"),
        ("", ["--compare", "sync", "--strategy", "sync"], "drop --strategy"),
    ],
)
def test_bad_input_is_refused_before_anything_starts(
    tmp_path, capsys, monkeypatch, extra, flags, message
):
    text = "name: bad\nsites: [{name: a}, {name: b}]\n" + extra
    job = tmp_path / "job.yaml"
    job.write_text(text)
    out = tmp_path / "run"
    monkeypatch.chdir(tmp_path)
    # In this process: a traceback would be an exception raised here.
    code, _, stderr = in_process(capsys, "run", str(job), "--out", str(out), *flags)
    assert code == 2
    assert message in stderr
    assert "Traceback" not in stderr
    assert not out.exists()


@pytest.mark.slow
def test_compare_writes_one_table_for_every_strategy(tmp_path):
    job = write_job(tmp_path, steps=8)
    out = tmp_path / "cmp"
    done = isthmus("run", str(job), "--out", str(out), "--compare", "sync,diloco", cwd=tmp_path)
    assert done.returncode == 0, done.stderr + explain(out)
    assert "| strategy | held-out loss | WAN bytes |" in done.stdout
    rows = json.loads((out / "compare.json").read_text())
    assert [r["strategy"] for r in rows] == ["sync", "diloco"]
    assert all(r["identical_sites"] and r["status"] == "finished" for r in rows)
    # Sync averages every step, DiLoCo every 4: sync sends more.
    assert rows[0]["wan_bytes"] > 2 * rows[1]["wan_bytes"]
    assert (out / "compare.png").exists() and (out / "compare.md").exists()
    # One warm template forked both runs' ranks: neither started its own.
    assert (out / "template.log").exists()
    assert not list(out.glob("*/logs/template.log"))
    # Each strategy timed to the best held-out loss sync reached (test_compare.py).
    assert rows[0]["time_to_sync_loss_vs_sync"] == 1.0
    assert rows[0]["seconds_to_sync_loss"] <= rows[0]["wall_seconds"]
    assert rows[1]["sync_best_loss"] == rows[0]["sync_best_loss"]
    assert "s to sync's best loss" in (out / "compare.md").read_text()
    for strategy in ("sync", "diloco"):
        assert json.loads((out / strategy / "summary.json").read_text())["strategy"] == strategy


@pytest.mark.slow
def test_your_own_model_and_data_from_the_job_file(tmp_path):
    text = SMALL_JOB + (
        "model: isthmus.deploy.examples.custom_model:model\n"
        "data: isthmus.deploy.examples.custom_model:data\n"
    )
    job = write_job(tmp_path, steps=8, text=text)
    out = tmp_path / "run"
    done = isthmus("run", str(job), "--out", str(out), "--no-report", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["model"] == "isthmus.deploy.examples.custom_model:model"
    digests = {s["param_sha256"] for s in summary["sites"].values()}
    assert len(digests) == 1 and None not in digests
    assert summary["sites"]["a"]["eval_loss"] > 0
    evaluated = json.loads(isthmus("eval", str(out), cwd=tmp_path).stdout)
    assert evaluated["matches_summary"] is True
    # --no-report: none written, and the way to write it said; then it writes it.
    assert f"isthmus report {out} writes it" in done.stdout
    assert not (out / "report.md").exists() and not (out / "plots").exists()
    assert isthmus("report", str(out), cwd=tmp_path).returncode == 0
    assert (out / "report.md").exists()


@pytest.mark.slow
def test_a_job_without_wan_section_connects_sites_directly(tmp_path):
    text = "name: direct\nsites: [{name: a}, {name: b}]\ntrain: {steps: 6, sync_every: 3}\n"
    job = write_job(tmp_path, text=text)
    out = tmp_path / "run"
    done = isthmus("run", str(job), "--out", str(out), "--no-report", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert "emulator_wire_bytes" not in summary and summary["wan_bytes"] > 0
    assert not (out / "logs" / "wan.log").exists()
    assert "address: 127.0.0.1:" in (out / "job.yaml").read_text()  # loopback ports given


def test_record_tail_reads_whole_lines_only(tmp_path):
    path = tmp_path / "m.jsonl"
    tail = RecordTail(path)
    assert list(tail.read()) == []  # no file yet
    path.write_text('{"kind": "step", "step": 1}\n{"kind": "st')
    assert [r["step"] for r in tail.read()] == [1]
    with path.open("a") as f:
        f.write('ep", "step": 2}\nnot json\n')
    assert [r["step"] for r in tail.read()] == [2]


def test_parameter_digest_names_order_and_values():
    import torch

    a = torch.nn.Linear(3, 2)
    b = torch.nn.Linear(3, 2)
    b.load_state_dict(a.state_dict())
    assert parameter_digest(a) == parameter_digest(b)
    with torch.no_grad():
        b.bias[0] = torch.nextafter(b.bias[0], torch.tensor(2.0))
    assert parameter_digest(a) != parameter_digest(b)


def test_learning_rate_warms_up_then_decays_to_a_tenth():
    from isthmus.job.settings import TrainSettings
    from isthmus.training.rank_setup import learning_rate

    settings = TrainSettings(steps=100, warmup_steps=10, inner_lr=1.0)
    rates = [learning_rate(settings, s) for s in range(100)]
    assert rates[0] == pytest.approx(0.1) and rates[9] == pytest.approx(1.0)
    assert all(x >= y for x, y in itertools.pairwise(rates[9:]))
    assert rates[-1] == pytest.approx(0.1, abs=0.01)


def test_a_constant_schedule_holds_the_peak_after_the_warm_up():
    from isthmus.job.settings import TrainSettings
    from isthmus.training.rank_setup import learning_rate

    settings = TrainSettings(steps=100, warmup_steps=10, inner_lr=1.0, lr_schedule="constant")
    rates = [learning_rate(settings, s) for s in range(100)]
    assert rates[0] == pytest.approx(0.1) and rates[4] == pytest.approx(0.5)
    assert rates[9:] == [1.0] * 91


def test_wsd_holds_the_peak_then_decays_linearly_over_the_last_fifth():
    from isthmus.job.settings import TrainSettings
    from isthmus.training.rank_setup import learning_rate

    settings = TrainSettings(steps=100, warmup_steps=10, inner_lr=1.0, lr_schedule="wsd")
    rates = [learning_rate(settings, s) for s in range(100)]
    assert rates[0] == pytest.approx(0.1) and rates[9:80] == [1.0] * 71
    assert rates[90] == pytest.approx(1 - 0.9 * 10 / 20)
    assert all(x > y for x, y in itertools.pairwise(rates[80:]))
    assert rates[-1] == pytest.approx(0.1, abs=0.05)


def test_the_inner_optimizer_takes_the_job_files_adamw_settings():
    import torch

    from isthmus.job.file import parse_job
    from isthmus.training.rank_setup import inner_optimizer

    job = parse_job(
        "name: j\nsites: [{name: a}]\ntrain: {inner_lr: 0.002, warmup_steps: 0, "
        "inner_beta1: 0.8, inner_beta2: 0.95, inner_weight_decay: 0.1}\n"
    )
    optimizer = inner_optimizer(job.train, torch.nn.Linear(2, 2).parameters())
    group = optimizer.param_groups[0]
    assert group["lr"] == 0.002
    assert group["betas"] == (0.8, 0.95) and group["weight_decay"] == 0.1
    # DiLoCo's default; the other strategies', and the job file's choice, AdamW.
    assert type(optimizer).__name__ == "SiteAdamW"
    for train in ("{strategy: sync}", "{strategy: streaming}", "{inner_optimizer: adamw}"):
        job = parse_job(f"name: j\nsites: [{{name: a}}]\ntrain: {train}\n")
        assert type(inner_optimizer(job.train, [torch.zeros(1)])) is torch.optim.AdamW


def test_live_progress_renders_every_site_and_link(tmp_path):
    from rich.console import Console

    from isthmus.deploy.launch.progress import LiveProgress, PlainProgress
    from isthmus.deploy.launch.run_state import RunState, SiteState
    from isthmus.job.file import parse_job

    job = parse_job("name: j\nsites: [{name: a}, {name: b}]\ntrain: {steps: 10}\n")
    state = RunState(
        job=job,
        run_dir=tmp_path,
        started=time.time() - 5,
        sites={
            "a": SiteState(
                "a", 1, status="syncing", step=4, loss=3.5, wan_bytes_sent_to={"b": 10**6}
            ),
            "b": SiteState("b", 1),
        },
        links={"a<->b": {"bytes": 2.5e6, "mbit_s": 40.0}},
    )
    console = Console(file=io.StringIO(), width=160)
    console.print(LiveProgress().render(state))
    text = console.file.getvalue()
    assert "4/10" in text and "3.500" in text and "syncing" in text and "a<->b" in text
    plain = io.StringIO()
    PlainProgress(plain).update(state)
    assert (
        "a: step 4/10 loss 3.500" in plain.getvalue() and "link a<->b: 2.5 MB" in plain.getvalue()
    )


def test_progress_with_many_sites_names_the_busiest_links_and_sums_the_rest(tmp_path):
    from rich.console import Console

    from isthmus.deploy.launch.progress import LINKS_SHOWN, LiveProgress, PlainProgress
    from isthmus.deploy.launch.run_state import RunState, SiteState
    from isthmus.job.file import parse_job

    names = [f"s{i:02d}" for i in range(16)]
    job = parse_job("name: j\nsites: [" + ", ".join(f"{{name: {n}}}" for n in names) + "]\n")
    pairs = [(a, b) for i, a in enumerate(names) for b in names[i + 1 :]]
    links = {
        f"{a}<->{b}": {"bytes": 1e6 * (k + 1), "mbit_s": 1.0} for k, (a, b) in enumerate(pairs)
    }
    sent = {"s00": {n: 10**6 for n in names[1:]}}
    state = RunState(
        job=job,
        run_dir=tmp_path,
        started=time.time(),
        sites={n: SiteState(n, 1, wan_bytes_sent_to=sent.get(n, {})) for n in names},
        links=links,
    )
    plain = io.StringIO()
    PlainProgress(plain).update(state)
    lines = [line for line in plain.getvalue().splitlines() if " link " in line]
    assert len(lines) == LINKS_SHOWN and "link s14<->s15: 120.0 MB" in lines[0]
    rest = sum(range(1, 121 - LINKS_SHOWN)) * 1e6 / 1e6
    assert f"{120 - LINKS_SHOWN} more links: {rest:.1f} MB" in plain.getvalue()
    console = Console(file=io.StringIO(), width=160)
    console.print(LiveProgress().render(state))
    assert f"{120 - LINKS_SHOWN} more links" in console.file.getvalue()
