"""A real Mosquitto on a loopback port, for the benchmarks that need a broker of their own."""

from __future__ import annotations

import getpass
import shutil
import socket
import subprocess
import time
from pathlib import Path

from isthmus.job.ports import free_port


def mosquitto_binary() -> str | None:
    """Mosquitto's path (Debian puts it in /usr/sbin, often not on PATH), or None."""
    found = shutil.which("mosquitto")
    if found:
        return found
    return "/usr/sbin/mosquitto" if Path("/usr/sbin/mosquitto").exists() else None


def start_mosquitto(folder: Path, wait_s: float = 10.0) -> tuple[subprocess.Popen[bytes], int]:
    """Start Mosquitto (anonymous, no persistence) on a free loopback port, with its
    config in ``folder``; returns the process and the port once it listens. Raises
    RuntimeError if it is not installed or does not listen within ``wait_s``."""
    binary = mosquitto_binary()
    if binary is None:
        raise RuntimeError("mosquitto is not installed (apt-get install mosquitto)")
    port = free_port("127.0.0.1")
    config = folder / "mosquitto.conf"
    # Started as root, Mosquitto would switch to its own user: stay who we are.
    config.write_text(
        f"listener {port} 127.0.0.1\nallow_anonymous true\npersistence false\n"
        f"user {getpass.getuser()}\n"
    )
    proc = subprocess.Popen(
        [binary, "-c", str(config)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return proc, port
        time.sleep(0.05)
    proc.kill()
    raise RuntimeError(f"mosquitto did not start listening within {wait_s:g} s")
