"""scripts/containers.sh --check: a podman that is missing or not set up is named,
with the one command that fixes it, quickly (tests/needs.py skips the container
tests with that line)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BASH = shutil.which("bash") or "/bin/bash"


def _check(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [BASH, str(ROOT / "scripts" / "containers.sh"), "--check"],
        capture_output=True, text=True, timeout=60, env=env,
    )  # fmt: skip


def test_podman_not_installed_is_named_with_the_fix(tmp_path):
    tools = tmp_path / "bin"
    tools.mkdir()
    (tools / "dirname").symlink_to(shutil.which("dirname"))
    done = _check({**os.environ, "PATH": str(tools)})
    assert done.returncode == 1
    assert "not installed: podman buildah runc mmdebstrap" in done.stdout
    assert "run: sudo bash scripts/containers.sh" in done.stdout


def test_podman_without_the_projects_settings_is_named_with_the_fix(tmp_path):
    if shutil.which("podman") is None:  # the first check above answers first
        return
    done = _check({**os.environ, "ISTHMUS_CONTAINERS": str(tmp_path)})
    assert done.returncode == 1
    assert f"no {tmp_path}/containers.conf; run: sudo bash scripts/containers.sh" in done.stdout
