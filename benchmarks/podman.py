"""Podman for the container benchmarks and tests: the settings scripts/containers.sh
writes, the images built once (the sites' image by scripts/image.sh from the local
base, the broker's look-alike of eclipse-mosquitto:2), and a network whose
containers are removed with it.

Every call has a timeout and says what failed; nothing here hangs on a podman
that is misconfigured (tests/needs.py skips the tests where podman is not ready).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import subprocess
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONTAINERS = Path(os.environ.get("ISTHMUS_CONTAINERS", ROOT / ".containers"))
CONF = CONTAINERS / "containers.conf"
BASE_IMAGE = os.environ.get("ISTHMUS_BASE_IMAGE", "localhost/isthmus-base:bookworm")
SITE_IMAGE = "localhost/isthmus:test"
BROKER_IMAGE = "docker.io/library/eclipse-mosquitto:2"
"""The broker image the rendered manifests name; here a look-alike built locally
(tests/images/mosquitto.Dockerfile), since no registry can be reached."""
LABEL = "isthmus-test-network"


class PodmanError(RuntimeError):
    """A podman command failed; the message has the command and its output's end."""


def environment() -> dict[str, str]:
    return {**os.environ, "CONTAINERS_CONF": str(CONF)}


def podman(*args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess:
    command = ["podman", *args]
    try:
        done = subprocess.run(
            command, capture_output=True, text=True, timeout=timeout, env=environment()
        )
    except subprocess.TimeoutExpired as exc:
        raise PodmanError(f"{' '.join(command)} did not finish in {timeout:.0f} s") from exc
    if check and done.returncode != 0:
        raise PodmanError(
            f"{' '.join(command)} exited {done.returncode}: {(done.stderr or done.stdout)[-2000:]}"
        )
    return done


@dataclass(frozen=True)
class Images:
    site: str
    site_bytes: int
    broker: str
    build_s: float
    """Seconds this call spent building (both images; cached layers make it short)."""


@contextlib.contextmanager
def _build_lock() -> Iterator[None]:
    """One build at a time across the suite's workers (the second finds the cache)."""
    CONTAINERS.mkdir(parents=True, exist_ok=True)
    with open(CONTAINERS / "build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def build_images() -> Images:
    """The sites' image from this checkout (scripts/image.sh, FROM the local base)
    and the broker's look-alike."""
    started = time.monotonic()
    with _build_lock():
        built = subprocess.run(
            ["bash", str(ROOT / "scripts" / "image.sh"), "--base", BASE_IMAGE, "--tag", SITE_IMAGE],
            capture_output=True, text=True, timeout=1200, env=environment(), cwd=ROOT,
        )  # fmt: skip
        if built.returncode != 0:
            raise PodmanError(f"scripts/image.sh failed: {(built.stderr + built.stdout)[-3000:]}")
        podman(
            "build", "--quiet", "--network", "host", "--build-arg", f"BASE={BASE_IMAGE}",
            "-f", str(ROOT / "tests" / "images" / "mosquitto.Dockerfile"),
            "-t", BROKER_IMAGE, str(ROOT / "tests" / "images"),
            timeout=600,
        )  # fmt: skip
    size = int(podman("image", "inspect", "--format", "{{.Size}}", SITE_IMAGE).stdout.strip())
    return Images(SITE_IMAGE, size, BROKER_IMAGE, time.monotonic() - started)


def wait_for_log(container: str, text: str, timeout: float = 60) -> None:
    """Until ``container`` has logged ``text``; raises with its log if it does not."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done = podman("logs", container, check=False)
        if text in done.stdout + done.stderr:
            return
        time.sleep(0.2)
    raise PodmanError(f"{container} did not log {text!r} in {timeout:.0f} s: {done.stderr[-2000:]}")


@dataclass
class Network:
    """A podman network (with DNS: a container is reached by its name) and the
    containers started on it; ``close`` removes both."""

    name: str = field(default_factory=lambda: f"isthmus-{uuid.uuid4().hex[:8]}")

    def __post_init__(self) -> None:
        podman("network", "create", "--label", f"{LABEL}={self.name}", self.name)

    def host(self, what: str) -> str:
        """The name (and DNS name) of this network's container for ``what``."""
        return f"{self.name}-{what}"

    def run(self, what: str, image: str, *command: str, options: tuple[str, ...] = ()) -> float:
        """Start ``what``'s container detached; returns the wall-clock time just
        before ``podman run`` (to time a site's start from)."""
        started = time.time()
        podman(
            "run", "--detach", "--name", self.host(what), "--hostname", self.host(what),
            "--network", self.name, "--label", f"{LABEL}={self.name}", *options, image, *command,
        )  # fmt: skip
        return started

    def address(self, what: str) -> str:
        """``what``'s IP address on this network."""
        template = f'{{{{(index .NetworkSettings.Networks "{self.name}").IPAddress}}}}'
        return podman("inspect", "--format", template, self.host(what)).stdout.strip()

    def wait(self, what: str, timeout: float) -> int:
        """``what``'s exit status, once its container has stopped."""
        done = podman("wait", self.host(what), timeout=timeout + 30, check=False)
        if done.returncode != 0:
            raise PodmanError(f"podman wait {self.host(what)}: {done.stderr.strip()}")
        return int(done.stdout.strip().splitlines()[-1])

    def wait_log(self, what: str, text: str, timeout: float = 60) -> None:
        """Until ``what``'s container has logged ``text`` (a server saying it is up)."""
        wait_for_log(self.host(what), text, timeout)

    def running(self, what: str) -> bool:
        state = podman(
            "inspect", "--format", "{{.State.Running}}", self.host(what), check=False
        ).stdout.strip()
        return state == "true"

    def logs(self, what: str) -> str:
        done = podman("logs", self.host(what), check=False)
        return done.stdout + done.stderr

    def kill(self, what: str) -> None:
        """SIGKILL ``what``'s container (``podman kill``): a host that dies."""
        podman("kill", self.host(what))

    def remove(self, what: str) -> None:
        podman("rm", "--force", "--time", "0", self.host(what), check=False)

    def close(self) -> None:
        names = podman(
            "ps", "--all", "--quiet", "--filter", f"label={LABEL}={self.name}", check=False
        ).stdout.split()
        if names:
            podman("rm", "--force", "--time", "0", *names, check=False, timeout=180)
        podman("network", "rm", "--force", self.name, check=False)

    def __enter__(self) -> Network:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()
