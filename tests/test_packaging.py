"""The distribution installs one import namespace, ``isthmus.*``, from wheel and editable installs.

Both tests build into a fresh virtual environment (no access to this one's
packages) and import from a directory outside the checkout, so the top-level
folders of the repository cannot be picked up by accident.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SUBPACKAGES = ("job", "intra", "inter", "proto", "sim", "deploy")

CHECK_IMPORTS = f"""
import importlib, importlib.util, isthmus
for name in {SUBPACKAGES!r}:
    module = importlib.import_module("isthmus." + name)
    assert module.__name__ == "isthmus." + name
    assert importlib.util.find_spec(name) is None, "top-level module installed: " + name
print("ok", isthmus.__version__)
"""

pytestmark = pytest.mark.slow


def _venv(path: Path) -> Path:
    subprocess.run([sys.executable, "-m", "venv", str(path)], check=True)
    return path / "bin" / "python"


def _pip(python: Path, *args: str) -> None:
    subprocess.run(
        [str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check", *args],
        check=True,
        timeout=600,
    )


def _check(python: Path, cwd: Path) -> None:
    result = subprocess.run(
        [str(python), "-c", CHECK_IMPORTS], cwd=cwd, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("ok ")


def _clean_copy(tmp_path: Path) -> Path:
    """The checkout without build leftovers: setuptools reuses build/lib, so a stale
    module there would end up in the wheel and hide a packaging mistake."""
    source = tmp_path / "source"
    ignore = shutil.ignore_patterns(".venv", "build", "dist", "*.egg-info", ".git", "__pycache__")
    shutil.copytree(ROOT, source, ignore=ignore)
    return source


def test_wheel_holds_only_the_isthmus_namespace_and_imports(tmp_path):
    dist = tmp_path / "dist"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--quiet",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(dist),
            str(_clean_copy(tmp_path)),
        ],
        check=True,
        timeout=600,
    )
    (wheel,) = dist.glob("isthmus-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        tops = {name.split("/")[0] for name in archive.namelist()}
        names = archive.namelist()
    assert {t for t in tops if not t.endswith(".dist-info")} == {"isthmus"}
    for sub in SUBPACKAGES:
        assert f"isthmus/{sub}/__init__.py" in names
    python = _venv(tmp_path / "venv")
    _pip(python, "--no-deps", str(wheel))
    _check(python, cwd=tmp_path)
    assert (tmp_path / "venv" / "bin" / "isthmus").exists()


def test_editable_install_imports_the_same_namespace(tmp_path):
    python = _venv(tmp_path / "venv")
    _pip(python, "--no-deps", "-e", str(ROOT))
    _check(python, cwd=tmp_path)
