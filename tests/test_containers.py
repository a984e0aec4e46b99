"""Isthmus as it is deployed: the sites' image built from the lock and run, three
sites as separate hosts in containers with a Mosquitto container and mutual TLS
(one killed mid-run and started again with --rejoin), and the rendered Kubernetes
manifests played by ``podman kube play``.

Real podman (rootful), images built once per suite from a base made on this
machine (scripts/containers.sh: no registry is reachable); the deployments are
benchmarks/container_sites.py and benchmarks/kube_play.py, which print the same
figures for docs/benchmarks.md. Without a ready podman every test here skips
with the one command that fixes it."""

from __future__ import annotations

import importlib.util
import itertools
import sys
import textwrap
from pathlib import Path

import pytest
from needs import podman_missing

ROOT = Path(__file__).resolve().parents[1]
MISSING = podman_missing()
pytestmark = [
    pytest.mark.slow,
    pytest.mark.root,
    # Alone on the machine: an image build and four containers of ranks starve
    # whatever runs beside them (a slow pass with them took half as long again).
    pytest.mark.serial,
    pytest.mark.skipif(MISSING is not None, reason=MISSING or ""),
]


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def podman():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    return _load("podman")


@pytest.fixture(scope="module")
def images(podman):
    built = podman.build_images()
    print(f"sites' image {built.site}: {built.site_bytes / 1e6:.0f} MB")
    return built


def test_the_image_runs_isthmus_and_checks_a_job(podman, images, tmp_path, record_property):
    record_property("figure", f"the sites' image {images.site}: {images.site_bytes / 1e6:.0f} MB")
    assert images.site_bytes <= 1.5e9, f"{images.site_bytes / 1e6:.0f} MB"
    helped = podman.podman("run", "--rm", images.site, "isthmus", "--help")
    assert "isthmus" in helped.stdout and "site" in helped.stdout
    (tmp_path / "job.yaml").write_text(textwrap.dedent("""\
        name: in-image
        sites:
          - {name: a, address: 0.0.0.0:7100, advertise: a.example:7100}
          - {name: b, address: 0.0.0.0:7100, advertise: b.example:7100}
        train: {strategy: diloco, steps: 100, sync_every: 10}
        control: {broker: mqtt://broker.example:1883}
        insecure: true
        """))
    mount = ("--volume", f"{tmp_path}:/job:ro")
    checked = podman.podman("run", "--rm", *mount, images.site, "isthmus", "check", "/job/job.yaml")
    assert checked.returncode == 0, checked.stderr
    # A bad file is refused in the image as on the host: the field, and no traceback.
    (tmp_path / "job.yaml").write_text("name: x\nsites: []\n")
    refused = podman.podman(
        "run", "--rm", *mount, images.site, "isthmus", "check", "/job/job.yaml", check=False
    )
    assert refused.returncode != 0 and "sites" in refused.stderr
    assert "Traceback" not in refused.stderr


def test_a_build_context_without_the_lock_or_wheels_fails_naming_the_file(podman, tmp_path):
    """`podman build -f deploy/images/Dockerfile .` from the repository (not the
    context scripts/image.sh makes) stops at once, naming what is missing."""
    (tmp_path / "wheels").mkdir()
    done = podman.podman(
        "build", "--build-arg", f"BASE={podman.BASE_IMAGE}",
        "-f", str(ROOT / "deploy" / "images" / "Dockerfile"), str(tmp_path),
        check=False, timeout=300,
    )  # fmt: skip
    assert done.returncode != 0
    said = done.stdout + done.stderr
    assert "missing requirements.lock in the build context: build with scripts/image.sh" in said


@pytest.mark.timeout(900)  # builds the images when alone; its own deadlines are shorter
def test_a_site_container_killed_mid_run_rejoins_and_every_site_ends_identical(
    images, tmp_path, record_property
):
    """Three sites; b's container killed after its second round, started again with
    --rejoin; every site finishes, with one model."""
    sites = _load("container_sites")
    outcome = sites.run_sites(tmp_path, images, kill="b")
    assert len(set(outcome.digests.values())) == 1, outcome.digests
    assert set(outcome.to_training_s) == {"a", "b", "c"}
    starts = ", ".join(f"{s} {t:.1f} s" for s, t in sorted(outcome.to_training_s.items()))
    record_property("figure", f"podman run to a site's first step: {starts}")
    # Each site held its own key only.
    for site in "abc":
        held = sorted(p.name for p in (tmp_path / site / "etc" / "certs").iterdir())
        assert held == sorted(["ca.crt", f"{site}.crt", f"{site}.key"])
        assert f"{site}: finished" in outcome.logs[site]
    assert "rejoined at round" in outcome.logs["b"], outcome.logs["b"][-3000:]
    # a and c went on without b: in some of a's rounds it sent to c but not to b.
    rounds = [r for r in sites.records(tmp_path, "a") if r["kind"] == "round"]
    assert rounds and rounds[-1]["step"] == 400
    without_b = 0
    for before, after in itertools.pairwise(rounds):
        sent = {
            peer: after["wan_bytes_sent_to"].get(peer, 0) - before["wan_bytes_sent_to"].get(peer, 0)
            for peer in ("b", "c")
        }
        without_b += sent["b"] == 0 and sent["c"] > 0
    assert without_b >= 1, rounds


def test_three_sites_in_containers_end_with_one_model(images, tmp_path):
    """Site a of two ranks under the torchrun it starts, b and c of one."""
    sites = _load("container_sites")
    outcome = sites.run_sites(tmp_path, images)
    assert len(set(outcome.digests.values())) == 1, outcome.digests
    assert all(f"{site}: finished" in outcome.logs[site] for site in "abc")


def test_a_site_that_cannot_reach_the_broker_says_where_and_exits_non_zero(podman, images, tmp_path):
    sites = _load("container_sites")
    with podman.Network() as net:
        # Two ranks: torchrun's ranks say it, and torchrun adds no traceback.
        sites.prepare(tmp_path, net, {"a": 2, "b": 1}, "{strategy: diloco, steps: 20}", wait_s=5)
        # No broker container: its name does not resolve.
        sites.start_site(net, tmp_path, "a", images.site)
        code = net.wait("a", timeout=180)
        said = net.logs("a")
    assert code != 0
    broker = f"{net.host('broker')}:{sites.BROKER_PORT}"
    (line,) = [line for line in said.splitlines() if "error:" in line]
    assert broker in line and "--print-ports" in line, said[-2000:]
    assert "Traceback" not in said


def test_the_rendered_kubernetes_manifests_played_by_podman_finish_a_2_site_job(images, tmp_path):
    kube = _load("kube_play")
    played = kube.play(tmp_path, images.site)
    assert set(played.digests) == {"a", "b"}
    assert len(set(played.digests.values())) == 1, played.digests
