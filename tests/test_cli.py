"""The ``isthmus`` command as a user runs it: help, usage errors, and the wan commands."""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest

from isthmus._version import __version__
from isthmus.deploy.cli import build_parser, main
from isthmus.inter import allocator
from isthmus.sim.probe import measure_rtt_ms

ISTHMUS = [sys.executable, "-m", "isthmus"]


def run(*args: str, timeout: float = 60, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*ISTHMUS, *args], capture_output=True, text=True, timeout=timeout, cwd=cwd
    )


def in_process(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    """``isthmus ARGS`` run by :func:`main` in this process, without the 2-5 s of a fresh
    interpreter: its exit status, stdout and stderr. Argparse's exits (``--help``,
    usage errors) become their status; log records reach stderr formatted as
    ``main``'s ``logging.basicConfig`` formats them in a process of its own (here the
    root logger already has pytest's handlers, so that call does nothing). The root
    logger, the signal handlers (an asyncio loop's ``add_signal_handler`` leaves the
    defaults behind) and the environment (torch's first use of inductor sets
    TORCHINDUCTOR_CACHE_DIR) are put back as they were."""
    signals = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    environ = dict(os.environ)
    root = logging.getLogger()
    handler = logging.StreamHandler(sys.stderr)  # capsys's stderr, at this moment
    handler.setFormatter(logging.Formatter("isthmus: %(levelname)s: %(message)s"))
    level = root.level
    root.addHandler(handler)
    root.setLevel(logging.DEBUG if "-v" in args or "--verbose" in args else logging.INFO)
    try:
        code = main(list(args))
    except SystemExit as exc:
        code = 0 if exc.code is None else exc.code
    finally:
        root.removeHandler(handler)
        root.setLevel(level)
        for sig, previous in signals.items():
            signal.signal(sig, previous)
        for name in os.environ.keys() - environ.keys():
            del os.environ[name]
        os.environ.update(environ)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _all_commands(parser: argparse.ArgumentParser, prefix: tuple[str, ...] = ()):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield (*prefix, name)
                yield from _all_commands(sub, (*prefix, name))


COMMANDS = list(_all_commands(build_parser()))


def test_version():
    """The one check of ``python -m isthmus`` itself (the entry point, in a process of
    its own); every other command line here runs in this process."""
    result = run("--version")
    assert result.returncode == 0
    assert result.stdout.strip() == f"isthmus {__version__}"


@pytest.mark.parametrize("command", [(), *COMMANDS], ids=lambda c: " ".join(c) or "isthmus")
def test_every_command_has_help(capsys, command):
    code, out, err = in_process(capsys, *command, "--help")
    assert code == 0, err
    assert "usage: isthmus" in out


HEAVY_AT_HELP = """
import sys
from isthmus.deploy.cli import main
try:
    main(sys.argv[1:])
except SystemExit:
    pass
heavy = sorted(m for m in ("torch", "grpc") if m in sys.modules)
print("heavy:", heavy, file=sys.stderr)
"""


@pytest.mark.parametrize("command", [(), *COMMANDS], ids=lambda c: " ".join(c) or "isthmus")
def test_help_imports_neither_torch_nor_grpc(command):
    """``--help`` is the first thing a newcomer runs: it must not wait for torch and
    gRPC to load (commands import what they run inside their handlers)."""
    result = subprocess.run(
        [sys.executable, "-c", HEAVY_AT_HELP, *command, "--help"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert "usage: isthmus" in result.stdout, result.stderr
    assert result.stderr.strip().splitlines()[-1] == "heavy: []", result.stderr


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        ((), "required: COMMAND"),
        (("frobnicate",), "invalid choice: 'frobnicate'"),
        (("render", "job.yaml"), "did you mean 'isthmus deploy render'?"),
        (("chek", "job.yaml"), "did you mean 'isthmus check'?"),
        (("wan", "proxy", "--listen", "127.0.0.1:1"), "required: --connect"),
        (
            ("wan", "proxy", "--listen", "nope", "--connect", "127.0.0.1:1"),
            "--listen: must be 'host:port'",
        ),
        (
            (
                "wan",
                "proxy",
                "--listen",
                "127.0.0.1:1",
                "--connect",
                "127.0.0.1:2",
                "--rtt-ms",
                "-5",
            ),
            "--rtt-ms: must be a number >= 0",
        ),
        (
            (
                "wan",
                "proxy",
                "--listen",
                "127.0.0.1:1",
                "--connect",
                "127.0.0.1:2",
                "--loss",
                "1.5",
            ),
            "--loss: must be a fraction",
        ),
        (
            (
                "wan",
                "proxy",
                "--listen",
                "127.0.0.1:1",
                "--connect",
                "127.0.0.1:2",
                "--bandwidth-mbit",
                "x",
            ),
            "invalid float value: 'x'",
        ),
        (
            ("wan", "demo", "--jitter-distribution", "gauss"),
            "--jitter-distribution: unknown distribution",
        ),
        (("bench", "wan", "--repeats", "0"), "--repeats: must be >= 1"),
        (("bench", "wan", "--seconds", "0"), "--seconds: must be > 0"),
        (("bench", "allreduce", "--sites", "1"), "--sites: must be in 2..8"),
        (("bench", "allreduce", "--codec", "int3"), "--codec: unknown codec 'int3'"),
        (("bench", "allreduce", "--idle-s", "-1"), "--idle-s: must be in [0, 3600]"),
        (("bench", "allreduce", "--queue-ms", "-5"), "--queue-ms: must be >= 0, got -5"),
        (
            ("bench", "allreduce", "--connections", "0"),
            "--connections: must be auto or a count in 1..16, got '0'",
        ),
        (
            ("bench", "allreduce", "--tcp-rmem-max", "2500000"),
            "--tcp-rmem-max: sets the emulated hosts' TCP; add --hosts",
        ),
        (
            ("bench", "allreduce", "--hosts", "--tcp-rmem-max", "1000"),
            "--tcp-rmem-max: must be >= 65536 bytes, got 1000",
        ),
        (("bench", "codec", "--size-mib", "0"), "--size-mib: must be > 0"),
    ],
)
def test_usage_errors_are_one_line_with_exit_2(capsys, args, expected):
    code, _, err = in_process(capsys, *args)
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert expected in lines[0]


def test_check_names_every_problem_at_once(tmp_path, capsys):
    """Six problems in four sections, two of them in different groups of train:
    six lines, exit 2."""
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        "name: demo\n"
        "sites:\n  - {name: a, ranks: -2}\n  - {name: b}\n"
        "wan:\n  default: {rtt_ms: -1}\n"
        "train:\n  steps: 0\n  codec: int3\n  device: tpu\n"
        "tune:\n  target_utilization: 2\n"
    )
    code, _, err = in_process(capsys, "check", str(bad))
    assert code == 2
    lines = [line for line in err.splitlines() if line.startswith("error: ")]
    fields = ["sites[0].ranks", "wan.default.rtt_ms", "train.steps", "train.codec",
              "train.device", "tune.target_utilization"]  # fmt: skip
    assert len(lines) == 6, err
    for field in fields:
        assert any(f": {field}: " in line for line in lines), (field, err)


