"""Ranks forked from the warm template (isthmus.deploy.launch.warm_start) behave as
fresh interpreters would: their own session, log, environment, thread count and
random state, their exit status (a signal's as its negative number), atexit
handlers and non-daemon threads honoured, and the template gone with its
launcher. Whole runs through the template: test_run.py and every other job test."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import warm_popen

from isthmus.deploy.launch.warm_start import RankTemplate

WORKERS = Path(__file__).parent / "workers"


@pytest.fixture
def template(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", f"{WORKERS}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    warm = RankTemplate(tmp_path, tmp_path / "template.log")
    yield warm
    warm.close()


def _spawn(template, tmp_path, name, *args, **env):
    out = tmp_path / f"{name}.json"
    rank = template.spawn(
        [str(out), *args], {**os.environ, **env}, tmp_path / f"{name}.log", module="warm_probe"
    )
    return rank, out


def test_a_forked_rank_is_what_a_fresh_interpreter_would_be(template, tmp_path):
    ranks = [
        _spawn(template, tmp_path, f"r{i}", PROBE=f"rank {i}", OMP_NUM_THREADS=str(i + 1))
        for i in range(2)
    ]
    reports = []
    for i, (rank, out) in enumerate(ranks):
        assert rank.wait(60) == 0 and rank.poll() == 0
        report = json.loads(out.read_text())
        reports.append(report)
        assert report["pid"] == rank.pid == report["pgid"] == report["sid"]  # its own session
        assert report["probe_env"] == f"rank {i}" and report["omp"] == str(i + 1)
        assert report["threads"] == i + 1  # OMP_NUM_THREADS, as at a fresh start
        assert report["name"] == "__main__" and report["argv"][1:] == [str(out)]
        assert report["cwd"] == os.getcwd()
        log = (tmp_path / f"r{i}.log").read_text()
        assert "probe says hello" in log and "probe's error line" in log
        assert out.with_suffix(".atexit").read_text() == "ran"
    assert reports[0]["random"] != reports[1]["random"]  # not the template's state


def test_exit_statuses_reach_the_launcher_as_popen_would_give_them(template, tmp_path):
    code, _ = _spawn(template, tmp_path, "code", "--exit", "3")
    raised, _ = _spawn(template, tmp_path, "raised", "--raise")
    waiting, _ = _spawn(template, tmp_path, "waiting", "--wait")
    threaded, _ = _spawn(template, tmp_path, "threaded", "--thread")
    assert code.wait(60) == 3
    assert raised.wait(60) == 1
    assert "ValueError: the probe's own exception" in (tmp_path / "raised.log").read_text()
    assert threaded.wait(60) == 0
    assert "thread done" in (tmp_path / "threaded.log").read_text()
    with pytest.raises(subprocess.TimeoutExpired):
        waiting.wait(0.2)
    assert waiting.poll() is None
    os.killpg(waiting.pid, signal.SIGKILL)  # as the launcher stops a site
    assert waiting.wait(60) == -signal.SIGKILL


def test_the_template_and_its_ranks_end_when_the_launcher_is_killed(tmp_path):
    # A launcher of its own, killed with SIGKILL while a rank runs.
    script = f"""
import os, sys, time, pathlib
sys.path[:0] = [{str(WORKERS)!r}, {str(WORKERS.parent.parent / "benchmarks")!r}]
os.environ["PYTHONPATH"] = {str(WORKERS)!r}
import warm_popen
from isthmus.deploy.launch.warm_start import RankTemplate
t = RankTemplate(pathlib.Path({str(tmp_path)!r}), pathlib.Path({str(tmp_path / "t.log")!r}))
r = t.spawn([{str(tmp_path / "w.json")!r}, "--wait"], dict(os.environ),
            pathlib.Path({str(tmp_path / "w.log")!r}), module="warm_probe")
print(t.proc.pid, r.pid, flush=True)
time.sleep(600)
"""
    launcher = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert launcher.stdout is not None
    template_pid, rank_pid = map(int, launcher.stdout.readline().split())
    launcher.kill()
    launcher.wait()
    deadline = time.monotonic() + 30
    while _alive(template_pid) or _alive(rank_pid):
        assert time.monotonic() < deadline, "the template or its rank outlived the launcher"
        time.sleep(0.2)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        status = Path(f"/proc/{pid}/stat").read_text().split()[2]
    except FileNotFoundError:  # gone between the two looks
        return False
    return status != "Z"


def test_popen_forks_python_commands_and_gives_their_output_as_popen_would(tmp_path):
    probe = WORKERS / "warm_probe.py"
    out = tmp_path / "p.json"
    proc = warm_popen.popen(
        [sys.executable, str(probe), str(out), "--exit", "4"],
        env={**os.environ, "PROBE": "warm"},
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert isinstance(proc, warm_popen.WarmProcess)
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 4
    assert stdout == "probe says hello\n" and stderr == "probe's error line\n"
    report = json.loads(out.read_text())
    # As `python SCRIPT`: the script's folder first on sys.path, __main__, its cwd.
    assert report["path0"] == str(WORKERS) and report["name"] == "__main__"
    assert report["cwd"] == str(tmp_path) and report["probe_env"] == "warm"
    # Both streams to one file, bytes; and nothing captured at all.
    joined = warm_popen.popen(
        [sys.executable, str(probe), str(out)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    both, nothing = joined.communicate(timeout=60)
    assert both == b"probe says hello\nprobe's error line\n" and nothing is None
    quiet = warm_popen.popen(
        [sys.executable, str(probe), str(out)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    assert quiet.communicate(timeout=60) == (None, None) and quiet.returncode == 0


def test_popen_starts_other_commands_as_plain_processes(tmp_path, monkeypatch):
    plain = warm_popen.popen(["true"])
    assert isinstance(plain, subprocess.Popen) and plain.wait(30) == 0
    # A stream to inherit cannot be handed to a forked process as Popen hands it.
    inherit = warm_popen.popen(
        [sys.executable, str(WORKERS / "warm_probe.py"), str(tmp_path / "i")]
    )
    assert isinstance(inherit, subprocess.Popen) and inherit.wait(60) == 0
    monkeypatch.setenv("ISTHMUS_WARM_START", "0")
    fresh = warm_popen.popen([sys.executable, str(WORKERS / "warm_probe.py"), str(tmp_path / "p")])
    assert isinstance(fresh, subprocess.Popen) and fresh.wait(60) == 0


def test_a_package_run_with_dash_m_and_a_signal_death_are_as_fresh(tmp_path):
    # python -m PACKAGE runs its __main__ once, its __init__ once.
    pkg = tmp_path / "probe_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("import os\nprint('init', os.getpid())\n")
    (pkg / "__main__.py").write_text("import probe_pkg, sys\nprint('main'); sys.exit(3)\n")
    proc = warm_popen.popen(
        [sys.executable, "-m", "probe_pkg"],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 3 and out.count("init") == 1 and "main" in out
    # An uncaught KeyboardInterrupt ends it by SIGINT, as it would a fresh interpreter.
    script = tmp_path / "interrupt.py"
    script.write_text("raise KeyboardInterrupt\n")
    stopped = warm_popen.popen(
        [sys.executable, str(script)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    assert isinstance(stopped, warm_popen.WarmProcess)
    assert stopped.wait(60) == -signal.SIGINT
