"""Sites as separate hosts, in containers, deployed as docs/two-clusters.md tells an
operator to: each site in its own container (its own address on a podman network,
only its own certificate mounted), Mosquitto in a container of its own as the
broker, mutual TLS everywhere with certificates from ``isthmus certs``, and
``isthmus site`` started in each container from the sites' image.

    python benchmarks/container_sites.py [--out DIR] [--kill]

prints the time from ``podman run`` to each site's first training step, the
run's wall time and every site's ``param_sha256``; with ``--kill`` one site's
container is killed (``podman kill``) after its second round and started again
with ``--rejoin``. Needs root and podman (``bash scripts/containers.sh``).
tests/test_containers.py runs both.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from podman import Images, Network, PodmanError, build_images

ISTHMUS = [sys.executable, "-m", "isthmus"]
PORT = 7100
BROKER_PORT = 8883
MOSQUITTO_UID = 1883
SITE_ETC = "/etc/isthmus"
SITE_OUT = "/var/lib/isthmus"
# docs/two-clusters.md's TCP settings, per container (they are per network namespace).
TCP_SETTINGS = (
    "--sysctl", "net.ipv4.tcp_slow_start_after_idle=0",
    "--sysctl", "net.ipv4.tcp_rmem=4096 131072 33554432",
    "--sysctl", "net.ipv4.tcp_wmem=4096 16384 33554432",
)  # fmt: skip


@dataclass
class Outcome:
    digests: dict[str, str]
    """Site -> its result.json's param_sha256."""
    to_training_s: dict[str, float]
    """Site -> seconds from ``podman run`` to its first training step (its first start)."""
    wall_s: float
    logs: dict[str, str]


def write_job(
    folder: Path, net: Network, sites: dict[str, int], train: str, wait_s: float = 30
) -> Path:
    lines = [
        f"  - {{name: {s}, ranks: {ranks}, address: 0.0.0.0:{PORT}, "
        f"advertise: {net.host(s)}:{PORT}}}"
        for s, ranks in sites.items()
    ]
    job = folder / "job.yaml"
    job.write_text(
        "name: containers\nsites:\n" + "\n".join(lines) + "\n" + textwrap.dedent(f"""\
        train: {train}
        tls: {{ca: certs/ca.crt, cert: "certs/{{site}}.crt", key: "certs/{{site}}.key"}}
        control:
          broker: mqtts://{net.host("broker")}:{BROKER_PORT}
          tls: {{ca: certs/ca.crt, cert: "certs/{{site}}.crt", key: "certs/{{site}}.key"}}
          wait_s: {wait_s}
        """)
    )
    return job


def _isthmus(*args: str, cwd: Path) -> None:
    done = subprocess.run([*ISTHMUS, *args], cwd=cwd, capture_output=True, text=True, timeout=120)
    if done.returncode != 0:
        raise RuntimeError(f"isthmus {' '.join(args)}: {done.stderr[-2000:]}")


def prepare(
    folder: Path, net: Network, sites: dict[str, int], train: str, *, wait_s: float = 30
) -> None:
    """The operator's steps 2-4: job file, certificates, the broker's folder, and
    each site's files (the job file and its own certificate only). ``wait_s``: how
    long a site waits for the broker (30: three containers importing torch at once
    on two cores, as in CI)."""
    job = write_job(folder, net, sites, train, wait_s)
    _isthmus("certs", job.name, "--out", "certs", "--broker", net.host("broker"), cwd=folder)
    _isthmus("deploy", "render", job.name, "--target", "slurm", "--out", "deploy", cwd=folder)
    # deploy/broker/README.md: a copy of the folder with certs/ beside the config.
    broker = folder / "broker"
    shutil.copytree(folder / "deploy" / "broker", broker)
    (broker / "certs").mkdir()
    for name in ("ca.crt", "broker.crt", "broker.key"):
        shutil.copy2(folder / "certs" / name, broker / "certs" / name)
    # Mosquitto runs as its own user, which must read the key (and nothing else can).
    for path in [broker, *broker.rglob("*")]:
        shutil.chown(path, MOSQUITTO_UID, MOSQUITTO_UID)
    for site in sites:
        etc = folder / site / "etc"
        (etc / "certs").mkdir(parents=True)
        (folder / site / "out").mkdir()
        shutil.copy2(job, etc / "job.yaml")
        for name in ("ca.crt", f"{site}.crt", f"{site}.key"):
            shutil.copy2(folder / "certs" / name, etc / "certs" / name)


BROKER_UP = " running"
"""What Mosquitto logs once it listens (``mosquitto version 2.0.11 running``)."""


def start_broker(net: Network, folder: Path, image: str) -> None:
    """The broker first, up before any site starts (two-clusters.md, step 4)."""
    net.run(
        "broker", image, "mosquitto", "-c", "mosquitto.conf",
        options=("--user", f"{MOSQUITTO_UID}:{MOSQUITTO_UID}",
                 "--volume", f"{folder / 'broker'}:/mosquitto/config:ro",
                 "--workdir", "/mosquitto/config"),
    )  # fmt: skip
    net.wait_log("broker", BROKER_UP)


