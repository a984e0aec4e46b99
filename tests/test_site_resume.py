"""``isthmus site --resume``: a job of sites started one by one, stopped whole, resumed.

Sites as an operator starts them on separate clusters (``isthmus site``, each its
own run directory; a site of two nodes as two commands sharing one, as on a
cluster's shared file system), a real Mosquitto between them."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from needs import needs_mosquitto
from test_control import Mosquitto
from test_site import free_port_block, write

from isthmus.deploy.cli import main
from isthmus.deploy.usage import UsageError

ISTHMUS = [sys.executable, "-m", "isthmus"]
JOB = """\
name: resumable
sites:
  - {{name: a, ranks: 1, address: 127.0.0.1:{a}}}
  - {{name: b, ranks: 2, nodes: 2, address: 127.0.0.1:{b}}}
train: {{strategy: diloco, steps: 64, sync_every: 4, warmup_steps: 2, checkpoint_every: 1,
        eval_every: 0}}
control: {{broker: mqtt://127.0.0.1:{broker}}}
"""


def _start(job: Path, site: str, *flags: str) -> subprocess.Popen:
    return subprocess.Popen(
        [*ISTHMUS, "site", str(job), "--site", site, *flags],
        cwd=job.parent,
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


def _start_job(job: Path, runs: dict[str, Path], rdzv: int, *flags: str) -> dict:
    """Site a (one node) and both nodes of site b, each with ``flags`` and its run
    directory after ``flag`` (``--out`` or ``--resume``)."""
    flag, *rest = flags
    b_nodes = [("--rdzv-endpoint", f"127.0.0.1:{rdzv}", "--node-rank", str(k)) for k in (0, 1)]
    return {
        "a": _start(job, "a", flag, str(runs["a"]), *rest),
        **{
            f"b node {k}": _start(job, "b", flag, str(runs["b"]), *rest, *node)
            for k, node in enumerate(b_nodes)
        },
    }


@pytest.mark.slow
@needs_mosquitto
def test_a_job_stopped_whole_resumes_to_the_same_parameters_bit_for_bit(tmp_path):
    """Site b has two nodes: each answers in the agreement for itself, and both
    go on from the round every node of every site holds."""
    broker = Mosquitto(tmp_path).start()
    try:
        base = free_port_block(4)
        job = write(tmp_path, JOB.format(a=base, b=base + 1, broker=broker.port))
        rdzv = free_port_block(1)
        # The reference: trained without a stop.
        whole = {s: tmp_path / "whole" / s for s in ("a", "b")}
        _finish(_start_job(job, whole, rdzv, "--out"))
        reference = {_digest(whole[s], s) for s in whole}
        assert len(reference) == 1
        # Stopped whole after a few rounds (SIGTERM, as an operator or scheduler does)...
        runs = {s: tmp_path / "stopped" / s for s in ("a", "b")}
        procs = _start_job(job, runs, rdzv, "--out")
        deadline = time.monotonic() + 240
        # Of 16: a margin of 13 rounds between seeing the third and the stop, for a
        # test process starved of CPU on a loaded machine (at 8 rounds, with every
        # round evaluated, site a once finished all of them before the stop came).
        while min(_rounds_done(runs[s], s) for s in runs) < 3:
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs.values())
            time.sleep(0.2)
        for proc in procs.values():
            proc.send_signal(signal.SIGTERM)
        for proc in procs.values():
            proc.communicate(timeout=60)
        assert not (runs["a"] / "sites" / "a" / "result.json").exists()
        # ... and resumed, each site from its own run directory.
        outputs = _finish(_start_job(job, runs, rdzv, "--resume"))
        assert "every site resumes after round" in outputs["a"], outputs["a"]
        assert "every site resumes after round" in outputs["b node 0"], outputs["b node 0"]
        assert '"b/node1": [' in outputs["a"], outputs["a"]  # node 1 answered for itself
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


@needs_mosquitto
def test_sites_agree_on_the_newest_round_they_all_hold_and_leave_nothing_behind(tmp_path):
    from test_control import publish

    from isthmus.deploy.launch.site_resume import plan_resume
    from isthmus.inter.control_topics import encode, membership_topic, status_topic
    from isthmus.job.file import load_job

    broker = Mosquitto(tmp_path).start()
    try:
        one_node = JOB.replace(", nodes: 2", "")  # two sites, one answer each
        job = load_job(write(tmp_path, one_node.format(a=7100, b=7200, broker=broker.port)))
        # What the stopped run left at the broker: a view and b's offline status.
        publish(broker.address, membership_topic(job.name), encode({"epoch": 3}))
        publish(broker.address, status_topic(job.name, "b"), encode({"state": "offline"}))
        # b was stopped while writing round 5 (b first: the leader need not be).
        plans = _agree(job, {("b", 0): [3, 4], ("a", 0): [4, 5]})
        assert plans["a", 0].round == plans["b", 0].round == 4
        # Nothing is left that a later resume (or the resumed membership) could read.
        left = _retained(broker, f"isthmus/{job.name}/#")
        assert left == {}, left
        # A site that finds another live rejoins it instead.
        publish(broker.address, status_topic(job.name, "b"), encode({"state": "online"}))
        plan = plan_resume(job, "a", [4, 5], wait_s=30)
        assert plan.round is None and plan.live == ("b",)
    finally:
        broker.stop()


@needs_mosquitto
def test_every_node_of_a_site_answers_and_a_node_without_the_checkpoints_stops_all(tmp_path):
    """Site b has two nodes. Each answers with the rounds it sees; a round counts only
    if every node holds it. A node that sees none (its run directory is not the
    one the other node wrote: no shared file system) stops every node and site,
    naming the cause, instead of letting b's nodes start from different rounds."""
    from isthmus.job.file import load_job

    broker = Mosquitto(tmp_path).start()
    try:
        job = load_job(write(tmp_path, JOB.format(a=7100, b=7200, broker=broker.port)))
        plans = _agree(job, {("a", 0): [4, 5], ("b", 0): [4, 5], ("b", 1): [3, 4]})
        assert {plan.round for plan in plans.values()} == {4}, plans
        assert plans["b", 1].rounds == {"a": [4, 5], "b": [4, 5], "b/node1": [3, 4]}
        plans = _agree(job, {("a", 0): [4, 5], ("b", 0): [4, 5], ("b", 1): []})
        for plan in plans.values():
            assert isinstance(plan, UsageError), plans
            assert "b/node1: []" in str(plan) and "every node shares" in str(plan)
        assert _retained(broker, f"isthmus/{job.name}/resume/#") == {}
    finally:
        broker.stop()


def test_a_node_of_a_multi_node_site_must_say_which_it_is_to_resume(tmp_path, capsys, monkeypatch):
    job = write(tmp_path, JOB.format(a=7100, b=7200, broker=1883))
    run = tmp_path / "run"
    (run / "sites" / "b").mkdir(parents=True)
    (run / "job.yaml").write_text(job.read_text())
    for variable in ("SLURM_NODEID", "JOB_COMPLETION_INDEX"):
        monkeypatch.delenv(variable, raising=False)

    def site(*flags: str) -> str:
        assert main(["site", str(job), "--site", "b", "--resume", str(run), *flags]) == 2
        return capsys.readouterr().err

    assert "--node-rank: site 'b' has 2 nodes; give each node's index (0 to 1)" in site()
    assert "--node-rank: 2 is not a node of site 'b', which has 2 nodes" in site("--node-rank", "2")
    monkeypatch.setenv("SLURM_NODEID", "x")
    assert "SLURM_NODEID='x' is not a node index" in site()
    monkeypatch.setenv("SLURM_NODEID", "1")  # found: on to the run directory's checks
    assert "no checkpoint of site 'b'" in site()
    (run / "job.yaml").unlink()
    assert "must be on a file system every one of them shares" in site()


def _agree(job, held: dict[tuple[str, int], list[int]]) -> dict:
    """Every (site, node) of ``held`` resumes at once, each in a thread, as separate
    machines would; its plan, or the error it was refused with."""
    import threading

    from isthmus.deploy.launch.site_resume import plan_resume

    plans: dict = {}

    def resume(site: str, node: int) -> None:
        try:
            plans[site, node] = plan_resume(job, site, held[site, node], node=node, wait_s=30)
        except Exception as error:
            plans[site, node] = error

    threads = [threading.Thread(target=resume, args=key) for key in held]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    return plans


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
