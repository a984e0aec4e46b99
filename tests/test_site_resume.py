"""``isthmus site --resume``: a job of sites started one by one, stopped whole, resumed.

Sites as an operator starts them on separate clusters (``isthmus site``, each its
own run directory), a real Mosquitto between them."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_control import Mosquitto
from test_site import MOSQUITTO, free_port_block, write

from isthmus.deploy.cli import main

ISTHMUS = [sys.executable, "-m", "isthmus"]
JOB = """\
name: resumable
sites:
  - {{name: a, ranks: 1, address: 127.0.0.1:{a}}}
  - {{name: b, ranks: 2, address: 127.0.0.1:{b}}}
train: {{strategy: diloco, steps: 48, sync_every: 4, warmup_steps: 2, checkpoint_every: 1}}
control: {{broker: mqtt://127.0.0.1:{broker}}}
"""


def _start(job: Path, site: str, *flags: str) -> subprocess.Popen:
    return subprocess.Popen(
        [*ISTHMUS, "site", str(job), "--site", site, *flags],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _digest(run: Path, site: str) -> str:
    return json.loads((run / "sites" / site / "result.json").read_text())["param_sha256"]


def _rounds_done(run: Path, site: str) -> int:
    metrics = run / "sites" / site / "metrics.jsonl"
    return metrics.read_text().count('"kind": "round"') if metrics.exists() else 0


def _finish(procs: dict[str, subprocess.Popen], timeout: float = 200) -> dict[str, str]:
    outputs = {}
    try:
        for name, proc in procs.items():
            outputs[name] = proc.communicate(timeout=timeout)[0]
    except subprocess.TimeoutExpired:
        for proc in procs.values():
            proc.send_signal(signal.SIGTERM)
        said = {name: proc.communicate(timeout=60)[0] for name, proc in procs.items()}
        raise AssertionError(f"sites still running after {timeout} s: {said}") from None
    for name, proc in procs.items():
        assert proc.returncode == 0, f"{name}:\n{outputs[name]}"
    return outputs


@pytest.mark.slow
@pytest.mark.skipif(MOSQUITTO is None, reason="mosquitto is not installed")
def test_a_job_stopped_whole_resumes_to_the_same_parameters_bit_for_bit(tmp_path):
    broker = Mosquitto(tmp_path).start()
    try:
        base = free_port_block(3)
        job = write(tmp_path, JOB.format(a=base, b=base + 1, broker=broker.port))
        # The reference: trained without a stop.
        whole = {s: tmp_path / "whole" / s for s in ("a", "b")}
        _finish({s: _start(job, s, "--out", str(whole[s])) for s in whole})
        reference = {_digest(whole[s], s) for s in whole}
        assert len(reference) == 1
        # Stopped whole after a few rounds (SIGTERM, as an operator or scheduler does)...
        runs = {s: tmp_path / "stopped" / s for s in ("a", "b")}
        procs = {s: _start(job, s, "--out", str(runs[s])) for s in runs}
        deadline = time.monotonic() + 240
        while min(_rounds_done(runs[s], s) for s in runs) < 5:
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs.values())
            time.sleep(0.2)
        for proc in procs.values():
            proc.send_signal(signal.SIGTERM)
        for proc in procs.values():
            proc.communicate(timeout=60)
        assert not (runs["a"] / "sites" / "a" / "result.json").exists()
        # ... and resumed, each site from its own run directory.
        outputs = _finish({s: _start(job, s, "--resume", str(runs[s])) for s in runs})
        assert "every site resumes after round" in outputs["a"], outputs["a"]
        assert {_digest(runs[s], s) for s in runs} == reference
    finally:
        broker.stop()


def test_resume_refuses_a_directory_of_another_job_or_site(tmp_path, capsys):
    job = write(tmp_path, JOB.format(a=7100, b=7200, broker=1883))
    other = tmp_path / "other"
    (other / "sites" / "b").mkdir(parents=True)
    (other / "job.yaml").write_text(JOB.format(a=7100, b=7200, broker=1883))

    def site(*flags: str) -> tuple[int, str]:
        code = main(["site", str(job), "--site", "a", *flags])
        return code, capsys.readouterr().err

    code, err = site("--resume", str(tmp_path / "nowhere"))
    assert code == 2 and "--resume: " in err and "is not a site's run directory" in err
    code, err = site("--resume", str(other))
    assert code == 2 and "holds site b's run, not 'a''s" in err
    (other / "sites" / "a").mkdir()
    code, err = site("--resume", str(other))
    assert code == 2 and "no checkpoint of site 'a'" in err
    (other / "job.yaml").write_text(
        JOB.replace("resumable", "elsewhere").format(a=7100, b=7200, broker=1883)
    )
    code, err = site("--resume", str(other))
    assert code == 2 and "holds a run of job 'elsewhere', not 'resumable'" in err
    code, err = site("--resume", str(other), "--out", str(tmp_path / "x"))
    assert code == 2 and "without --out or --rejoin" in err


@pytest.mark.skipif(MOSQUITTO is None, reason="mosquitto is not installed")
def test_sites_agree_on_the_newest_round_they_all_hold_and_leave_nothing_behind(tmp_path):
    import threading

    from test_control import publish

    from isthmus.deploy.jobfile import load_job
    from isthmus.deploy.run.site_resume import plan_resume
    from isthmus.inter.control_topics import encode, membership_topic, status_topic

    broker = Mosquitto(tmp_path).start()
    try:
        job = load_job(write(tmp_path, JOB.format(a=7100, b=7200, broker=broker.port)))
        # What the stopped run left at the broker: a view and b's offline status.
        publish(broker.address, membership_topic(job.name), encode({"epoch": 3}))
        publish(broker.address, status_topic(job.name, "b"), encode({"state": "offline"}))
        plans = {}
        held = {"a": [4, 5], "b": [3, 4]}  # b was stopped while writing round 5

        def resume(site: str) -> None:
            plans[site] = plan_resume(job, site, held[site], wait_s=30)

        threads = [threading.Thread(target=resume, args=(s,)) for s in ("b", "a")]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        assert plans["a"].round == plans["b"].round == 4
        # Nothing is left that a later resume (or the resumed membership) could read.
        left = _retained(broker, f"isthmus/{job.name}/#")
        assert left == {}, left
        # A site that finds another live rejoins it instead.
        publish(broker.address, status_topic(job.name, "b"), encode({"state": "online"}))
        plan = plan_resume(job, "a", [4, 5], wait_s=30)
        assert plan.round is None and plan.live == ("b",)
    finally:
        broker.stop()


def _retained(broker: Mosquitto, pattern: str) -> dict[str, bytes]:
    """Every retained message under ``pattern`` (read for a second)."""
    import asyncio

    async def read() -> dict[str, bytes]:
        found: dict[str, bytes] = {}
        async with broker.address.client("reader") as client:
            await client.subscribe(pattern)
            try:
                async with asyncio.timeout(1.0):
                    async for message in client.messages:
                        found[str(message.topic)] = bytes(message.payload)
            except TimeoutError:
                pass
        return found

    return asyncio.run(read())