def start_site(net: Network, folder: Path, site: str, image: str, *flags: str) -> float:
    # The broker's address in /etc/hosts: netavark's DNS left the first site started
    # after the broker unanswered for over 30 s, twice in four suite runs (the sites
    # started later, and every site's peers, resolved at once).
    try:
        hosts: tuple[str, ...] = ("--add-host", f"{net.host('broker')}:{net.address('broker')}")
    except PodmanError:  # no broker started (a test of a site without one)
        hosts = ()
    return net.run(
        site, image, "isthmus", "site", f"{SITE_ETC}/job.yaml", "--site", site,
        "--out", SITE_OUT, *flags,
        options=(*TCP_SETTINGS, *hosts,
                 "--volume", f"{folder / site / 'etc'}:{SITE_ETC}:ro",
                 "--volume", f"{folder / site / 'out'}:{SITE_OUT}"),
    )  # fmt: skip


def records(folder: Path, site: str) -> list[dict]:
    path = folder / site / "out" / "sites" / site / "metrics.jsonl"
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:  # a line cut short by a kill
            continue
    return out


def first_step_after(folder: Path, site: str, since: float) -> float | None:
    steps = [r["t"] for r in records(folder, site) if r["kind"] == "step" and r["t"] >= since]
    return min(steps) - since if steps else None


def wait_rounds(net: Network, folder: Path, site: str, rounds: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if sum(r["kind"] == "round" for r in records(folder, site)) >= rounds:
            return
        if not net.running(site):
            raise RuntimeError(f"site {site} stopped before round {rounds}:\n{net.logs(site)}")
        time.sleep(0.5)
    raise RuntimeError(f"site {site}: {rounds} rounds not reached in {timeout:.0f} s")


def run_sites(folder: Path, images: Images, *, kill: str | None = None) -> Outcome:
    """Three sites, DiLoCo (a with two ranks, b and c with one); ``kill`` names a
    site whose container is killed after its second round and started again with
    --rejoin (then each site has one rank)."""
    if kill:
        # One rank a site: a two-rank site's torchrun in a container now and then
        # took longer than these short timeouts to start (docs/two-clusters.md,
        # troubleshooting). Long enough for the killed site to come back before the
        # others finish; a deadline short enough that the others go on without it.
        sites = {"a": 1, "b": 1, "c": 1}
        train = ("{strategy: diloco, steps: 400, sync_every: 10, warmup_steps: 5, "
                 "eval_every: 0, round_deadline_s: 30, collective_timeout_s: 10}")  # fmt: skip
    else:
        sites = {"a": 2, "b": 1, "c": 1}  # a's two ranks under the torchrun it starts
        train = "{strategy: diloco, steps: 20, sync_every: 10, warmup_steps: 5}"
    started = time.monotonic()
    with Network() as net:
        prepare(folder, net, sites, train)
        start_broker(net, folder, images.broker)
        starts = {site: start_site(net, folder, site, images.site) for site in sites}
        if kill:
            try:
                wait_rounds(net, folder, kill, 2, timeout=240)
            except RuntimeError as exc:
                others = "\n".join(
                    f"--- {s}\n{net.logs(s)[-3000:]}" for s in sites if s != kill
                )
                raise RuntimeError(f"{exc}\n{others}") from None
            net.kill(kill)
            net.wait(kill, timeout=60)
            logs_before = net.logs(kill)
            net.remove(kill)
            start_site(net, folder, kill, images.site, "--rejoin")
        # One deadline for all: a site still running then fails the run with every
        # site's last lines (what it waits for), not a bare timeout.
        deadline = time.monotonic() + 300
        try:
            codes = {site: net.wait(site, timeout=max(5.0, deadline - time.monotonic()))
                     for site in sites}  # fmt: skip
        except PodmanError:
            tails = "\n".join(f"--- {s}\n{net.logs(s)[-3000:]}" for s in sites)
            raise RuntimeError(f"sites still running 300 s after the start:\n{tails}") from None
        logs = {site: net.logs(site) for site in sites}
        if kill:
            logs[kill] = logs_before + "\n--- started again with --rejoin ---\n" + logs[kill]
        failed = {s: c for s, c in codes.items() if c != 0}
        if failed:
            raise RuntimeError(
                f"sites exited non-zero {failed}:\n"
                + "\n".join(f"--- {s}\n{logs[s][-3000:]}" for s in failed)
            )
    digests = {
        site: json.loads((folder / site / "out" / "sites" / site / "result.json").read_text())[
            "param_sha256"
        ]
        for site in sites
    }
    to_training = {site: first_step_after(folder, site, starts[site]) for site in sites}
    return Outcome(
        digests=digests,
        to_training_s={s: t for s, t in to_training.items() if t is not None},
        wall_s=time.monotonic() - started,
        logs=logs,
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="keep the run's files here")
    parser.add_argument("--kill", action="store_true", help="kill site b mid-run, rejoin it")
    args = parser.parse_args()
    images = build_images()
    print(f"images: {images.site} {images.site_bytes / 1e6:.0f} MB; build {images.build_s:.1f} s")
    folder = args.out or Path(tempfile.mkdtemp(prefix="container-sites-"))
    folder.mkdir(parents=True, exist_ok=True)
    outcome = run_sites(folder, images, kill="b" if args.kill else None)
    for site, seconds in outcome.to_training_s.items():
        print(f"site {site}: podman run to first step {seconds:.1f} s")
    for site, digest in outcome.digests.items():
        print(f"site {site}: param_sha256 {digest}")
    if args.kill:
        said = [line for line in outcome.logs["b"].splitlines() if "rejoined" in line]
        print(f"site b, killed and started again: {said[0] if said else 'no rejoin line'}")
    print(f"wall {outcome.wall_s:.1f} s; {len(set(outcome.digests.values()))} distinct model(s)")
    return 0 if len(set(outcome.digests.values())) == 1 else 1


if __name__ == "__main__":
    raise SystemExit(main())
