"""The packet-level backend: sites as separate hosts (network namespaces) behind the router.

Needs root and network namespaces; skipped with the reason where they are missing.
Everything is driven through the command line, as an operator would.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from test_cli import in_process

from isthmus.sim.hosts import HostsUnavailable, check_support

try:
    check_support()
    UNSUPPORTED = None
except HostsUnavailable as exc:
    UNSUPPORTED = str(exc)

pytestmark = [
    pytest.mark.root,
    pytest.mark.serial,  # rates and round trips of the emulated hosts: alone on the machine
    pytest.mark.skipif(UNSUPPORTED is not None, reason=UNSUPPORTED or ""),
]

ISTHMUS = [sys.executable, "-m", "isthmus"]

# A tiny TCP tool run inside the hosts: an echo/sink server, and a client that
# measures round trips or bulk throughput.
TOOL = textwrap.dedent(
    """
    import socket, sys, time
    mode, host = sys.argv[1], sys.argv[2]
    if mode == "serve":
        s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((host, 9000)); s.listen(8); print("listening", flush=True)
        while True:
            c, _ = s.accept()
            kind = c.recv(1)
            if kind == b"e":
                while d := c.recv(65536): c.sendall(d)
            else:
                n, t0 = 0, None
                while d := c.recv(1 << 20):
                    t0 = t0 or time.perf_counter(); n += len(d)
                c.sendall(f"{n} {time.perf_counter() - (t0 or 0)}".encode())
            c.close()
    elif mode == "rtt":
        s = socket.create_connection((host, 9000), timeout=float(sys.argv[3]))
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1); s.sendall(b"e")
        out = []
        for _ in range(8):
            t = time.perf_counter(); s.sendall(b"x" * 32); s.recv(64)
            out.append((time.perf_counter() - t) * 1e3)
        print(sorted(out)[4])
    else:
        s = socket.create_connection((host, 9000), timeout=30); s.sendall(b"s")
        end = time.perf_counter() + float(sys.argv[3]); block = bytes(1 << 20)
        while time.perf_counter() < end: s.sendall(block)
        s.shutdown(socket.SHUT_WR); n, el = s.recv(100).split()
        print(int(n) * 8 / float(el) / 1e6)
    """
)


class Hosts:
    """``isthmus wan up --hosts`` of a job, and commands run inside its hosts."""

    def __init__(self, tmp: Path, job_text: str, *flags: str) -> None:
        self.job = tmp / "job.yaml"
        self.job.write_text(job_text)
        self.state = tmp / "state.json"
        self.tool = tmp / "tool.py"
        self.tool.write_text(TOOL)
        self.proc = subprocess.Popen(
            [*ISTHMUS, "wan", "up", str(self.job), "--hosts", "--state", str(self.state), *flags],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stdout is not None
        lines = []
        while line := self.proc.stdout.readline():
            lines.append(line)
            if line.startswith("ready"):
                break
        else:
            raise AssertionError(
                "".join(lines) + (self.proc.stderr.read() if self.proc.stderr else "")
            )
        self.sites = json.loads(self.state.read_text())["sites"]
        self.servers: list[subprocess.Popen] = []

    def address(self, site: str) -> str:
        return self.sites[site]["address"]

    def run(self, site: str, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
        return subprocess.run(
            [*ISTHMUS, "wan", "exec", str(self.job), site, "--", *args],
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    def serve(self, site: str) -> None:
        proc = subprocess.Popen(
            [
                *ISTHMUS,
                "wan",
                "exec",
                str(self.job),
                site,
                "--",
                sys.executable,
                str(self.tool),
                "serve",
                self.address(site),
            ],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert proc.stdout is not None and proc.stdout.readline().startswith("listening")
        self.servers.append(proc)

    def tool_run(self, site: str, *args: str, timeout: float = 60) -> str:
        result = self.run(site, sys.executable, str(self.tool), *args, timeout=timeout)
        assert result.returncode == 0, result.stderr
        return result.stdout.strip()

    def control(self, *args: str) -> None:
        result = subprocess.run(
            [*ISTHMUS, "wan", *args[:1], str(self.job), *args[1:], "--state", str(self.state)],
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert result.returncode == 0, result.stderr

    def stop(self, sig: int = signal.SIGTERM) -> str:
        for server in self.servers:
            server.kill()
        self.proc.send_signal(sig)
        out, _ = self.proc.communicate(timeout=30)
        return out


def _namespaces() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


THREE = "name: {name}\nsites: [{{name: a}}, {{name: b}}, {{name: c}}]\nwan:\n  default: {{rtt_ms: 40, bandwidth_mbit: 100}}\n"


@pytest.mark.slow
def test_hosts_reach_each_other_only_through_the_links(tmp_path):
    hosts = Hosts(tmp_path, THREE.format(name="reach"))
    try:
        hosts.serve("b")
        rtt = float(hosts.tool_run("a", "rtt", hosts.address("b"), "10"))
        assert 39 <= rtt <= 60
        # Each host has only its own address; the machine's loopback services
        # and anything outside the hosts' subnet are unreachable.
        addrs = hosts.run("a", "ip", "-4", "-o", "addr").stdout
        assert hosts.address("a") in addrs and hosts.address("b") not in addrs
        outside = hosts.run(
            "a",
            sys.executable,
            "-c",
            "import socket; socket.create_connection(('192.0.2.1', 80), timeout=1)",
        )
        assert outside.returncode != 0
        mbit = float(hosts.tool_run("a", "bulk", hosts.address("b"), "4"))
        assert 60 <= mbit <= 105
    finally:
        out = hosts.stop()
    assert "link a<->b (up):" in out
    assert not {n for n in _namespaces() if n.startswith("isthmus-reach-")}


def test_hosts_tcp_receive_buffer_is_set_by_the_flag(tmp_path):
    default = Hosts(tmp_path, THREE.format(name="rmem"))
    try:
        assert default.run("a", "sysctl", "-n", "net.ipv4.tcp_rmem").stdout.split() == [
            "4096",
            "131072",
            str(32 * 2**20),
        ]
    finally:
        default.stop()
    capped = Hosts(tmp_path, THREE.format(name="rmem"), "--tcp-rmem-max", "2500000")
    try:
        for site in "abc":
            rmem = capped.run(site, "sysctl", "-n", "net.ipv4.tcp_rmem").stdout.split()
            assert rmem == ["4096", "131072", "2500000"]
        # Sending buffers keep their limit: the cap is on what a host lets arrive.
        wmem = capped.run("a", "sysctl", "-n", "net.ipv4.tcp_wmem").stdout.split()
        assert wmem[2] == str(32 * 2**20)
    finally:
        capped.stop()


def test_tcp_receive_buffer_flag_is_checked(tmp_path, capsys):
    job = tmp_path / "job.yaml"
    job.write_text(THREE.format(name="rmemflag"))
    for flags, expected in (
        ((), "--tcp-rmem-max: sets the emulated hosts' TCP; add --hosts"),
        (("--hosts",), "--tcp-rmem-max: must be >= 65536 bytes, got 1000"),
    ):
        code, _, stderr = in_process(
            capsys, "wan", "up", str(job), *flags, "--tcp-rmem-max", "1000"
        )
        assert code == 2 and expected in stderr, stderr


@pytest.mark.slow
def test_partition_blocks_traffic_and_heals(tmp_path):
    hosts = Hosts(tmp_path, THREE.format(name="cut"))
    try:
        hosts.serve("b")
        hosts.control("cut", "a", "b")
        blocked = hosts.run("a", sys.executable, str(hosts.tool), "rtt", hosts.address("b"), "2")
        assert blocked.returncode != 0  # the connection attempt times out
        hosts.control("heal", "a", "b")
        assert float(hosts.tool_run("a", "rtt", hosts.address("b"), "10")) < 80
    finally:
        hosts.stop()


def _retransmits(hosts: Hosts, site: str) -> int:
    snmp = hosts.run(site, "cat", "/proc/net/snmp").stdout.splitlines()
    names, values = [line.split() for line in snmp if line.startswith("Tcp:")][:2]
    return int(values[names.index("RetransSegs")])


@pytest.mark.slow
def test_loss_makes_real_tcp_retransmit(tmp_path):
    hosts = Hosts(
        tmp_path,
        "name: lossy\nsites: [{name: a}, {name: b}]\n"
        "wan:\n  default: {rtt_ms: 10, bandwidth_mbit: 100, loss: 0.01}\n",
    )
    try:
        hosts.serve("b")
        before = _retransmits(hosts, "a")
        hosts.tool_run("a", "bulk", hosts.address("b"), "2")
        assert _retransmits(hosts, "a") - before > 10
    finally:
        out = hosts.stop()
    lost = [line for line in out.splitlines() if line.strip().startswith("a->b")]
    assert lost and " 0 lost" not in lost[0]


def test_leftovers_of_a_killed_router_are_removed_by_the_next_up(tmp_path):
    job = "name: kill\nsites: [{name: a}, {name: b}]\nwan:\n  default: {rtt_ms: 5}\n"
    hosts = Hosts(tmp_path, job)
    hosts.stop(signal.SIGKILL)
    assert {"isthmus-kill-a", "isthmus-kill-b"} <= _namespaces()  # left behind by SIGKILL
    again = Hosts(tmp_path, job)
    try:
        assert again.address("a")
    finally:
        again.stop()
    time.sleep(0.2)
    assert not {n for n in _namespaces() if n.startswith("isthmus-kill-")}


def test_exec_without_running_hosts_is_refused(tmp_path, capsys):
    job = tmp_path / "job.yaml"
    job.write_text("name: none\nsites: [{name: a}, {name: b}]\nwan: {}\n")
    code, _, stderr = in_process(capsys, "wan", "exec", str(job), "a", "--", "true")
    assert code == 2 and "no host for site 'a'" in stderr
