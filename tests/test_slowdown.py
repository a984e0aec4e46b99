"""A slow site (``wan.faults: [{slow: SITE, factor: F, ...}]``): it computes F times
slower while the fault holds, inside its own training loop, so the time is real,
counted as its compute, and the other sites wait for it; bad entries are refused
naming the field."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys

import pytest
from test_run import explain

from isthmus.job.file import JobFileError, parse_job
from isthmus.training.records import read_records

JOB = """\
name: slow
sites:
  - {name: a, ranks: 1}
  - {name: b, ranks: 1}
wan:
  default: {rtt_ms: 10, bandwidth_mbit: 500}
  faults:
    - {slow: b, factor: 4, at_round: 2, for_rounds: 2}
train: {strategy: STRATEGY, steps: 40, sync_every: 5, warmup_steps: 2, eval_every: 0}
"""


@pytest.mark.parametrize(
    ("entry", "field", "says"),
    [
        ("{slow: z, factor: 4, at_round: 2}", "wan.faults[0].slow", "unknown site 'z'"),
        ("{slow: b, factor: 0, at_round: 2}", "wan.faults[0].factor", "must be from 1 to 100"),
        ("{slow: b, factor: 101, at_s: 2}", "wan.faults[0].factor", "must be from 1 to 100"),
        ("{slow: b, factor: -2, at_s: 2}", "wan.faults[0].factor", "must be from 1 to 100"),
        ("{slow: b, factor: 4}", "wan.faults[0].at_s", "give one of at_s"),
        ("{slow: b, at_s: 1}", "wan.faults[0]", "missing 'factor'"),
        ("{slow: b, factor: 2, at_s: 1, link: [a, b]}", "wan.faults[0]", "link"),
    ],
)
def test_a_bad_slowdown_is_refused_naming_the_field(entry, field, says):
    text = JOB.replace("{slow: b, factor: 4, at_round: 2, for_rounds: 2}", entry)
    with pytest.raises(JobFileError) as caught:
        parse_job(text.replace("STRATEGY", "diloco"))
    lines = "\n".join(caught.value.lines())
    assert field in lines and says in lines, lines


@pytest.mark.slow
def test_a_slow_site_computes_four_times_slower_while_it_holds_and_the_other_waits(tmp_path):
    job = tmp_path / "job.yaml"
    job.write_text(JOB.replace("STRATEGY", "diloco"))
    out = tmp_path / "run"
    done = subprocess.run(
        [sys.executable, "-m", "isthmus", "run", str(job), "--out", str(out), "--no-report"],
        cwd=tmp_path, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr + explain(out)
    summary = json.loads((out / "summary.json").read_text())
    assert len({s["param_sha256"] for s in summary["sites"].values()}) == 1
    records = read_records(out / "metrics.jsonl")
    marks = [(r["state"], r["round"]) for r in records if r["kind"] == "slowdown"]
    assert marks == [("started", 2), ("ended", 4)], marks
    assert all(r["site"] == "b" for r in records if r["kind"] == "slowdown")

    def compute_per_step(site: str, first: int, last: int) -> float:
        """Median compute of steps first..last (1-based) of ``site``."""
        steps = {r["step"]: r["compute_s"] for r in records
                 if r["kind"] == "step" and r["site"] == site}  # fmt: skip
        return statistics.median(steps[s] - steps[s - 1] for s in range(first, last + 1))

    slowed = compute_per_step("b", 12, 20)  # rounds 3 and 4 (steps 11-20), the first left out
    after = compute_per_step("b", 27, 40)
    assert 2.5 < slowed / after < 6, (slowed, after)
    # a does not compute slower, it waits for b at the rounds b is slow in.
    assert compute_per_step("a", 12, 20) / compute_per_step("a", 27, 40) < 1.8
    began, ended = (r["t"] for r in records if r["kind"] == "slowdown")
    waits = [(r["started"], r["seconds"]) for r in records
             if r["site"] == "a" and r["kind"] == "blocked" and r["what"] == "waiting"]  # fmt: skip
    during = sum(s for t, s in waits if began <= t < ended) / 2  # per round: 2 rounds slow
    later = sum(s for t, s in waits if t >= ended) / 4  # rounds 5-8
    assert during > 2 * later, (during, later)


def test_check_lists_the_slow_site(tmp_path):
    job = tmp_path / "job.yaml"
    job.write_text(JOB.replace("STRATEGY", "diloco"))
    done = subprocess.run(
        [sys.executable, "-m", "isthmus", "check", str(job)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "slow site: b 4x slower from round 2 for 2 rounds" in done.stdout
