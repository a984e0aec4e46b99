"""A real single-host Slurm for the tests: munged, slurmctld and one slurmd per fake node.

Debian's ``slurm-wlm`` and ``munge`` (``scripts/test.sh`` installs them as root). Every daemon
runs in the foreground as a child of the test, with its own ``slurm.conf`` in a
temporary folder (``SLURM_CONF``), state and spool there too, on free ports,
and is stopped after the test. Several ``slurmd`` on one host stand for several
nodes (``slurmd -N NAME``, each its own port); all of them are this host,
which is what lets a site "on two nodes" run here.
"""

from __future__ import annotations

import getpass
import os
import socket
import subprocess
import time
from pathlib import Path

from needs import program

DAEMONS = ("slurmctld", "slurmd", "munged", "sbatch", "scontrol")


def missing() -> str | None:
    """Why Slurm cannot run here, or None."""
    paths = {name: program(name) for name in DAEMONS}
    absent = [name for name, path in paths.items() if path is None]
    if absent:
        return (
            f"needs Slurm: {', '.join(absent)} not installed; run as root: bash scripts/test.sh "
            "(it installs slurm-wlm and munge with apt)"
        )
    if os.geteuid() != 0:
        return "needs Slurm: the tests' daemons run as root; run the suite as root"
    return None


def _free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


class SlurmCluster:
    """``nodes`` fake nodes of ``cpus`` CPUs each, in one partition."""

    def __init__(self, folder: Path, nodes: int = 1, cpus: int = 2) -> None:
        self.folder = folder
        self.nodes = [f"node{i + 1}" for i in range(nodes)]
        self.cpus = cpus
        self.procs: list[subprocess.Popen] = []
        self.conf = folder / "slurm.conf"
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}

    # -- up and down -----------------------------------------------------------------------
    def start(self) -> SlurmCluster:
        for sub in ("state", "spool", "munge", "logs"):
            (self.folder / sub).mkdir(parents=True, exist_ok=True)
        self._start_munge()
        ctld_port, *node_ports = _free_ports(1 + len(self.nodes))
        host = socket.gethostname().split(".")[0]
        nodes = "\n".join(
            f"NodeName={name} NodeHostname={host} NodeAddr=127.0.0.1 Port={port} "
            f"CPUs={self.cpus} RealMemory=1000 State=UNKNOWN"
            for name, port in zip(self.nodes, node_ports, strict=True)
        )
        user = getpass.getuser()
        f = self.folder
        self.conf.write_text(
            f"""\
ClusterName=isthmus-test
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmUser={user}
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={f}/munge/munge.socket
CryptoType=crypto/munge
StateSaveLocation={f}/state
SlurmdSpoolDir={f}/spool/%n
SlurmctldPidFile={f}/slurmctld.pid
SlurmdPidFile={f}/slurmd-%n.pid
SlurmctldLogFile={f}/logs/slurmctld.log
SlurmdLogFile={f}/logs/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/affinity
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/builtin
ReturnToService=2
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SlurmdTimeout=60
InactiveLimit=0
KillWait=5
{nodes}
PartitionName=test Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
"""
        )
        self._spawn("slurmctld", "-D", "-i", "-f", str(self.conf))
        for name in self.nodes:
            (self.folder / "spool" / name).mkdir(exist_ok=True)
            self._spawn("slurmd", "-D", "-N", name, "-f", str(self.conf))
        self._wait_idle()
        return self

    def _start_munge(self) -> None:
        key = self.folder / "munge" / "munge.key"
        if not key.exists():
            key.write_bytes(os.urandom(1024))
            key.chmod(0o400)
        self._spawn(
            "munged",
            "--foreground",
            "--force",
            f"--key-file={key}",
            f"--socket={self.folder}/munge/munge.socket",
            f"--pid-file={self.folder}/munge/munged.pid",
            f"--log-file={self.folder}/logs/munged.log",
            f"--seed-file={self.folder}/munge/munged.seed",
        )
        deadline = time.monotonic() + 10
        while not (self.folder / "munge" / "munge.socket").exists():
            if time.monotonic() > deadline:
                raise RuntimeError(f"munged did not start: {self.log('munged')}")
            time.sleep(0.05)

    def _spawn(self, daemon: str, *args: str) -> None:
        path = program(daemon)
        assert path is not None
        log = open(self.folder / "logs" / f"{daemon}.out", "ab")  # noqa: SIM115 - the child's
        self.procs.append(
            subprocess.Popen([path, *args], env=self.env, stdout=log, stderr=subprocess.STDOUT)
        )

    def _wait_idle(self, timeout_s: float = 60) -> None:
        deadline = time.monotonic() + timeout_s
        states = ""
        while time.monotonic() < deadline:
            for proc in self.procs:
                if proc.poll() is not None:
                    raise RuntimeError(f"{proc.args[0]} exited {proc.returncode}:\n{self.logs()}")
            done = self.run("sinfo", "-h", "-N", "-o", "%N %t", check=False)
            states = done.stdout
            ready = [line for line in states.splitlines() if line.split()[-1:] == ["idle"]]
            if len(ready) == len(self.nodes):
                return
            time.sleep(0.3)
        raise RuntimeError(f"the nodes did not come up: {states}\n{self.logs()}")

    def stop(self) -> None:
        for proc in reversed(self.procs):
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    # -- using it ----------------------------------------------------------------------------
    def run(self, *command: str, check: bool = True, **kwargs) -> subprocess.CompletedProcess:
        path = program(command[0]) or command[0]
        env = {**self.env, **kwargs.pop("env", {})}
        return subprocess.run(
            [path, *command[1:]], env=env, capture_output=True, text=True, check=check, **kwargs
        )

    def submit(self, script: Path, *, cwd: Path, env: dict[str, str]) -> int:
        """``sbatch SCRIPT`` from ``cwd`` (as the docs tell an operator); the job's id."""
        done = self.run("sbatch", "--parsable", str(script), cwd=cwd, env=env)
        return int(done.stdout.strip().split(";")[0])

    def wait(self, job_ids: list[int], timeout_s: float) -> dict[int, str]:
        """Each job's final state (COMPLETED, FAILED, ...)."""
        final = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"}
        deadline = time.monotonic() + timeout_s
        states: dict[int, str] = {}
        while time.monotonic() < deadline:
            for job in job_ids:
                done = self.run("scontrol", "-o", "show", "job", str(job), check=False)
                for field in done.stdout.split():
                    if field.startswith("JobState="):
                        states[job] = field.split("=", 1)[1]
            if len(states) == len(job_ids) and all(s in final for s in states.values()):
                return states
            time.sleep(1)
        raise TimeoutError(f"jobs still running after {timeout_s:g} s: {states}\n{self.logs()}")

    def log(self, daemon: str) -> str:
        path = self.folder / "logs" / f"{daemon}.out"
        return path.read_text(errors="replace")[-3000:] if path.exists() else ""

    def logs(self) -> str:
        parts = []
        for path in sorted((self.folder / "logs").glob("*")):
            parts.append(f"--- {path.name}\n{path.read_text(errors='replace')[-2000:]}")
        return "\n".join(parts)
