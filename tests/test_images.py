"""deploy/images/Dockerfile and scripts/image.sh: the sites' image installs exactly
the lock, and the render names the images they build. tests/test_containers.py
builds the image and runs it; these checks need no container engine."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from isthmus.deploy.cli import main
from isthmus.deploy.render.cluster import DEFAULT_GPU_IMAGE, DEFAULT_IMAGE

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILE = ROOT / "deploy" / "images" / "Dockerfile"
IMAGE_SH = ROOT / "scripts" / "image.sh"


def test_the_image_takes_its_base_as_an_argument_upstream_python_by_default():
    assert re.search(r"^ARG BASE=python:3\.11-slim$", DOCKERFILE.read_text(), re.M)
    assert "FROM ${BASE}" in DOCKERFILE.read_text()


def test_the_image_installs_the_lock_alone_with_hashes_and_no_index():
    text = DOCKERFILE.read_text()
    install = text[text.index("python3 -m venv") :]
    assert "--require-hashes -r /opt/isthmus/requirements.lock" in install
    assert install.count("--no-index") == 2  # the locked wheels, then Isthmus's
    script = IMAGE_SH.read_text()
    assert "lock=requirements/runtime.txt" in script
    assert "lock=requirements/runtime-cuda.txt" in script  # --cuda


def test_the_render_names_the_images_the_dockerfile_builds(capsys, tmp_path):
    script = IMAGE_SH.read_text()
    assert f"tag={DEFAULT_GPU_IMAGE}" in script and f"tag={DEFAULT_IMAGE}" in script
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
