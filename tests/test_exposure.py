"""Secure unless told otherwise: a job dialled across a network needs TLS between its
sites and to its broker, or says ``insecure: true`` (isthmus.job.exposure)."""

from __future__ import annotations

import getpass
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import yaml
from needs import MOSQUITTO, needs_mosquitto

from isthmus.deploy.cli import main
from isthmus.deploy.launch.run_dir import PASSWORD_VARIABLE, RunError, resolve_job, resume_point
from isthmus.deploy.launch.run_state import RunState, SiteState
from isthmus.deploy.launch.summary import build_summary
from isthmus.job.exposure import exposed_sites, insecure_warning, on_this_machine, unprotected
from isthmus.job.file import JobFileError, parse_job
from isthmus.job.ports import free_port

ACROSS = """\
name: clusters
sites:
  - {name: us-east, ranks: 2, address: 0.0.0.0:7100, advertise: 203.0.113.7:7100}
  - {name: eu-west, ranks: 1, address: 0.0.0.0:7100, advertise: eu.example.com:7100}
control: {broker: mqtt://broker.example.com:1883}
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "job.yaml"
    path.write_text(textwrap.dedent(text))
    return path


def cli(capsys, *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.mark.parametrize(
    ("host", "local"),
    [
        ("127.0.0.1", True),
        ("127.8.9.10", True),
        ("localhost", True),
        ("::1", True),
        ("0.0.0.0", True),  # dialling the wildcard address reaches this host
        ("10.213.0.7", True),  # an emulated host of `isthmus wan up --hosts`
        ("10.214.0.7", False),
        ("192.168.1.5", False),  # a private network is still a network
        ("203.0.113.7", False),
        ("eu.example.com", False),
        ("2001:db8::1", False),
    ],
)
def test_what_counts_as_this_machine(host, local):
    assert on_this_machine(host) is local


def test_jobs_on_this_machine_need_nothing():
    for text in [
        "name: x\nsites: [{name: a}, {name: b}]\n",
        "name: x\nsites: [{name: a, address: '127.0.0.1:7100'}, {name: b, address: "
        "'127.0.0.1:7200'}]\ncontrol: {broker: mqtt://127.0.0.1:1883}\n",
        "name: x\nsites: [{name: a, address: '10.213.0.1:7100'}, {name: b, address: "
        "'10.213.0.2:7100'}]\n",
    ]:
        job = parse_job(text, require_tls=True)
        assert unprotected(job) == [] and insecure_warning(job) is None
        assert exposed_sites(job) == []


def test_a_job_across_a_network_without_tls_is_refused_naming_the_fields_and_the_command():
    with pytest.raises(JobFileError) as caught:
        parse_job(ACROSS, source="job.yaml", require_tls=True)
    lines = caught.value.lines()
    assert len(lines) == 2, lines
    tls, broker = lines
    assert tls.startswith("job.yaml: tls: sites[0].advertise is dialled at 203.0.113.7")
    assert "isthmus certs JOB.yaml --out certs" in tls and "insecure: true" in tls
    assert broker.startswith("job.yaml:5: control.broker:")
    assert "mqtt://broker.example.com:1883 in plaintext" in broker
    assert "--broker broker.example.com" in broker
    # The loader alone (isthmus certs, render) reads it as it is.
    assert parse_job(ACROSS).tls is None


def test_a_site_dialled_by_name_or_a_remote_broker_alone_is_across_a_network():
    by_name = "name: x\nsites: [{name: a}, {name: b, address: 'gpu7.lab:7100'}]\n"
    (problem,) = unprotected(parse_job(by_name))
    assert problem[0] == "tls" and "sites[1].address is dialled at gpu7.lab" in problem[1]
    remote_broker = (
        "name: x\nsites: [{name: a}, {name: b}]\ncontrol: {broker: mqtt://10.0.0.9:1883}\n"
    )
    fields = [field for field, _ in unprotected(parse_job(remote_broker))]
    assert fields == ["tls", "control.broker"]


def test_tls_everywhere_is_accepted(tmp_path):
    text = ACROSS.replace("mqtt://broker.example.com:1883", "mqtts://broker.example.com:8883") + (
        "  \n"
    )
    text = text.replace(
        "control: {broker: mqtts://broker.example.com:8883}",
        "control:\n  broker: mqtts://broker.example.com:8883\n  tls: {ca: certs/ca.pem}",
    )
    text += "tls: {ca: certs/ca.pem, cert: 'certs/{site}.pem', key: 'certs/{site}.key'}\n"
    job = parse_job(text, check_files=False)
    assert unprotected(job) == [] and insecure_warning(job) is None


def test_insecure_true_runs_with_a_warning_and_a_wrong_value_is_refused():
    job = parse_job(ACROSS + "insecure: true\n", require_tls=True)
    warning = insecure_warning(job)
    assert warning is not None
    assert "without TLS between sites and to the broker mqtt://broker.example.com:1883" in warning
    with pytest.raises(JobFileError, match=r"insecure: must be true or false, got 'yes'"):
        parse_job(ACROSS + "insecure: 'yes'\n")
    # On this machine there is nothing to warn of.
    local = parse_job("name: x\nsites: [{name: a}, {name: b}]\ninsecure: true\n")
    assert insecure_warning(local) is None


def test_check_site_and_run_refuse_and_say_why(tmp_path, capsys):
    job = write(tmp_path, ACROSS)
    for args in (
        ["check", str(job)],
        ["site", str(job), "--site", "us-east", "--print-ports"],
        ["run", str(job), "--out", str(tmp_path / "run")],
    ):
        code, out, err = cli(capsys, *args)
        assert code == 2, (args, out, err)
        assert "tls: sites[0].advertise is dialled at 203.0.113.7" in err, err
        assert "control.broker:" in err
    assert not (tmp_path / "run").exists()  # refused before anything is made


def test_check_and_site_warn_when_the_job_says_insecure(tmp_path, capsys):
    job = write(tmp_path, ACROSS + "insecure: true\n")
    code, out, err = cli(capsys, "check", str(job))
    assert code == 0 and "job 'clusters'" in out
    assert "warning: job 'clusters' runs without TLS between sites" in err
    code, out, _ = cli(capsys, "site", str(job), "--site", "eu-west", "--print-ports")
    assert code == 0 and "7100" in out


def test_the_summary_records_a_run_without_tls_across_a_network(tmp_path):
    def summary_of(text: str) -> dict:
        job = parse_job(text)
        sites = {s.name: SiteState(name=s.name, ranks=s.ranks) for s in job.sites}
        return build_summary(RunState(job=job, run_dir=tmp_path, started=time.time(), sites=sites))

    assert summary_of(ACROSS + "insecure: true\n")["insecure"] is True
    assert summary_of("name: x\nsites: [{name: a}, {name: b}]\n")["insecure"] is False


SECRET = "s3cret-Broker-pw-7f1c"


def test_an_inline_broker_password_is_kept_out_of_the_resolved_job(tmp_path, monkeypatch):
    monkeypatch.delenv(PASSWORD_VARIABLE, raising=False)
    job_file = write(
        tmp_path,
        "name: x\nsites: [{name: a}, {name: b}]\n"
        f"control: {{broker: mqtt://127.0.0.1:1883, username: u, password: {SECRET}}}\n",
    )
    job, raw = resolve_job(job_file)
    assert SECRET not in yaml.safe_dump(raw) and SECRET not in repr(job)
    assert raw["control"]["password_env"] == PASSWORD_VARIABLE
    assert job.control is not None and job.control.broker_for("a").password == SECRET
    # A resumed run needs the variable again, and says so.
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "job.yaml").write_text(yaml.safe_dump(raw))
    monkeypatch.delenv(PASSWORD_VARIABLE)
    with pytest.raises(RunError, match=f"set {PASSWORD_VARIABLE} to it"):
        resume_point(run_dir)


@pytest.mark.slow
@needs_mosquitto
def test_a_run_with_a_broker_password_leaves_it_in_no_file_and_no_output(tmp_path, monkeypatch):
    """A real Mosquitto that admits no one without the password: the run finishes (so
    every site process logged in with it), and the secret is in no file of the run
    directory and nowhere in what the command printed."""
    monkeypatch.delenv(PASSWORD_VARIABLE, raising=False)
    passwords = tmp_path / "passwords"
    subprocess.run(["mosquitto_passwd", "-b", "-c", str(passwords), "isthmus", SECRET], check=True)
    port = free_port()
    config = tmp_path / "mosquitto.conf"
    config.write_text(
        f"listener {port} 127.0.0.1\nallow_anonymous false\npassword_file {passwords}\n"
        f"persistence false\nuser {getpass.getuser()}\n"
    )
    broker = subprocess.Popen(
        [MOSQUITTO, "-c", str(config)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        job = write(
            tmp_path,
            "name: guarded\nsites: [{name: a}, {name: b}]\n"
            "wan: {default: {rtt_ms: 10, bandwidth_mbit: 500}}\n"
            "train: {strategy: diloco, steps: 4, sync_every: 2, warmup_steps: 1}\n"
            f"control: {{broker: 'mqtt://127.0.0.1:{port}', username: isthmus, "
            f"password: {SECRET}, wait_s: 10}}\n",
        )
        out = tmp_path / "run"
        run = subprocess.run(
            [sys.executable, "-m", "isthmus", "run", str(job), "--out", str(out), "--no-report"],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=300,
        )
    finally:
        broker.terminate()
        broker.wait(10)
    assert run.returncode == 0, run.stdout + run.stderr
    assert SECRET not in run.stdout + run.stderr
    leaks = [p for p in out.rglob("*") if p.is_file() and SECRET.encode() in p.read_bytes()]
    assert leaks == []