def test_check_warns_of_settings_that_cannot_take_effect_and_imports_plugins(tmp_path, capsys):
    job = tmp_path / "job.yaml"
    job.write_text(
        "name: demo\nsites: [{name: a}]\nwan: {default: {preset: transatlantic}}\n"
        "train: {strategy: sync, fragments: 3, steps: 10}\n"
    )
    code, out, err = in_process(capsys, "check", str(job))
    assert code == 0, err
    assert "warning: train.fragments: a setting of streaming; strategy sync does not use it" in err
    assert "warning: wan: a one-site job has no links to emulate" in err
    assert "  train (sync):" in out and max(len(line) for line in out.splitlines()) < 200
    diloco = tmp_path / "diloco.yaml"
    diloco.write_text("name: demo\nsites: [{name: a}, {name: b}]\ntrain: {steps: 10}\n")
    _, _, err = in_process(capsys, "check", str(diloco))
    assert "warning: train.sync_every: 50 is more than steps (10)" in err
    plugin = tmp_path / "plugin.yaml"
    plugin.write_text("name: demo\nsites: [{name: a}, {name: b}]\nmodel: mypkg.nothere:build\n")
    code, _, err = in_process(capsys, "check", str(plugin))
    assert code == 2
    assert "model: cannot import 'mypkg.nothere'" in err


