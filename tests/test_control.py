"""The control plane against real brokers: Mosquitto (started here) and the embedded amqtt.

Retained status and Last Will across a SIGKILL, live settings applied by every
site at the same round, a broker restart mid-run, malformed messages, TLS to
Mosquitto with a CA made here, and the commands.
"""

from __future__ import annotations

import asyncio
import dataclasses
import getpass
import json
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from needs import MOSQUITTO, needs_mosquitto
from test_cli import in_process

from isthmus.deploy.launch.broker import EmbeddedBroker
from isthmus.inter.control_plane import Broker, ControlPlane
from isthmus.inter.control_topics import (
    config_topic,
    decode,
    encode,
    parse_config,
    site_of,
    status_topic,
)
from isthmus.job.settings import TrainSettings
from isthmus.training.records import RecordTail, read_records


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(predicate, timeout: float = 10.0, what: str = "condition") -> float:
    started = time.monotonic()
    while time.monotonic() - started < timeout:
        if predicate():
            return time.monotonic() - started
        time.sleep(0.02)
    raise AssertionError(f"{what} not reached in {timeout} s")


class Mosquitto:
    """A real Mosquitto on a loopback port, restartable on the same port."""

    def __init__(
        self, folder: Path, tls: dict[str, Path] | None = None, client_certs: bool = False
    ) -> None:
        self.port = free_port()
        self.config = folder / "mosquitto.conf"
        lines = [f"listener {self.port} 127.0.0.1", "allow_anonymous true", "persistence false"]
        # Started as root, Mosquitto switches to its own user, which cannot read
        # the test's private key in a private temporary folder: stay who we are.
        lines.append(f"user {getpass.getuser()}")
        if tls:
            lines += [f"cafile {tls['ca']}", f"certfile {tls['cert']}", f"keyfile {tls['key']}"]
        if client_certs:  # mutual TLS: a client is who its certificate names
            lines += ["require_certificate true", "use_identity_as_username true"]
        self.config.write_text("\n".join(lines) + "\n")
        self.proc: subprocess.Popen | None = None

    def start(self) -> Mosquitto:
        assert MOSQUITTO is not None
        self.proc = subprocess.Popen(
            [MOSQUITTO, "-c", str(self.config)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        wait_until(self._listening, what="mosquitto listening")
        return self

    def _listening(self) -> bool:
        with socket.socket() as s:
            return s.connect_ex(("127.0.0.1", self.port)) == 0

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)

    @property
    def address(self) -> Broker:
        return Broker("127.0.0.1", self.port)


@pytest.fixture(params=["mosquitto", "embedded"])
def broker(request, tmp_path) -> Iterator[Broker]:
    if request.param == "mosquitto":
        if MOSQUITTO is None:
            pytest.skip(needs_mosquitto.kwargs["reason"])
        server = Mosquitto(tmp_path).start()
        yield server.address
        server.stop()
    else:
        with EmbeddedBroker() as embedded:
            yield embedded.address


def test_an_embedded_broker_that_cannot_start_says_why_in_one_line():
    """Seen on a bare GPU machine (an amqtt plugin's dependency missing): isthmus run
    ended in a traceback. A port already taken fails amqtt the same way, for real."""
    import socket

    from isthmus.deploy.launch.broker import BrokerStartError

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(BrokerStartError) as refused:
            EmbeddedBroker(port=port).start()
    message = str(refused.value)
    assert f"127.0.0.1:{port}" in message and "control.broker" in message
    assert "\n" not in message


def publish(broker: Broker, topic: str, payload: bytes, retain: bool = True) -> None:
    async def send() -> None:
        async with broker.client(f"test-{time.time_ns()}") as client:
            await client.publish(topic, payload, qos=1, retain=retain)

    asyncio.run(send())


# -- messages ------------------------------------------------------------------------
def test_config_messages_are_checked_against_the_settings():
    current = TrainSettings()
    ok = parse_config({"settings": {"sync_every": 20}, "from_round": 3, "version": 2}, current)
    assert not isinstance(ok, str) and ok.from_round == 3 and ok.settings == {"sync_every": 20}
    for message, reason in [
        ({"settings": {"sync_every": 0}, "from_round": 1}, "train.sync_every: must be"),
        ({"settings": {"codec": "int3"}, "from_round": 1}, "train.codec: unknown codec"),
        ({"settings": {"steps": 5}, "from_round": 1}, "cannot change while running"),
        ({"settings": {}, "from_round": 1}, "non-empty object"),
        ({"settings": {"sync_every": 5}, "from_round": -1}, "'from_round' must be"),
        ({"settings": {"sync_every": 5}, "from_round": 1, "protocol": 9}, "protocol 9"),
        # null is a job file's "the strategy's default", filled in before the run: a
        # running strategy cannot take it (it had crashed every site at once).
        ({"settings": {"codec": None}, "from_round": 1}, "need a value while running"),
    ]:
        refused = parse_config(message, current)
        assert isinstance(refused, str) and reason in refused, (message, refused)
    assert decode(b"\xff") == "not UTF-8"
    assert "not JSON" in decode(b"{oops")
    assert "not a JSON object" in decode(b"[1]")
    assert site_of("isthmus/j/sites/a/status", "j") == ("status", "a")
    assert site_of("isthmus/j/metrics/b", "j") == ("metrics", "b")
    assert site_of("isthmus/other/metrics/b", "j") is None


# -- against both brokers --------------------------------------------------------------
def test_retained_status_reaches_late_joiners_and_clean_exit_says_offline(broker):
    status = {"ranks": 2, "address": "127.0.0.1:7100"}
    with ControlPlane(broker, "j", "a", status=status).start(wait_s=10) as a:
        a.update_status(step=7, round=1)
        with ControlPlane(broker, "j", None).start(wait_s=10) as observer:
            wait_until(lambda: observer.peers.get("a", {}).get("step") == 7, what="retained status")
            assert observer.peers["a"]["state"] == "online"
            assert observer.peers["a"]["ranks"] == 2
            assert observer.peers["a"]["address"] == "127.0.0.1:7100"
            assert observer.peers["a"]["protocol"] == 1
            a.close()
            wait_until(lambda: observer.peers["a"]["state"] == "offline", what="offline")


@needs_mosquitto
def test_a_clean_exit_is_the_last_word_at_the_broker(tmp_path):
    """A site's goodbye (offline, retained) must be the last status the broker
    keeps: neither a status update still in flight at close (it landed after the
    goodbye, and the gone site read as online) nor the Last Will (the status from
    connect time; after the DISCONNECT that close sends, mosquitto drops it, and
    amqtt, the embedded broker, now and then does not: the membership guards
    against that, tests/test_membership.py)."""
    server = Mosquitto(tmp_path).start()
    try:
        with ControlPlane(server.address, "j", None).start(wait_s=10) as observer:
            for attempt in range(10):
                site = ControlPlane(server.address, "j", f"s{attempt}").start(wait_s=10)
                site.update_status(step=100 + attempt)
                site.close()
                wait_until(
                    lambda a=attempt: observer.peers.get(f"s{a}", {}).get("state") == "offline",
                    what="goodbye",
                )
                time.sleep(0.2)  # a Will would follow within this
                assert observer.peers[f"s{attempt}"].get("step") == 100 + attempt
    finally:
        server.stop()


SITE_SCRIPT = """
import sys, time
from isthmus.inter.control_plane import Broker, ControlPlane
plane = ControlPlane(Broker("127.0.0.1", int(sys.argv[1])), "j", "victim", status={"ranks": 1})
plane.start(wait_s=10)
print("up", flush=True)
time.sleep(600)
"""


def test_a_killed_site_is_offline_for_everyone_by_its_last_will(broker):
    site = subprocess.Popen(
        [sys.executable, "-c", SITE_SCRIPT, str(broker.port)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert site.stdout is not None and site.stdout.readline().strip() == "up"
        with ControlPlane(broker, "j", None).start(wait_s=10) as observer:
            wait_until(lambda: observer.peers.get("victim", {}).get("state") == "online")
            site.send_signal(signal.SIGKILL)
            # The target (<= 2 s) is measured by benchmarks/control_plane.py.
            wait_until(
                lambda: observer.peers["victim"]["state"] == "offline",
                timeout=10,
                what="Last Will",
            )
    finally:
        site.kill()
        site.wait()
    # Retained: a client that connects later learns it too.
    with ControlPlane(broker, "j", None).start(wait_s=10) as later:
        wait_until(lambda: later.peers.get("victim", {}).get("state") == "offline")


def test_malformed_and_refused_messages_are_ignored_and_counted(broker):
    with ControlPlane(broker, "j", "a").start(wait_s=10) as plane:
        good = {"settings": {"sync_every": 10}, "from_round": 2, "version": 1}
        publish(broker, config_topic("j"), encode(good))
        wait_until(lambda: plane.config is not None and plane.config.version == 1)
        for payload in (b"not json", b"[1, 2]", encode({"settings": {"sync_every": -3}})):
            publish(broker, config_topic("j"), payload, retain=False)
        publish(broker, status_topic("j", "b"), encode({"state": "sleepy"}), retain=False)
        wait_until(lambda: plane.ignored >= 4, what="four ignored messages")
        assert plane.config.settings == {"sync_every": 10}  # nothing bad applied
        assert plane.changes_due(1) == {}
        assert plane.changes_due(2) == {"sync_every": 10}
        assert plane.changes_due(3) == {}  # once


@pytest.mark.slow
def test_a_run_whose_broker_is_unreachable_stops_and_names_it(tmp_path):
    port = free_port()
    job = tmp_path / "j.yaml"
    job.write_text(
        "name: j\nsites: [{name: a}, {name: b}]\ntrain: {steps: 4, sync_every: 2}\n"
        f"control: {{broker: 'mqtt://127.0.0.1:{port}', wait_s: 0.5}}\n"
    )
    done = isthmus("run", str(job), "--out", str(tmp_path / "run"), "--no-report", cwd=tmp_path)
    assert done.returncode == 1
    assert f"no MQTT broker answered at mqtt://127.0.0.1:{port}" in done.stderr
    assert "Traceback" not in done.stderr


def test_an_unreachable_broker_is_named():
    port = free_port()
    plane = ControlPlane(Broker("127.0.0.1", port), "j", "a")
    with pytest.raises(ConnectionError, match=f"mqtt://127.0.0.1:{port}"):
        plane.start(wait_s=0.5)


# -- Mosquitto only ------------------------------------------------------------------
@needs_mosquitto
def test_a_broker_restart_mid_run_is_survived_and_status_republished(tmp_path):
    server = Mosquitto(tmp_path).start()
    try:
        with ControlPlane(server.address, "j", "a", status={"ranks": 1}).start(wait_s=10) as a:
            a.update_status(step=3, round=1)
            server.stop()  # persistence off: the retained status is gone with it
            wait_until(lambda: not a.connected.is_set(), what="disconnect seen")
            a.update_status(step=4, round=1)  # training goes on meanwhile
            a.publish_metrics(round=1, step=4, loss=1.0)
            assert a.unsent_metrics == 1
            server.start()
            wait_until(lambda: a.connections >= 2, timeout=20, what="reconnection")
            with ControlPlane(server.address, "j", None).start(wait_s=10) as observer:
                wait_until(lambda: observer.peers.get("a", {}).get("step") == 4)
    finally:
        server.stop()


def make_tls_files(folder: Path) -> dict[str, Path]:
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.skip("openssl is not installed")
    ca_key, ca, key, csr, cert = (
        folder / n for n in ("ca.key", "ca.crt", "s.key", "s.csr", "s.crt")
    )
    ext = folder / "ext.cnf"
    ext.write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    for command in (
        [openssl, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
         "-subj", "/CN=isthmus-test-ca", "-keyout", ca_key, "-out", ca],
        [openssl, "req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=localhost",
         "-keyout", key, "-out", csr],
        [openssl, "x509", "-req", "-in", csr, "-CA", ca, "-CAkey", ca_key, "-CAcreateserial",
         "-days", "2", "-out", cert, "-extfile", ext],
    ):  # fmt: skip
        subprocess.run([str(c) for c in command], check=True, capture_output=True)
    return {"ca": ca, "cert": cert, "key": key}


@needs_mosquitto
def test_tls_to_mosquitto_with_a_test_ca(tmp_path):
    files = make_tls_files(tmp_path)
    server = Mosquitto(tmp_path, tls=files).start()
    try:
        secure = Broker("127.0.0.1", server.port, tls_ca=str(files["ca"]))
        assert secure.url.startswith("mqtts://")
        with ControlPlane(secure, "j", "a").start(wait_s=10) as plane:
            assert plane.connected.is_set()
        # Without the CA the server's certificate is not trusted: no connection.
        with pytest.raises(ConnectionError):
            ControlPlane(Broker("127.0.0.1", server.port), "j", "b").start(wait_s=1.5)
    finally:
        server.stop()


@needs_mosquitto
def test_mosquitto_with_the_jobs_certificates_admits_its_sites_and_nobody_else(tmp_path):
    from isthmus.deploy.render.certs import make_certs
    from isthmus.job.file import parse_job

    certs, other = tmp_path / "certs", tmp_path / "other"
    make_certs("j", ["a", "b"], certs, broker=["127.0.0.1"])
    make_certs("k", ["a"], other)  # another job's CA
    broker_files = {
        "ca": certs / "ca.crt",
        "cert": certs / "broker.crt",
        "key": certs / "broker.key",
    }
    server = Mosquitto(tmp_path, tls=broker_files, client_certs=True).start()
    job = parse_job(
        "name: j\nsites: [{name: a}, {name: b}]\n"
        f"control: {{broker: 'mqtts://127.0.0.1:{server.port}', tls: {{ca: '{certs}/ca.crt', "
        f"cert: '{certs}/{{site}}.crt', key: '{certs}/{{site}}.key'}}}}\n"
    )
    assert job.control is not None
    try:
        site_a = job.control.broker_for("a")
        assert site_a.tls_cert == str(certs / "a.crt")
        with ControlPlane(site_a, "j", "a").start(wait_s=10) as plane:
            assert plane.connected.is_set()
        operator = job.control.broker_for(None)  # isthmus config set
        assert operator.tls_cert == str(certs / "operator.crt")
        with ControlPlane(operator, "j", None).start(wait_s=10) as plane:
            assert plane.connected.is_set()
        no_cert = Broker("127.0.0.1", server.port, tls_ca=str(certs / "ca.crt"))
        with pytest.raises(ConnectionError):
            ControlPlane(no_cert, "j", "b").start(wait_s=2)
        stranger = dataclasses.replace(
            no_cert, tls_cert=str(other / "a.crt"), tls_key=str(other / "a.key")
        )
        with pytest.raises(ConnectionError):
            ControlPlane(stranger, "j", "a").start(wait_s=2)
        missing = dataclasses.replace(no_cert, tls_cert="/nope.crt", tls_key="/nope.key")
        with pytest.raises(ConnectionError, match="cannot load the TLS files"):
            ControlPlane(missing, "j", "a").start(wait_s=2)
    finally:
        server.stop()


@needs_mosquitto
def test_job_file_names_a_tls_broker(tmp_path):
    from isthmus.job.file import parse_job

    files = make_tls_files(tmp_path)
    text = (
        "name: j\nsites: [{name: a}]\n"
        f"control: {{broker: 'mqtts://127.0.0.1:8883', username: '{{site}}', "
        f"password_env: NOPE_UNSET, tls: {{ca: '{files['ca']}'}}}}\n"
    )
    spec = parse_job(text).control
    assert spec is not None
    broker = spec.broker_for("a")
    assert broker.username == "a" and broker.tls_ca == str(files["ca"])


# -- end to end: isthmus run, config set, watch ------------------------------------------
JOB = """\
name: ctl
sites: [{name: a}, {name: b}, {name: c}]
wan: {default: {rtt_ms: 10, bandwidth_mbit: 500}}
train: {strategy: diloco, steps: 100000, sync_every: 4, warmup_steps: 2}
"""


def isthmus(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "isthmus", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["embedded", pytest.param("mosquitto", marks=needs_mosquitto)])
def test_config_set_is_applied_by_every_site_at_the_same_round(tmp_path, kind):
    """3 sites under isthmus run; with Mosquitto (named in the job file) the broker
    is also restarted mid-run: training goes on and every site is back online."""
    job = tmp_path / "ctl.yaml"
    server = Mosquitto(tmp_path).start() if kind == "mosquitto" else None
    control = f"control: {{broker: 'mqtt://127.0.0.1:{server.port}'}}\n" if server else ""
    job.write_text(JOB + control)
    out = tmp_path / "run"
    run = subprocess.Popen(
        [sys.executable, "-m", "isthmus", "run", str(job), "--out", str(out), "--no-report"],
        cwd=tmp_path,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        tails = {s: RecordTail(out / "sites" / s / "metrics.jsonl") for s in "abc"}
        seen: dict[str, list[dict]] = {s: [] for s in "abc"}

        def rounds_done(count: int) -> bool:
            for site, tail in tails.items():
                seen[site] += tail.read()
            return all(sum(r["kind"] == "round" for r in seen[s]) >= count for s in "abc")

        wait_until(lambda: rounds_done(2), timeout=120, what="two rounds")
        watched = isthmus("watch", str(job), "--once", "2", cwd=tmp_path)
        assert watched.returncode == 0, watched.stderr
        assert all(f" {s} " in watched.stdout for s in "abc") and "online" in watched.stdout
        done = isthmus("config", "set", str(job), "sync_every=2", "codec=int8", cwd=tmp_path)
        assert done.returncode == 0, done.stderr
        assert "published config v1: sync_every=2, codec=int8 from outer round" in done.stdout
        wait_until(
            lambda: (
                rounds_done(0) and all(any(r["kind"] == "config" for r in seen[s]) for s in "abc")
            ),
            timeout=120,
            what="config applied everywhere",
        )
        wait_until(lambda: rounds_done(0) and _rounds_after_config(seen) >= 2, timeout=60)
        if server is not None:
            server.stop()
            before = {s: sum(r["kind"] == "round" for r in seen[s]) for s in "abc"}
            wait_until(
                lambda: (
                    rounds_done(0)
                    and all(
                        sum(r["kind"] == "round" for r in seen[s]) >= before[s] + 2 for s in "abc"
                    )
                ),
                timeout=60,
                what="rounds while the broker is down",
            )
            server.start()  # persistence off: every retained status was lost with it
            with ControlPlane(server.address, "ctl", None).start(wait_s=10) as observer:
                wait_until(
                    lambda: all(observer.peers.get(s, {}).get("state") == "online" for s in "abc"),
                    timeout=30,
                    what="sites re-published their status",
                )
    finally:
        run.send_signal(signal.SIGINT)
        run.communicate(timeout=60)
        if server is not None:
            server.stop()
    applied = {s: next(r for r in seen[s] if r["kind"] == "config") for s in "abc"}
    assert len({(r["round"], r["step"]) for r in applied.values()}) == 1, applied
    assert applied["a"]["settings"] == {"sync_every": 2, "codec": "int8"}
    # From then on every site syncs every 2 steps.
    for site in "abc":
        steps = [r["step"] for r in seen[site] if r["kind"] == "round"]
        after = [s for s in steps if s > applied[site]["step"]]
        assert after[:2] == [applied[site]["step"] + 2, applied[site]["step"] + 4]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "interrupted"
    # The run's description: the change with its round, once, and the final values.
    (change,) = summary["live_changes"]
    assert (change["round"], change["step"]) == (applied["a"]["round"], applied["a"]["step"])
    assert change["settings"] == {"sync_every": 2, "codec": "int8"}
    assert change["sites"] == ["a", "b", "c"]
    assert summary["settings"]["sync_every"] != 2
    assert (summary["final_settings"]["sync_every"], summary["final_settings"]["codec"]) == (
        2,
        "int8",
    )
    assert not (tmp_path / "ctl.control.json").exists()  # removed with the run
    assert any(r["kind"] == "config" for r in read_records(out / "metrics.jsonl"))


def _rounds_after_config(seen: dict[str, list[dict]]) -> int:
    counts = []
    for records in seen.values():
        config = next((r for r in records if r["kind"] == "config"), None)
        if config is None:
            return 0
        counts.append(sum(r["kind"] == "round" and r["step"] > config["step"] for r in records))
    return min(counts)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["steps=5"], "steps: not a live setting"),
        (["sync_every=0"], "train.sync_every: must be an integer >= 1"),
        (["codec=int3"], "train.codec: unknown codec 'int3'"),
        (["sync_every"], "write settings as key=value"),
    ],
)
def test_config_set_refuses_bad_settings_before_publishing(
    tmp_path, capsys, monkeypatch, args, message
):
    job = tmp_path / "ctl.yaml"
    job.write_text(JOB)
    monkeypatch.chdir(tmp_path)
    code, _, stderr = in_process(
        capsys, "config", "set", str(job), *args, "--broker", "mqtt://127.0.0.1:1"
    )
    assert code == 2 and message in stderr, stderr


def test_commands_without_a_broker_say_where_they_looked(tmp_path, capsys, monkeypatch):
    job = tmp_path / "ctl.yaml"
    job.write_text(JOB)
    monkeypatch.chdir(tmp_path)
    code, _, stderr = in_process(capsys, "watch", str(job), "--once", "1")
    assert code == 2
    assert "no broker for job 'ctl'" in stderr and "ctl.control.json" in stderr
