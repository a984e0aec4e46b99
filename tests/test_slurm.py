"""The rendered batch scripts under a real Slurm (Debian's slurm-wlm with munge).

``tests/slurm_cluster.py`` starts munged, slurmctld and two slurmd (two fake
nodes of this host) for each test and stops them after it. The job files are
rendered with ``isthmus deploy render --target slurm --out deploy`` and
submitted with ``sbatch deploy/SITE.sbatch`` from the job file's folder, as
docs/deploy.md tells an operator. Skipped, with the reason, where Slurm is not
installed or the tests do not run as root; CI installs it.
"""

from __future__ import annotations

import json
import os
import socket
import sys
from pathlib import Path

import pytest
from slurm_cluster import SlurmCluster, missing
from test_control import Mosquitto

from isthmus.deploy.cli import main
from isthmus.job.file import free_port_blocks

# serial: one Slurm cluster at a time. Two at once (two xdist workers) never ran their
# jobs to the end: both tests timed out.
pytestmark = [
    pytest.mark.slow,
    pytest.mark.serial,
    pytest.mark.skipif(missing() is not None, reason=str(missing())),
]


@pytest.fixture
def cluster(tmp_path):
    slurm = SlurmCluster(tmp_path / "slurm", nodes=2, cpus=2).start()
    yield slurm
    slurm.stop()


@pytest.fixture
def broker(tmp_path):
    server = Mosquitto(tmp_path).start()
    yield server
    server.stop()


def _job(folder: Path, broker: Mosquitto, sites: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    job = folder / "job.yaml"
    job.write_text(
        f"name: slurmjob\nsites:\n{sites}"
        "train: {strategy: diloco, steps: 12, sync_every: 4, warmup_steps: 2}\n"
        f"control: {{broker: 'mqtt://127.0.0.1:{broker.port}'}}\n"
    )
    return job


def _submit_all(cluster: SlurmCluster, job: Path, sites: list[str], capsys) -> dict[str, int]:
    """Render, then ``sbatch deploy/SITE.sbatch`` from the job file's folder."""
    code = main(["deploy", "render", str(job), "--target", "slurm", "--out", "deploy"])
    rendered = capsys.readouterr()
    assert code == 0, rendered.err
    env = {"PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    return {
        site: cluster.submit(Path("deploy") / f"{site}.sbatch", cwd=job.parent, env=env)
        for site in sites
    }


def _run_to_the_end(
    cluster: SlurmCluster, job: Path, sites: list[str], capsys
) -> tuple[dict[str, int], dict[str, str], dict[str, dict]]:
    """Submit every site, wait for all to complete; the job ids, each site's Slurm
    output and its ``result.json``."""
    ids = _submit_all(cluster, job, sites, capsys)
    states = cluster.wait(list(ids.values()), timeout_s=400)
    outputs = {site: (job.parent / f"slurm-{i}.out").read_text() for site, i in ids.items()}
    assert set(states.values()) == {"COMPLETED"}, (states, outputs, cluster.logs())
    return ids, outputs, _results(job, sites)


def _results(job: Path, sites: list[str]) -> dict[str, dict]:
    runs = job.parent / "runs"
    return {s: json.loads((runs / f"slurmjob-{s}" / "sites" / s / "result.json").read_text())
            for s in sites}  # fmt: skip


def test_two_sites_submitted_with_sbatch_train_one_model_while_port_29400_is_taken(
    cluster, broker, tmp_path, capsys, monkeypatch
):
    """Site b, two ranks on one node, must not meet another job's listener on the
    rendezvous port (it held torchrun for minutes, then failed both sites)."""
    base = free_port_blocks("127.0.0.1", [3])[0]
    job = _job(
        tmp_path / "job",
        broker,
        f"  - {{name: a, ranks: 1, address: 127.0.0.1:{base}}}\n"
        f"  - {{name: b, ranks: 2, address: 127.0.0.1:{base + 1}}}\n",
    )
    monkeypatch.chdir(tmp_path / "job")
    with socket.socket() as squatter:  # another job's rendezvous store, say
        squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        squatter.bind(("0.0.0.0", 29400))
        squatter.listen()
        ids, _, results = _run_to_the_end(cluster, job, ["a", "b"], capsys)
    assert results["a"]["param_sha256"] == results["b"]["param_sha256"]
    assert results["a"]["outer_steps"] == 3
    # Each site's step was given a CPU per rank (task/affinity pins to what it gets).
    for site, ranks in (("a", 1), ("b", 2)):
        shown = cluster.run("scontrol", "-o", "show", "job", str(ids[site])).stdout
        assert f"MinCPUsNode={ranks}" in shown or f"NumCPUs={ranks}" in shown, shown


def test_a_site_on_two_nodes_trains_and_prints_its_progress_once(
    cluster, broker, tmp_path, capsys, monkeypatch
):
    base = free_port_blocks("127.0.0.1", [3])[0]
    job = _job(
        tmp_path / "job",
        broker,
        f"  - {{name: a, ranks: 1, address: 127.0.0.1:{base}}}\n"
        f"  - {{name: c, ranks: 2, nodes: 2, address: 127.0.0.1:{base + 1}}}\n",
    )
    monkeypatch.chdir(tmp_path / "job")
    _, outputs, results = _run_to_the_end(cluster, job, ["a", "c"], capsys)
    assert results["a"]["param_sha256"] == results["c"]["param_sha256"]
    # Both nodes of c read the same records; only the first prints them.
    assert outputs["c"].count("c: round 3 at step 12") == 1, outputs["c"]
    assert "progress is printed by its first node" in outputs["c"]
