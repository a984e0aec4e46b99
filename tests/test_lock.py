"""requirements/*.txt: what scripts/setup.sh and the images install, in step with
pyproject.toml and with each other (``bash scripts/lock.sh`` writes them; these
checks need no network)."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
LOCKS = ROOT / "requirements"
PIN = re.compile(r"^([A-Za-z0-9._-]+)==(\S+)", re.M)


def pins(name: str) -> dict[str, Version]:
    text = (LOCKS / name).read_text()
    return {canonicalize_name(m[1]): Version(m[2]) for m in PIN.finditer(text)}


def wanted(*extras: str) -> list[Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    names = list(project["dependencies"])
    for extra in extras:
        names += project["optional-dependencies"][extra]
    return [Requirement(n) for n in names]


@pytest.mark.parametrize(
    ("lock", "extras"),
    [("dev.txt", ("dev", "hf")), ("runtime.txt", ()), ("runtime-cuda.txt", ())],
)
def test_every_requirement_of_pyproject_is_pinned_within_its_range(lock, extras):
    pinned = pins(lock)
    for requirement in wanted(*extras):
        name = canonicalize_name(requirement.name)
        assert name in pinned, f"{lock} lacks {name}: run bash scripts/lock.sh"
        assert requirement.specifier.contains(pinned[name], prereleases=True), (
            f"{lock} pins {name}=={pinned[name]}, outside {requirement}: run bash scripts/lock.sh"
        )


@pytest.mark.parametrize("lock", ["dev.txt", "runtime.txt", "runtime-cuda.txt"])
def test_every_pin_carries_its_hashes(lock):
    entries = re.split(r"\n(?=[A-Za-z0-9])", (LOCKS / lock).read_text().strip())
    for entry in entries:
        assert PIN.match(entry), entry[:80]
        assert "--hash=sha256:" in entry, f"{lock}: no hash for {entry.split()[0]}"


def test_the_image_installs_what_the_tests_ran():
    """The CPU image's packages are the test environment's, at the same versions;
    the CUDA image differs only in torch's build and what it brings."""
    dev, cpu, cuda = pins("dev.txt"), pins("runtime.txt"), pins("runtime-cuda.txt")
    assert {n: v for n, v in cpu.items() if dev.get(n) != v} == {}
    gpu_only = {n for n in cuda if n.startswith(("nvidia-", "cuda-")) or n == "triton"}
    assert {n: v for n, v in cuda.items() if n not in gpu_only and n != "torch"} == {
        n: v for n, v in cpu.items() if n != "torch"
    }
    assert cpu["torch"].local == "cpu" and cuda["torch"].local is None
    assert cpu["torch"].base_version == cuda["torch"].base_version
