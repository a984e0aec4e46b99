"""``isthmus site``: one site of a job on a real cluster, and the job file's
multi-node and advertised addresses.

The slow tests train real jobs site by site, as operators start them: two
sites on this host (one under a torchrun the user starts), and three sites as
separate hosts of the packet-level emulator (``scripts/separate_hosts.sh``).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from needs import MOSQUITTO, needs_mosquitto
from test_control import Mosquitto

from isthmus.deploy.cli import main
from isthmus.deploy.launch.cluster_site import SiteProgress, torchrun_layout_flags
from isthmus.job.file import JobFileError, free_port_blocks, parse_job
from isthmus.sim.hosts import HostsUnavailable, check_support
from isthmus.training.records import read_records

ROOT = Path(__file__).resolve().parents[1]
ISTHMUS = [sys.executable, "-m", "isthmus"]

MULTI_NODE = """\
name: clusters
sites:
  - name: us-east
    ranks: 4
    nodes: 2
    address: 0.0.0.0:7100
    advertise: [lb-0.us.example:7100, lb-0.us.example:7101, lb-1.us.example:7102,
                lb-1.us.example:7103]
  - {name: eu-west, ranks: 2, address: 0.0.0.0:7100, advertise: 198.51.100.9:9100}
control: {broker: mqtt://broker.example:1883}
insecure: true  # about layouts and ports; TLS across networks: tests/test_exposure.py
"""


def write(tmp_path: Path, text: str, name: str = "job.yaml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def cli(capsys, *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def free_port_block(count: int) -> int:
    """A base port with ``count`` free ports after it (on loopback)."""
    return free_port_blocks("127.0.0.1", [count])[0]


# -- the job file ------------------------------------------------------------------------


def test_a_multi_node_site_is_dialled_at_one_advertised_address_per_rank():
    job = parse_job(MULTI_NODE)
    east, west = job.sites
    assert (east.nodes, east.ranks_per_node) == (2, 2)
    assert east.listen_addresses() == [("0.0.0.0", 7100 + r) for r in range(4)]
    assert east.dial_addresses()[2] == ("lb-1.us.example", 7102)
    assert west.dial_addresses() == [("198.51.100.9", 9100), ("198.51.100.9", 9101)]


def test_sites_on_separate_machines_may_listen_alike_but_not_be_dialled_alike():
    same = MULTI_NODE.replace("198.51.100.9:9100", "lb-0.us.example:7100")
    with pytest.raises(JobFileError) as info:
        parse_job(same)
    assert "sites[1].advertise" in str(info.value) and "us-east" in str(info.value)


@pytest.mark.parametrize(
    ("change", "field", "words"),
    [
        ("nodes: 2\n    address", "sites[0].nodes", "do not split evenly"),
        ("nodes: 0\n    address", "sites[0].nodes", "integer >= 1"),
    ],
)
def test_nodes_must_split_the_ranks(change, field, words):
    text = MULTI_NODE.replace("ranks: 4\n    nodes: 2\n    address", "ranks: 3\n    " + change)
    with pytest.raises(JobFileError) as info:
        parse_job(text)
    assert field in str(info.value) and words in str(info.value)


def test_an_advertise_list_needs_one_address_per_rank():
    text = MULTI_NODE.replace("lb-1.us.example:7102,", "lb-1.us.example:7102]").replace(
        "\n                lb-1.us.example:7103]", ""
    )
    with pytest.raises(JobFileError) as info:
        parse_job(text)
    assert "sites[0].advertise: a list needs one address per rank: 4, got 3" in str(info.value)


# -- the command's checks ----------------------------------------------------------------


def test_print_ports_lists_every_rank_and_what_the_site_dials(tmp_path, capsys):
    job = write(tmp_path, MULTI_NODE)
    code, out, _ = cli(capsys, "site", str(job), "--site", "us-east", "--print-ports")
    assert code == 0
    assert "rank 3 (node 1): listens on 0.0.0.0:7103 (dialled at lb-1.us.example:7103)" in out
    assert "eu-west: 198.51.100.9:9100, 198.51.100.9:9101" in out
    assert "broker (TCP): broker.example:1883" in out
    assert "rendezvous (TCP 29400" in out


def test_a_name_not_in_the_job_is_refused_with_the_sites(tmp_path, capsys):
    job = write(tmp_path, MULTI_NODE)
    code, _, err = cli(capsys, "site", str(job), "--site", "us-eats")
    assert code == 2
    assert "--site: the job 'clusters' has no site 'us-eats'; did you mean 'us-east'?" in err


def test_a_site_needs_the_broker_and_everyone_s_address(tmp_path, capsys):
    no_broker = write(
        tmp_path, MULTI_NODE.replace("control: {broker: mqtt://broker.example:1883}\n", "")
    )
    code, _, err = cli(capsys, "site", str(no_broker), "--site", "eu-west")
    assert code == 2 and "control.broker:" in err
    no_address = write(
        tmp_path,
        MULTI_NODE.replace(
            "{name: eu-west, ranks: 2, address: 0.0.0.0:7100, advertise: 198.51.100.9:9100}",
            "{name: eu-west, ranks: 2}",
        ),
        "two.yaml",
    )
    code, _, err = cli(capsys, "site", str(no_address), "--site", "us-east")
    assert code == 2 and "'eu-west'" in err and "address" in err


def test_an_address_this_machine_cannot_listen_on_is_refused_naming_the_field(tmp_path, capsys):
    # 192.0.2.0/24 is reserved for documentation: never an address of this machine.
    job = write(
        tmp_path,
        MULTI_NODE.replace("ranks: 2, address: 0.0.0.0:7100", "ranks: 1, address: 192.0.2.1:7100"),
    )
    code, _, err = cli(capsys, "site", str(job), "--site", "eu-west", "--out", str(tmp_path / "o"))
    assert code == 2
    assert "sites[1].address: rank 0 cannot listen on 192.0.2.1:7100" in err
    assert "not an address of this machine" in err and "advertise" in err


def test_a_port_in_use_is_refused_naming_the_field(tmp_path, capsys):
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        job = write(
            tmp_path,
            MULTI_NODE.replace(
                "ranks: 2, address: 0.0.0.0:7100, advertise: 198.51.100.9:9100",
                f"ranks: 1, address: 127.0.0.1:{port}",
            ),
        )
        code, _, err = cli(capsys, "site", str(job), "--site", "eu-west")
    assert code == 2 and f"sites[1].address: rank 0 cannot listen on 127.0.0.1:{port}" in err
    assert "in use" in err


@pytest.mark.parametrize(
    ("world", "local", "field", "fix"),
    [
        (3, 3, "sites[0].ranks", "--nnodes 2 --nproc-per-node 2"),
        (4, 4, "sites[0].nodes", "--nnodes 2 --nproc-per-node 2"),
    ],
)
def test_a_layout_unlike_the_one_torchrun_reports_is_refused(
    tmp_path, capsys, monkeypatch, world, local, field, fix
):
    job = write(tmp_path, MULTI_NODE)
    for name, value in {
        "TORCHELASTIC_RUN_ID": "x",
        "RANK": "0",
        "WORLD_SIZE": str(world),
        "LOCAL_WORLD_SIZE": str(local),
    }.items():
        monkeypatch.setenv(name, value)
    code, _, err = cli(capsys, "site", str(job), "--site", "us-east")
    assert code == 2 and f"{field}:" in err and fix in err


def test_a_multi_node_site_started_without_torchrun_needs_its_rendezvous(tmp_path, capsys):
    job = write(tmp_path, MULTI_NODE)
    code, _, err = cli(capsys, "site", str(job), "--site", "us-east")
    assert code == 2 and "--rdzv-endpoint: site 'us-east' has 2 nodes" in err


def test_torchrun_gets_the_site_s_layout():
    job = parse_job(MULTI_NODE)
    east, west = job.sites
    flags = torchrun_layout_flags(job, east, "node0.us.example")
    assert flags[:4] == ["--nnodes", "2", "--nproc-per-node", "2"]
    assert "node0.us.example:29400" in flags and "isthmus-clusters-us-east" in flags
    assert torchrun_layout_flags(job, west, None)[-1] == "--standalone"
    # One node never dials a rendezvous port: another job may hold it on the node.
    assert torchrun_layout_flags(job, west, "node0.eu.example:29400")[-1] == "--standalone"


def test_progress_shows_rounds_once_views_and_the_end(tmp_path):
    progress = SiteProgress(tmp_path, "a")
    records = [
        {"kind": "step", "loss": 3.25},
        {"kind": "round", "step": 10, "outer_steps": 1, "wan_bytes_sent": 2_500_000},
        {"kind": "round", "step": 10, "outer_steps": 1, "wan_bytes_sent": 2_500_000},
        {"kind": "view", "epoch": 1, "members": ["a", "c"], "start_round": 2, "reason": "x"},
        {"kind": "state", "state": "finished"},
    ]
    lines = [progress.line_for(r) for r in records]
    assert lines == [
        None,
        "round 1 at step 10, loss 3.250, 2.5 MB sent",
        None,
        "view 1: members a, c from round 2 (x)",
        "finished",
    ]


# -- real sites ------------------------------------------------------------------------


def finish(procs: dict[str, subprocess.Popen], broker: Mosquitto, timeout: float) -> dict[str, str]:
    """Wait for every process, stop them all and the broker; their outputs, each
    checked to have ended well."""
    try:
        outputs = {name: proc.communicate(timeout=timeout)[0] for name, proc in procs.items()}
    finally:
        for proc in procs.values():
            proc.kill()
        broker.stop()
    for name, proc in procs.items():
        assert proc.returncode == 0, f"{name}:\n{outputs[name]}"
    return outputs


def result(out: Path, site: str) -> dict:
    return json.loads((out / "sites" / site / "result.json").read_text())


@pytest.mark.slow
@needs_mosquitto
def test_three_sites_train_one_model_each_started_on_its_own(tmp_path):
    """Site a under a torchrun the operator starts; site b (one rank) on its own;
    site c on two "nodes", each started with ``isthmus site --rdzv-endpoint`` (its
    torchrun meets the other node's through c10d). They meet only through the job
    file's addresses and broker, and each node writes only its own directory."""
    broker = Mosquitto(tmp_path).start()
    base = free_port_block(6)
    rendezvous = free_port_block(1)
    job = write(
        tmp_path,
        f"""\
        name: clusters
        sites:
          - {{name: a, ranks: 2, address: 127.0.0.1:{base}}}
          - {{name: b, ranks: 1, address: 127.0.0.1:{base + 2}}}
          - {{name: c, ranks: 2, nodes: 2, address: 127.0.0.1:{base + 3}}}
        train: {{strategy: diloco, steps: 20, sync_every: 10, warmup_steps: 2}}
        control: {{broker: mqtt://127.0.0.1:{broker.port}}}
        """,
    )
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    torchrun += ["--nproc-per-node", "2", "-m", "isthmus"]
    node = ["--rdzv-endpoint", f"127.0.0.1:{rendezvous}"]
    commands = {
        "a": [*torchrun, "site", str(job), "--site", "a", "--out", str(tmp_path / "a")],
        "b": [*ISTHMUS, "site", str(job), "--site", "b", "--out", str(tmp_path / "b")],
        "c0": [*ISTHMUS, "site", str(job), "--site", "c", "--out", str(tmp_path / "c0"), *node],
        "c1": [*ISTHMUS, "site", str(job), "--site", "c", "--out", str(tmp_path / "c1"), *node],
    }
    procs = {
        name: subprocess.Popen(
            command, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        for name, command in commands.items()
    }
    outputs = finish(procs, broker, timeout=240)
    assert "a: round 2 at step 20" in outputs["a"] and "b: finished" in outputs["b"]
    # Site c's rank 0 is on whichever node the rendezvous made node 0.
    (c_dir,) = [d for d in ("c0", "c1") if (tmp_path / d / "sites" / "c" / "result.json").exists()]
    digests = {
        result(tmp_path / d, s)["param_sha256"] for d, s in (("a", "a"), ("b", "b"), (c_dir, "c"))
    }
    assert len(digests) == 1
    assert result(tmp_path / "a", "a")["outer_steps"] == 2
    assert not (tmp_path / "a" / "sites" / "b").exists()
    assert (tmp_path / "a" / "model.safetensors").is_file()


def _wait_for_rounds(metrics: Path, rounds: int, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if metrics.exists() and metrics.read_text().count('"kind": "round"') >= rounds:
            return
        assert proc.poll() is None, proc.communicate()[0]
        time.sleep(0.5)
    raise AssertionError(f"{metrics}: {rounds} rounds not reached in {timeout} s")


@pytest.mark.slow
@needs_mosquitto
def test_a_site_added_to_the_job_file_joins_the_running_sites(tmp_path):
    """a and b train with a job file of two sites; c, appended to a copy of it (with
    a certificate of the same CA), starts with --rejoin once they are 3 rounds in,
    is taken in at a round boundary after pulling the state, and all three end with
    the same model."""
    broker = Mosquitto(tmp_path).start()
    base = free_port_block(3)
    two = f"""\
        name: growing
        sites:
          - {{name: a, ranks: 1, address: 127.0.0.1:{base}}}
          - {{name: b, ranks: 1, address: 127.0.0.1:{base + 1}}}
        train: {{strategy: diloco, steps: 200, sync_every: 5, warmup_steps: 2, eval_every: 0}}
        tls: {{ca: certs/ca.crt, cert: "certs/{{site}}.crt", key: "certs/{{site}}.key"}}
        control: {{broker: mqtt://127.0.0.1:{broker.port}}}
        """
    job = write(tmp_path, two)
    assert main(["certs", str(job), "--out", str(tmp_path / "certs")]) == 0
    three = two.replace(
        "        train:",
        f"          - {{name: c, ranks: 1, address: 127.0.0.1:{base + 2}}}\n        train:",
    )
    grown = write(tmp_path, three, "grown.yaml")
    assert main(["certs", str(grown), "--out", str(tmp_path / "certs")]) == 0  # c's only

    def start(job_file: Path, site: str, *flags: str) -> subprocess.Popen:
        command = [*ISTHMUS, "site", str(job_file), "--site", site, "--out", str(tmp_path / site)]
        return subprocess.Popen(
            [*command, *flags],
            cwd=tmp_path,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )

    procs = {"a": start(job, "a"), "b": start(job, "b")}
    try:
        _wait_for_rounds(tmp_path / "a" / "sites" / "a" / "metrics.jsonl", 3, procs["a"], 180)
        procs["c"] = start(grown, "c", "--rejoin")
    finally:
        outputs = finish(procs, broker, timeout=300)
    results = {s: result(tmp_path / s, s) for s in "abc"}
    assert len({r["param_sha256"] for r in results.values()}) == 1, results
    assert "rejoined at round" in outputs["c"]
    # c took part in the rounds after it joined, and trained the steps of those.
    trained = read_records(tmp_path / "c" / "sites" / "c" / "metrics.jsonl")
    assert 0 < sum(r["kind"] == "step" for r in trained) < 200
    views = [
        r
        for r in read_records(tmp_path / "b" / "sites" / "b" / "metrics.jsonl")
        if r["kind"] == "view"
    ]
    assert any(v["members"] == ["a", "b", "c"] for v in views), views


def _separate_hosts_unsupported() -> str | None:
    try:
        check_support()
    except HostsUnavailable as exc:
        return str(exc)
    return None if MOSQUITTO else needs_mosquitto.kwargs["reason"]


@pytest.mark.slow
@pytest.mark.root
@pytest.mark.skipif(
    _separate_hosts_unsupported() is not None, reason=str(_separate_hosts_unsupported())
)
def test_three_sites_on_separate_hosts_started_as_operators_would(tmp_path):
    """scripts/separate_hosts.sh: each site its own network namespace behind the
    emulated WAN, started with ``isthmus site`` through ``isthmus wan exec``, the
    broker (mutual TLS) on one of the hosts."""
    out = tmp_path / "run"
    env = {
        **os.environ,
        "ISTHMUS": str(Path(sys.executable).parent / "isthmus"),
        "STEPS": "20",
        "PRESET": "cross-country",
    }
    done = subprocess.run(
        ["bash", str(ROOT / "scripts" / "separate_hosts.sh"), str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    digests = {result(out / "sites" / s, s)["param_sha256"] for s in "abc"}
    assert len(digests) == 1
    assert "every site holds the same model" in done.stdout
    for site in "abc":
        assert "round 2 at step 20" in (out / f"{site}.log").read_text()


def test_tcp_settings_that_slow_a_long_fat_link_are_named_with_their_fix(tmp_path):
    from isthmus.deploy.launch.host_tuning import read_sysctl, tcp_advice

    defaults = {
        "net.ipv4.tcp_slow_start_after_idle": "1",
        "net.ipv4.tcp_rmem": "4096 131072 6291456",
        "net.ipv4.tcp_wmem": "4096 16384 4194304",
    }
    advice = tcp_advice(defaults.get)
    assert len(advice) == 3
    assert "sysctl -w net.ipv4.tcp_slow_start_after_idle=0" in advice[0]
    assert "at most 6.0 MiB" in advice[1] and "'4096 131072 33554432'" in advice[1]
    assert "net.ipv4.tcp_wmem='4096 16384 33554432'" in advice[2]
    tuned = {
        "net.ipv4.tcp_slow_start_after_idle": "0",
        "net.ipv4.tcp_rmem": "4096 131072 33554432",
        "net.ipv4.tcp_wmem": "4096 16384 67108864",
    }
    assert tcp_advice(tuned.get) == []
    assert tcp_advice(lambda name: None) == []  # unreadable (not Linux): nothing to say
    # Real files: the reader maps dotted names to /proc/sys paths.
    (tmp_path / "net" / "ipv4").mkdir(parents=True)
    (tmp_path / "net" / "ipv4" / "tcp_slow_start_after_idle").write_text("1\n")
    assert read_sysctl("net.ipv4.tcp_slow_start_after_idle", tmp_path) == "1"
    assert read_sysctl("net.ipv4.tcp_rmem", tmp_path) is None


def test_log_format_json_prints_every_line_as_one_object(tmp_path, capsys, monkeypatch):
    """--log-format json: a site's errors, warnings, log records and progress lines,
    each one JSON object a line with time, level, logger, site, rank, message."""
    import json
    import logging

    from isthmus.training import log_format

    for variable in (log_format.LOG_FORMAT, log_format.LOG_SITE):
        # setenv first: monkeypatch then puts back what was there (nothing) after
        # the command sets them itself; delenv of an absent variable records nothing.
        monkeypatch.setenv(variable, "")
        monkeypatch.delenv(variable)
    for handler in logging.getLogger().handlers:  # the JSON formatter stays in this test
        monkeypatch.setattr(handler, "formatter", handler.formatter)
    job = write(tmp_path, MULTI_NODE)
    code, out, err = cli(capsys, "site", str(job), "--site", "nowhere", "--log-format", "json")
    assert code == 2 and out == ""
    (error,) = [json.loads(line) for line in err.splitlines()]
    assert error["level"] == "ERROR" and error["site"] == "nowhere" and error["rank"] == 0
    assert "has no site 'nowhere'" in error["message"] and error["time"].endswith("+00:00")
    # The choice travels to the ranks torchrun starts (they read it at their start).
    assert os.environ[log_format.LOG_FORMAT] == "json"
    log_format.say("round 3, loss 2.5", prefix="eu-west: ", stream=sys.stdout, record="round")
    progress = json.loads(capsys.readouterr().out)
    assert progress["message"] == "round 3, loss 2.5" and progress["record"] == "round"
    record = logging.LogRecord(
        "isthmus.inter.peer", logging.WARNING, "", 0, "refused: %s", ("x",), None
    )
    logged = json.loads(log_format.JsonLines().format(record))
    assert (logged["level"], logged["logger"], logged["message"]) == (
        "WARNING",
        "isthmus.inter.peer",
        "refused: x",
    )
    # Text stays as it was.
    monkeypatch.setenv(log_format.LOG_FORMAT, "text")
    code, _, err = cli(capsys, "site", str(job), "--site", "nowhere")
    assert err.startswith("isthmus site: error: --site: the job 'clusters' has no site")


def test_only_the_first_node_of_a_site_prints_its_progress(monkeypatch):
    from isthmus.deploy.launch.cluster_site import prints_progress

    job = parse_job(MULTI_NODE)
    east, west = job.sites
    assert prints_progress(west, None)  # one node: it is the first
    for variable in ("SLURM_NODEID", "JOB_COMPLETION_INDEX"):
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setenv("SLURM_NODEID", "1")
    assert not prints_progress(east, "gpu17:29400")
    monkeypatch.setenv("SLURM_NODEID", "0")
    assert prints_progress(east, "gpu17:29400")
    monkeypatch.delenv("SLURM_NODEID")
    monkeypatch.setenv("JOB_COMPLETION_INDEX", "2")
    assert not prints_progress(east, "pod-0.svc:29400")
    monkeypatch.delenv("JOB_COMPLETION_INDEX")
    # Without a scheduler's word: the node the rendezvous endpoint names.
    assert prints_progress(east, "127.0.0.1:29400")
    assert not prints_progress(east, "192.0.2.7:29400")  # TEST-NET: not this machine


@pytest.mark.slow
@needs_mosquitto
def test_a_site_whose_peer_never_answers_ends_with_one_line_and_no_traceback(tmp_path):
    """Its gRPC server used to be left to the garbage collector after the error, which
    then scheduled its shutdown on a closed loop: a traceback under the one line."""
    broker = Mosquitto(tmp_path).start()
    base = free_port_block(2)
    job = write(
        tmp_path,
        f"""\
        name: lonely
        sites:
          - {{name: a, ranks: 1, address: 127.0.0.1:{base}}}
          - {{name: b, ranks: 1, address: 127.0.0.1:{base + 1}}}
        train: {{strategy: diloco, steps: 4, sync_every: 2, round_deadline_s: 3,
                 collective_timeout_s: 2}}
        control: {{broker: mqtt://127.0.0.1:{broker.port}}}
        """,
    )
    try:
        done = subprocess.run(
            [*ISTHMUS, "site", str(job), "--site", "a", "--out", str(tmp_path / "a")],
            capture_output=True,
            text=True,
            timeout=120,
        )
    finally:
        broker.stop()
    errors = [line for line in done.stderr.splitlines() if not line.startswith("warning:")]
    assert done.returncode == 1, done.stderr
    assert errors == [
        f"isthmus site: error: site 'b': peer 127.0.0.1:{base + 1} did not answer within 3 s "
        "(down, partitioned, or the address is wrong); what must be open: "
        f"isthmus site {job} --site a --print-ports"
    ], done.stderr
