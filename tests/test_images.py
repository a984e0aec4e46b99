"""deploy/images/Dockerfile: the sites' image, in step with scripts/setup.sh and the render.

The image itself is built where a container engine and a registry to pull the
base image from are at hand (this project's machines have neither: the test
that builds it skips, saying so); what can be checked without one is checked
here: that the Dockerfile installs the torch setup.sh pins, from the index
that gives the wanted build, copies every package folder pyproject.toml
installs, and builds the images the render names by default."""

from __future__ import annotations

import re
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest
import yaml

from isthmus.deploy.cli import main
from isthmus.deploy.render.cluster import DEFAULT_GPU_IMAGE, DEFAULT_IMAGE

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILE = ROOT / "deploy" / "images" / "Dockerfile"


def _arg(name: str) -> str:
    match = re.search(rf"^ARG {name}=(\S+)$", DOCKERFILE.read_text(), re.M)
    assert match, f"no ARG {name} in {DOCKERFILE}"
    return match.group(1)


def test_the_image_installs_the_torch_setup_sh_pins_as_a_cpu_build_by_default():
    pinned = re.search(
        r"ISTHMUS_TORCH_VERSION:-([\d.]+)", (ROOT / "scripts" / "setup.sh").read_text()
    )
    assert pinned and _arg("TORCH_VERSION") == pinned.group(1)
    assert _arg("TORCH_INDEX").endswith("/whl/cpu")  # else pip pulls the CUDA build
    text = DOCKERFILE.read_text()
    # torch first, from its index; then the package, as setup.sh does it.
    assert text.index('--index-url "${TORCH_INDEX}" "torch==${TORCH_VERSION}"') < text.index(
        "pip install ."
    )


def test_the_image_copies_every_folder_the_package_is_made_of():
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    folders = {
        path.split("/")[0] for path in pyproject["tool"]["setuptools"]["package-dir"].values()
    }
    copied = set(re.findall(r"^COPY (\S+) \1$", DOCKERFILE.read_text(), re.M))
    assert folders <= copied, f"not copied: {folders - copied}"
    ignored = (DOCKERFILE.parent / "Dockerfile.dockerignore").read_text()
    assert ".venv" in ignored and "__pycache__" in ignored


def test_the_render_names_the_images_the_dockerfile_builds(capsys, tmp_path):
    header = DOCKERFILE.read_text()
    assert f"-t {DEFAULT_IMAGE} ." in header and f"-t {DEFAULT_GPU_IMAGE} ." in header
    job = tmp_path / "job.yaml"
    job.write_text(
        "name: img\nsites:\n  - {name: a, address: 0.0.0.0:7100, advertise: a.example:7100}\n"
        "  - {name: b, address: 0.0.0.0:7100, advertise: b.example:7100}\n"
        "control: {broker: mqtt://broker.example:1883}\ninsecure: true\n"
    )
    for flags, image in (([], DEFAULT_IMAGE), (["--gpus"], DEFAULT_GPU_IMAGE)):
        out = tmp_path / f"out{len(flags)}"
        code = main(
            ["deploy", "render", str(job), "--target", "kubernetes", "--out", str(out), *flags]
        )
        assert code == 0, capsys.readouterr().err
        pod = yaml.safe_load((out / "a" / "indexed-job.yaml").read_text())
        (container,) = pod["spec"]["template"]["spec"]["containers"]
        assert container["image"] == image
        assert ("resources" in container) == bool(flags)  # nvidia.com/gpu with --gpus


def _engine() -> str | None:
    for engine in ("docker", "podman"):
        if shutil.which(engine):
            ready = subprocess.run([engine, "info"], capture_output=True, timeout=30)
            if ready.returncode == 0:
                return engine
    return None


@pytest.mark.slow
@pytest.mark.skipif(_engine() is None, reason="no container engine running here to build the image")
def test_the_cpu_image_builds_and_runs_isthmus(tmp_path):
    engine = _engine()
    assert engine is not None
    tag = "isthmus-test:build"
    built = subprocess.run(
        [engine, "build", "-f", str(DOCKERFILE), "-t", tag, str(ROOT)],
        capture_output=True, text=True, timeout=1800,
    )  # fmt: skip
    assert built.returncode == 0, built.stderr[-3000:]
    ran = subprocess.run(
        [engine, "run", "--rm", tag, "isthmus", "--help"], capture_output=True, text=True
    )
    assert ran.returncode == 0 and "isthmus" in ran.stdout
