"""``isthmus run JOB -- CMD`` and ``isthmus site JOB --site NAME -- CMD``: the
launchers start the user's command as every rank, with torchrun's variables and
the launcher's ``ISTHMUS_*``, and say why a site whose command never joins or
fails did not train.

The commands here never train: they sleep, exit or write their environment, so
each test takes seconds, not a training run.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from isthmus.deploy.cli import main
from isthmus.job.file import free_port_blocks

ROOT = Path(__file__).resolve().parents[1]
TWO_SITES = ROOT / "deploy" / "examples" / "two-sites.yaml"
ISTHMUS = [sys.executable, "-m", "isthmus"]

# Writes the variables a launcher sets to ENV_DIR/SITE-RANK.json, and exits 0.
WRITE_ENV = textwrap.dedent(
    """\
    import json, os, sys
    names = ["RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"]
    env = {k: v for k, v in os.environ.items() if k.startswith("ISTHMUS_") or k in names}
    where = os.path.join(sys.argv[1], f"{env['ISTHMUS_SITE']}-{env['RANK']}.json")
    with open(where, "w") as f:
        json.dump(env, f)
    """
)


def run_cli(*args: str, cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*ISTHMUS, *args], cwd=cwd, capture_output=True, text=True, timeout=timeout
    )


def written_env(env_dir: Path) -> dict[str, dict[str, str]]:
    return {p.stem: json.loads(p.read_text()) for p in sorted(env_dir.glob("*.json"))}


# -- the command line -------------------------------------------------------------------


def test_run_help_shows_the_command_after_the_double_dash(capsys):
    with pytest.raises(SystemExit):
        main(["run", "--help"])
    out = capsys.readouterr().out
    assert "-- CMD" in out and "--join-timeout" in out and "isthmus.join()" in out


def test_everything_after_the_first_double_dash_is_the_command_whole():
    from isthmus.deploy.cli import build_parser

    argv = ["run", "job.yaml", "--steps", "2", "--", "python", "t.py", "--steps", "3", "--", "x"]
    args = build_parser().parse_args(argv)
    assert args.job == "job.yaml" and args.steps == 2
    assert args.command == ["python", "t.py", "--steps", "3", "--", "x"]
    assert build_parser().parse_args(["run", "job.yaml"]).command is None


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--join-timeout", "0"], "--join-timeout: must be > 0 seconds"),
        (["--"], "--: name the command every rank runs"),
    ],
)
def test_a_bad_command_or_join_timeout_is_refused(tmp_path, capsys, flags, message):
    out = tmp_path / "run"
    code = main(["run", str(TWO_SITES), "--out", str(out), *flags])
    assert code == 2 and message in capsys.readouterr().err
    assert not out.exists()


@pytest.mark.parametrize(
    ("given", "ran"),
    [([], ["python", "train.py"]), (["--", "python", "new.py"], ["python", "new.py"])],
)
def test_a_resumed_run_runs_its_own_command_unless_given_another(tmp_path, monkeypatch, given, ran):
    from isthmus.deploy.cli import run as run_cli_module
    from isthmus.deploy.launch import run_dir
    from isthmus.deploy.launch.run_dir import save_command, saved_command

    assert saved_command(tmp_path) is None  # a run from before commands were kept
    save_command(tmp_path, ["python", "train.py"])
    calls = []
    monkeypatch.setattr(run_dir, "resume_point", lambda path: ("job", {}, 3))
    monkeypatch.setattr(
        run_cli_module,
        "run_job",
        lambda *args, **options: calls.append(options) or {"status": "finished"},
    )
    assert main(["run", "--resume", str(tmp_path), *given]) == 0
    assert calls[0]["command"] == ran and calls[0]["resume_round"] == 3


# -- isthmus run ------------------------------------------------------------------------


@pytest.mark.slow
def test_a_command_that_never_joins_fails_its_site_naming_the_fix(tmp_path):
    started = time.monotonic()
    proc = run_cli(
        "run", str(TWO_SITES), "--steps", "2", "--join-timeout", "5", "--out", str(tmp_path / "r"),
        "--", sys.executable, "-c", "import time; time.sleep(60)",
        cwd=tmp_path,
    )  # fmt: skip
    assert time.monotonic() - started < 30, proc.stdout + proc.stderr
    assert proc.returncode == 1, proc.stderr
    assert "site us-east failed: the command never called isthmus.join() in 5 s" in proc.stderr
    assert f"rank 0 log: {tmp_path / 'r' / 'logs' / 'us-east-r0.log'}" in proc.stderr
    assert "or raise --join-timeout" in proc.stderr
    summary = json.loads((tmp_path / "r" / "summary.json").read_text())
    assert summary["command"][1:] == ["-c", "import time; time.sleep(60)"]
    assert summary["status"] == "failed"


@pytest.mark.slow
def test_a_command_that_exits_non_zero_is_named_with_its_site_rank_and_log(tmp_path):
    proc = run_cli(
        "run", str(TWO_SITES), "--steps", "2", "--out", str(tmp_path / "r"),
        "--", sys.executable, "-c", "print('bad flag --lr'); raise SystemExit(3)",
        cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 1, proc.stderr
    log = tmp_path / "r" / "logs" / "eu-west-r0.log"
    assert f"site eu-west failed: rank 0 exit status 3: bad flag --lr (log: {log})" in proc.stderr


@pytest.mark.slow
def test_every_rank_sees_its_job_site_and_rank_and_one_that_never_joins_fails(tmp_path):
    script = tmp_path / "write_env.py"
    script.write_text(WRITE_ENV)
    env_dir = tmp_path / "env"
    env_dir.mkdir()
    out = tmp_path / "r"
    proc = run_cli(
        "run", str(TWO_SITES), "--steps", "2", "--out", str(out),
        "--", sys.executable, str(script), str(env_dir),
        cwd=tmp_path,
    )  # fmt: skip
    seen = written_env(env_dir)
    assert sorted(seen) == ["eu-west-0", "us-east-0", "us-east-1"], proc.stderr
    run_dir = out.resolve()
    for name, env in seen.items():
        site, rank = name.rsplit("-", 1)
        ranks = "2" if site == "us-east" else "1"
        assert env["ISTHMUS_SITE"] == site and env["RANK"] == env["LOCAL_RANK"] == rank
        assert env["WORLD_SIZE"] == env["LOCAL_WORLD_SIZE"] == ranks
        assert env["ISTHMUS_JOB"] == str(run_dir / "job.yaml")
        assert env["ISTHMUS_RUN_DIR"] == str(run_dir)
        assert env["ISTHMUS_WAN_STATE"] == str(run_dir / "wan.json")  # the job emulates a WAN
        assert "ISTHMUS_REJOIN" not in env and "ISTHMUS_RESUME_ROUND" not in env
    assert seen["us-east-0"]["MASTER_PORT"] == seen["us-east-1"]["MASTER_PORT"]
    # Exit 0 without joining is no success: nothing trained.
    assert proc.returncode == 1
    assert "site us-east failed: the command exited without calling isthmus.join()" in proc.stderr


# -- isthmus site -----------------------------------------------------------------------


def site_job(tmp_path: Path) -> Path:
    """Site a of two ranks, site b of one, on loopback; the broker is never dialled
    (the commands do not join)."""
    base = free_port_blocks("127.0.0.1", [3])[0]
    job = tmp_path / "job.yaml"
    job.write_text(
        textwrap.dedent(
            f"""\
            name: clusters
            sites:
              - {{name: a, ranks: 2, address: 127.0.0.1:{base}}}
              - {{name: b, ranks: 1, address: 127.0.0.1:{base + 2}}}
            control: {{broker: mqtt://127.0.0.1:1883}}
            """
        )
    )
    return job


def test_a_one_rank_site_runs_the_command_with_its_environment(tmp_path, capsys):
    job = site_job(tmp_path)
    script = tmp_path / "write_env.py"
    script.write_text(WRITE_ENV + "raise SystemExit(5)\n")
    env_dir = tmp_path / "env"
    env_dir.mkdir()
    out = tmp_path / "out"
    command = [sys.executable, str(script), str(env_dir)]
    code = main(["site", str(job), "--site", "b", "--out", str(out), "--rejoin", "--", *command])
    assert code == 5  # the command's own exit status
    env = written_env(env_dir)["b-0"]
    assert env["ISTHMUS_SITE"] == "b" and env["RANK"] == "0" and env["WORLD_SIZE"] == "1"
    assert env["ISTHMUS_JOB"] == str(out.resolve() / "job.yaml")
    assert env["ISTHMUS_RUN_DIR"] == str(out.resolve()) and env["ISTHMUS_REJOIN"] == "1"
    assert (out / "job.yaml").is_file()  # resolved for the script to read


@pytest.mark.slow
@pytest.mark.parametrize("under_torchrun", [False, True])
def test_a_multi_rank_site_runs_the_command_as_every_rank(tmp_path, under_torchrun):
    """Through the torchrun ``isthmus site`` starts (``--no-python``), or under the
    user's own, where each rank becomes the command."""
    job = site_job(tmp_path)
    script = tmp_path / "write_env.py"
    script.write_text(WRITE_ENV)
    env_dir = tmp_path / "env"
    env_dir.mkdir()
    out = tmp_path / "out"
    site = ["site", str(job), "--site", "a", "--out", str(out)]
    site += ["--", sys.executable, str(script), str(env_dir)]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    torchrun += ["--nproc-per-node", "2", "-m", "isthmus"]
    command = [*torchrun, *site] if under_torchrun else [*ISTHMUS, *site]
    proc = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    seen = written_env(env_dir)
    assert sorted(seen) == ["a-0", "a-1"]
    for rank, env in enumerate(seen.values()):
        assert env["ISTHMUS_SITE"] == "a" and env["RANK"] == str(rank)
        assert env["WORLD_SIZE"] == "2" and env["ISTHMUS_RUN_DIR"] == str(out.resolve())