def test_check_into_a_closed_pipe_ends_quietly():
    """`isthmus check JOB | true`: the reader is gone before the first line."""
    import subprocess

    job = Path(__file__).parents[1] / "deploy" / "examples" / "three-continents.yaml"
    done = subprocess.run(
        f"{sys.executable} -m isthmus check {job} | true; echo status=${{PIPESTATUS[0]}}",
        shell=True, executable="/bin/bash", capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert "Traceback" not in done.stderr and "BrokenPipe" not in done.stderr, done.stderr
    assert "status=0" in done.stdout


def test_check_accepts_a_good_job_and_explains_a_bad_one(tmp_path, capsys):
    good = tmp_path / "good.yaml"
    good.write_text(
        "name: demo\nsites: [{name: a, ranks: 2}, {name: b}]\n"
        "wan: {default: {preset: transatlantic}}\n"
    )
    code, out, err = in_process(capsys, "check", str(good))
    assert code == 0, err
    assert "link a<->b: rtt 80 ms" in out
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: demo\nsites:\n  - {name: a, ranks: -2}\n")
    code, _, err = in_process(capsys, "check", str(bad))  # a traceback would raise here
    assert code == 2
    assert f"{bad}:3: sites[0].ranks: must be an integer >= 1" in err
    assert "Traceback" not in err


def _start(*args: str) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen(
        [*ISTHMUS, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None
    lines = []
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        if line.startswith("ready"):
            return proc, "".join(lines)
    proc.kill()
    raise AssertionError(
        f"no ready line: {''.join(lines)} {proc.stderr.read() if proc.stderr else ''}"
    )


def _stop(proc: subprocess.Popen) -> tuple[str, str]:
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=20)
    assert proc.returncode == 0, err
    return out, err


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.serial  # times round trips through the proxy
def test_proxy_runs_until_sigterm_and_prints_its_counters(probe):
    port = _free_port()
    proc, ready = _start(
        "wan",
        "proxy",
        "--listen",
        f"127.0.0.1:{port}",
        "--connect",
        "{}:{}".format(*probe.address),
        "--rtt-ms",
        "30",
    )
    assert "ready: 127.0.0.1" in ready and "rtt 30 ms" in ready
    rtts = measure_rtt_ms(("127.0.0.1", port), count=5)
    out, _ = _stop(proc)
    assert 29 <= statistics.median(rtts) <= 45
    assert "to upstream: bytes=" in out and "connections=1" in out


def test_proxy_refuses_a_port_in_use(probe, capsys, monkeypatch):
    # In this process: leave its malloc as it is (the proxy tunes a process of its own).
    monkeypatch.setattr(allocator, "_applied", False)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        host, port = busy.getsockname()
        code, _, err = in_process(
            capsys, "wan", "proxy", "--listen", f"{host}:{port}", "--connect", "127.0.0.1:9"
        )
    assert code == 2
    assert f"cannot listen on {host}:{port}" in err
    assert "Traceback" not in err


def test_proxy_names_an_unreachable_upstream():
    dead = _free_port()
    port = _free_port()
    proc, _ = _start(
        "wan", "proxy", "--listen", f"127.0.0.1:{port}", "--connect", f"127.0.0.1:{dead}"
    )
    # The proxy closes a client whose upstream it cannot reach; under load its reset
    # can arrive before the client's connect() returns.
    with (
        contextlib.suppress(ConnectionResetError),
        socket.create_connection(("127.0.0.1", port), timeout=5) as sock,
    ):
        sock.sendall(b"hi")
        assert sock.recv(10) == b""
    out, err = _stop(proc)
    assert f"--connect 127.0.0.1:{dead} is not reachable yet" in err
    assert f"upstream 127.0.0.1:{dead} unreachable" in err
    assert "upstream_failures=1" in out


@pytest.mark.slow
def test_wan_up_serves_a_job_and_obeys_control_commands(tmp_path, probe):
    job = tmp_path / "job.yaml"
    host, port = probe.address
    job.write_text(
        "name: ctl\nsites:\n"
        "  - {name: a, ranks: 2}\n"
        f"  - {{name: b, address: '{host}:{port}'}}\n"
        "wan:\n  default: {rtt_ms: 20}\n"
    )
    state = tmp_path / "state.json"
    proc, _ = _start("wan", "up", str(job), "--state", str(state), "--stats-every", "0.2")
    try:
        data = json.loads(state.read_text())
        assert data["sites"]["b"]["listen"] == [f"{host}:{port}"]
        assert len(data["sites"]["b"]["dial"]["a"]) == 2
        dial_host, dial_port = data["sites"]["a"]["dial"]["b"][0].rsplit(":", 1)
        address = (dial_host, int(dial_port))
        assert 19 <= statistics.median(measure_rtt_ms(address, count=3)) < 35

        ctl = ["--state", str(state)]
        assert run("wan", "set", str(job), "a", "b", "rtt_ms=80", *ctl).returncode == 0
        assert 79 <= statistics.median(measure_rtt_ms(address, count=3)) < 95

        bad = run("wan", "set", str(job), "a", "b", "loss=7", *ctl)
        assert bad.returncode == 2 and "loss: must be a fraction" in bad.stderr
        unknown = run("wan", "cut", str(job), "a", "z", *ctl)
        assert unknown.returncode == 2 and "no link between 'a' and 'z'" in unknown.stderr

        second = run("wan", "up", str(job), "--state", str(state))
        assert second.returncode == 2 and "an emulator is already running" in second.stderr

        assert run("wan", "cut", str(job), "a", "b", *ctl).stdout.strip() == "link a<->b: blackhole"
        assert run("wan", "heal", str(job), "a", "b", *ctl).stdout.strip() == "link a<->b: up"
        stats = json.loads(run("wan", "stats", str(job), "--json", *ctl).stdout)
        (link,) = stats["links"]
        assert link["a->b"]["connections"] >= 2 and link["a->b"]["bytes"] > 0
    finally:
        out, _ = _stop(proc)
    assert not state.exists(), "the state file must go when the emulator stops"
    assert "link a<->b (up):" in out
    assert "traffic: a->b" in out


def test_control_commands_without_a_running_emulator(tmp_path, capsys, monkeypatch):
    job = tmp_path / "job.yaml"
    job.write_text("name: idle\nsites: [{name: a}, {name: b}]\nwan: {}\n")
    monkeypatch.chdir(tmp_path)
    code, _, err = in_process(capsys, "wan", "stats", str(job))
    assert code == 2
    assert "no running emulator for job 'idle'" in err
    assert "looked for idle.wan.json ('isthmus wan up') and idle.control.json" in err
    assert len(err.strip().splitlines()) == 1


def test_wan_up_needs_a_wan_section(tmp_path, capsys):
    job = tmp_path / "job.yaml"
    job.write_text("name: plain\nsites: [{name: a}, {name: b}]\n")
    code, _, err = in_process(capsys, "wan", "up", str(job))
    assert code == 2 and "has no 'wan:' section" in err


@pytest.mark.serial  # measures the emulated link's round trip and rate
def test_demo_reports_rtt_and_throughput(capsys):
    code, out, err = in_process(
        capsys,
        "wan",
        "demo",
        "--preset",
        "same-region",
        "--rtt-ms",
        "20",
        "--bandwidth-mbit",
        "50",
        "--seconds",
        "1",
    )
    assert code == 0, err
    assert "round trip: median" in out and "(configured 20 ms" in out
    assert "throughput:" in out and "cap 50 Mbit/s" in out


def test_wan_up_replaces_a_stale_state_file(tmp_path):
    job = tmp_path / "job.yaml"
    job.write_text("name: stale\nsites: [{name: a}, {name: b}]\nwan: {default: {rtt_ms: 5}}\n")
    state = tmp_path / "state.json"
    dead = _free_port()
    state.write_text(json.dumps({"job": "stale", "control": f"127.0.0.1:{dead}", "sites": {}}))
    proc, _ = _start("wan", "up", str(job), "--state", str(state))
    _, err = _stop(proc)
    assert "replacing" in err and "left by an emulator that is gone" in err


def test_wan_commands_find_a_running_isthmus_runs_emulator(tmp_path, monkeypatch):
    """`isthmus wan cut/heal/stats JOB` during `isthmus run JOB`: the run's emulator is
    found through ./JOB.control.json (as `watch` finds the run's broker)."""
    import json

    from isthmus.deploy.cli.wan import _find_state
    from isthmus.job.file import load_job

    monkeypatch.chdir(tmp_path)
    job_file = tmp_path / "job.yaml"
    job_file.write_text("name: found\nsites: [{name: a}, {name: b}]\nwan: {default: {rtt_ms: 5}}\n")
    job = load_job(job_file)
    own = _find_state(job)
    assert not own.exists()  # nothing running: the wan up default, named in the error
    run_dir = tmp_path / "runs" / "r1"
    run_dir.mkdir(parents=True)
    (run_dir / "wan.json").write_text(json.dumps({"control": "127.0.0.1:1"}))
    (tmp_path / "found.control.json").write_text(json.dumps({"run_dir": str(run_dir)}))
    assert _find_state(job) == run_dir / "wan.json"


def test_every_positional_and_flag_has_help():
    import argparse

    missing = []

    def walk(parser: argparse.ArgumentParser, path: str) -> None:
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    walk(sub, f"{path} {name}")
            elif action.help is None:
                missing.append(f"{path} {'/'.join(action.option_strings) or action.dest}")

    walk(build_parser(), "isthmus")
    assert not missing, missing
