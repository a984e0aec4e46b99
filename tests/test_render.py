"""``isthmus deploy render``: files for a three-site job on real clusters.

The rendered files are checked as their consumers read them: every manifest
parses and has what Kubernetes requires, each node's Service exposes exactly
its ranks' ports, the pod's job file loads with the certificates where the
Secret mounts them, the batch scripts run (against stand-ins for ``scontrol``
and ``srun``) and call ``isthmus site`` as intended, and the broker's
configuration runs in a real Mosquitto and enforces the ACL. No secret is
ever in a rendered file; bad input is refused with exit status 2.
"""

from __future__ import annotations

import asyncio
import contextlib
import getpass
import os
import re
import shlex
import shutil
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from needs import MOSQUITTO, needs_mosquitto

from isthmus.deploy.cli import main
from isthmus.deploy.render.certs import make_certs
from isthmus.inter.tls import SiteTls
from isthmus.job.file import Job, SiteSpec, load_job

SITES = ("us-east", "eu-west", "asia-east")
JOB = """\
name: demo
sites:
  - name: us-east
    ranks: 4
    nodes: 2
    address: 0.0.0.0:7100
    advertise: [lb0.us.example:7100, lb0.us.example:7101, lb1.us.example:7102, lb1.us.example:7103]
  - {name: eu-west, ranks: 2, address: 0.0.0.0:7100, advertise: eu.example:7100}
  - {name: asia-east, ranks: 1, address: 0.0.0.0:7300, advertise: asia.example:7300}
train: {strategy: diloco, steps: 10, sync_every: 5}
tls: {ca: pki/ca.crt, cert: "pki/{site}.crt", key: "pki/{site}.key"}
control:
  broker: mqtts://127.0.0.1:BROKER_PORT
  password_env: ISTHMUS_TEST_MQTT_PASSWORD
  tls: {ca: pki/ca.crt, cert: "pki/{site}.crt", key: "pki/{site}.key"}
"""


def listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def job_file(tmp_path_factory) -> Path:
    """The job file, beside the certificates ``isthmus certs --broker`` makes."""
    folder = tmp_path_factory.mktemp("job")
    make_certs("demo", SITES, folder / "pki", broker=["127.0.0.1"])
    path = folder / "job.yaml"
    path.write_text(JOB.replace("BROKER_PORT", str(free_port())))
    return path


@pytest.fixture(scope="module")
def job(job_file) -> Job:
    return load_job(job_file)


def render(capsys, job_file: Path, out: Path, *flags: str) -> tuple[int, str, str]:
    code = main(["deploy", "render", str(job_file), "--out", str(out), *flags])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.fixture
def kubernetes(capsys, job_file, tmp_path) -> Path:
    out = tmp_path / "k8s"
    code, stdout, stderr = render(capsys, job_file, out, "--target", "kubernetes", "--gpus")
    assert code == 0, stderr
    assert "Next steps:" in stdout
    return out


@pytest.fixture
def slurm(capsys, job_file, tmp_path) -> Path:
    out = tmp_path / "slurm"
    code, _, stderr = render(capsys, job_file, out, "--target", "slurm", "--gpus")
    assert code == 0, stderr
    return out


def manifests(folder: Path) -> dict[str, list[dict[str, Any]]]:
    """kind -> the objects of that kind in every YAML file under ``folder``."""
    by_kind: dict[str, list[dict[str, Any]]] = {}
    for path in sorted(folder.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            by_kind.setdefault(doc["kind"], []).append(doc)
    return by_kind


def site_objects(out: Path, site: str) -> tuple[dict, dict, dict, list[dict]]:
    """(ConfigMap, headless Service, Job, the per-node Services) of ``site``."""
    objects = manifests(out / site)
    (config_map,) = objects["ConfigMap"]
    (indexed_job,) = objects["Job"]
    headless = [s for s in objects["Service"] if s["spec"].get("clusterIP") == "None"]
    nodes = [s for s in objects["Service"] if s["spec"].get("type") == "LoadBalancer"]
    assert len(headless) == 1 and len(headless) + len(nodes) == len(objects["Service"])
    return config_map, headless[0], indexed_job, nodes


def secret_branches(script: str) -> dict[str, dict[str, Path]]:
    """secrets.sh's ``case`` branches: who -> {Secret key: file}."""
    branches = {}
    for who, body in re.findall(r"^  ([\w-]+)\)\n(.*?)\n    ;;", script, re.M | re.S):
        create, _, apply = body.replace("\\\n", " ").partition("|")
        words = shlex.split(create)
        if words[:4] == ["kubectl", "create", "secret", "generic"]:
            assert words[-3:] == ["--dry-run=client", "-o", "yaml"], words
            assert shlex.split(apply) == ["kubectl", "apply", "-f", "-"], apply  # rerunnable
            pairs = [w.removeprefix("--from-file=").split("=", 1) for w in words[5:-3]]
            branches[who] = {key: Path(path) for key, path in pairs}
    return branches


# -- Kubernetes ---------------------------------------------------------------------------
def test_every_manifest_parses_and_has_the_fields_kubernetes_requires(kubernetes, job):
    files = sorted(kubernetes.rglob("*.yaml"))
    assert {p.parent.name for p in files} == {*SITES, "broker"}
    for path in files:
        for doc in yaml.safe_load_all(path.read_text()):
            assert doc["apiVersion"] and doc["kind"] and doc["metadata"]["name"], path
            assert re.fullmatch(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?", doc["metadata"]["name"])
            if doc["kind"] == "ConfigMap":
                assert doc["data"], path
            else:
                assert doc["spec"], path
            if doc["kind"] == "Service":
                assert doc["spec"]["ports"] and doc["spec"]["selector"], path
    broker = manifests(kubernetes / "broker")
    (deployment,) = broker["Deployment"]
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    assert container["image"] == "eclipse-mosquitto:2"
    assert container["ports"][0]["containerPort"] == job.control.broker.port
    (service,) = broker["Service"]
    assert [p["port"] for p in service["spec"]["ports"]] == [job.control.broker.port]


@pytest.mark.parametrize("version", ["1.28.0", "1.37.0"])  # the oldest the docs name; the newest
def test_every_manifest_passes_the_kubernetes_api_schemas(kubernetes, version):
    """Validated with kubernetes-validate's copy of the API's OpenAPI schemas, strict:
    an unknown or misplaced field fails here, not at kubectl apply."""
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    checked = 0
    for path in sorted(kubernetes.rglob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            try:
                kubernetes_validate.validate(doc, version, strict=True)
            except kubernetes_validate.ValidationError as exc:
                raise AssertionError(f"{path.relative_to(kubernetes)}: {exc.message}") from None
            checked += 1
    assert checked >= 10


def test_each_site_is_an_indexed_job_with_a_pod_per_node_that_meet_at_pod_0(kubernetes, job):
    for site in job.sites:
        config_map, headless, indexed_job, _ = site_objects(kubernetes, site.name)
        spec = indexed_job["spec"]
        assert spec["completionMode"] == "Indexed"
        assert spec["completions"] == spec["parallelism"] == site.nodes
        pod = spec["template"]["spec"]
        labels = spec["template"]["metadata"]["labels"]
        assert pod["subdomain"] == headless["metadata"]["name"]
        assert headless["spec"]["selector"].items() <= labels.items()
        assert [p["port"] for p in headless["spec"]["ports"]] == [29400]
        (container,) = pod["containers"]
        command = container["command"]
        assert command[:3] == ["isthmus", "site", "/etc/isthmus/job.yaml"]
        assert command[command.index("--site") + 1] == site.name
        job_name, service = indexed_job["metadata"]["name"], headless["metadata"]["name"]
        endpoint = command[command.index("--rdzv-endpoint") + 1]
        assert endpoint == f"{job_name}-0.{service}:29400"
        assert container["resources"]["limits"]["nvidia.com/gpu"] == site.ranks_per_node
        volumes = {v["name"]: v for v in pod["volumes"]}
        assert volumes["job-file"]["configMap"]["name"] == config_map["metadata"]["name"]
        assert volumes["certs"]["secret"]["secretName"] == f"isthmus-demo-{site.name}-tls"


def expected_ports(site: SiteSpec, node: int) -> list[int]:
    """The ports the job file makes node ``node``'s ranks listen on."""
    per_node = site.ranks // site.nodes
    listen = site.listen_addresses()
    assert listen is not None
    return [port for _, port in listen[node * per_node : (node + 1) * per_node]]


def test_each_nodes_service_exposes_exactly_its_ranks_ports(kubernetes, job):
    for site in job.sites:
        _, _, indexed_job, services = site_objects(kubernetes, site.name)
        pod_labels = indexed_job["spec"]["template"]["metadata"]["labels"]
        (container,) = indexed_job["spec"]["template"]["spec"]["containers"]
        container_ports = {p["containerPort"] for p in container["ports"]}
        assert len(services) == site.nodes
        for service in services:
            selector = dict(service["spec"]["selector"])
            node = int(selector.pop("batch.kubernetes.io/job-completion-index"))
            assert selector.items() <= pod_labels.items()
            ports = [p["port"] for p in service["spec"]["ports"]]
            assert ports == expected_ports(site, node)
            assert [p["targetPort"] for p in service["spec"]["ports"]] == ports
            assert set(ports) <= container_ports
    us_east = job.site("us-east")
    assert expected_ports(us_east, 1) == [7102, 7103]  # the arithmetic above, by hand


def load_in_pod(out: Path, site: str, root: Path) -> Job:
    """The job as ``site``'s pod loads it: the ConfigMap's job file at /etc/isthmus,
    the Secret (made by secrets.sh) mounted at /etc/isthmus/certs."""
    config_map, _, _, _ = site_objects(out, site)
    pod = root / site / "etc" / "isthmus"
    (pod / "certs").mkdir(parents=True)
    (pod / "job.yaml").write_text(config_map["data"]["job.yaml"])
    for key, source in secret_branches((out / "secrets.sh").read_text())[site].items():
        shutil.copy(source, pod / "certs" / key)
    seen = load_job(pod / "job.yaml")
    assert seen.tls is not None and seen.control is not None
    SiteTls.load(
        "demo", site, *seen.tls.paths(site)
    )  # reads and checks the site's certificate and key
    assert seen.control.broker_for(site).tls_context() is not None
    return seen


def test_the_pod_loads_its_job_file_with_the_certificates_the_secret_mounts(kubernetes, tmp_path):
    branches = secret_branches((kubernetes / "secrets.sh").read_text())
    assert set(branches) == {*SITES, "broker"}
    assert set(branches["broker"]) == {"ca.crt", "broker.crt", "broker.key"}
    for site in SITES:
        assert set(branches[site]) == {"ca.crt", f"{site}.crt", f"{site}.key"}
        seen = load_in_pod(kubernetes, site, tmp_path)
        assert seen.name == "demo" and [s.name for s in seen.sites] == list(SITES)
        login = seen.control.broker_for(site)
        assert login.tls_cert == str(tmp_path / site / "etc/isthmus/certs" / f"{site}.crt")


def test_the_revocation_list_travels_in_each_sites_secret(capsys, job_file, tmp_path):
    from isthmus.deploy.render.certs import revoke_site

    pki = tmp_path / "pki"
    shutil.copytree(job_file.parent / "pki", pki)
    revoke_site("demo", SITES[0], pki)
    path = tmp_path / "crl.yaml"
    path.write_text(
        job_file.read_text()
        .replace('key: "pki/{site}.key"}\n', 'key: "pki/{site}.key", crl: pki/revoked.crl}\n', 1)
        .replace("pki/", f"{pki}/")
    )
    assert "crl:" in path.read_text()
    assert render(capsys, path, tmp_path / "k8s", "--target", "kubernetes")[0] == 0
    branches = secret_branches((tmp_path / "k8s" / "secrets.sh").read_text())
    for site in SITES:
        assert branches[site]["revoked.crl"] == pki / "revoked.crl"
        seen = load_in_pod(tmp_path / "k8s", site, tmp_path / "pods")
        assert seen.tls is not None and seen.tls.crl_path is not None
        assert seen.tls.crl_path.read_bytes() == (pki / "revoked.crl").read_bytes()


def test_a_broker_ca_other_than_the_sites_is_mounted_beside_it(capsys, job_file, tmp_path):
    shutil.copy(job_file.parent / "pki" / "ca.crt", tmp_path / "broker-ca.crt")
    path = bad_job(
        tmp_path, job_file, "  tls: {ca: pki/ca.crt", f"  tls: {{ca: {tmp_path}/broker-ca.crt"
    )
    code, _, stderr = render(capsys, path, tmp_path / "out", "--target", "kubernetes")
    assert code == 0, stderr
    files = secret_branches((tmp_path / "out" / "secrets.sh").read_text())["eu-west"]
    assert files["control-ca.crt"] == tmp_path / "broker-ca.crt"
    assert files["ca.crt"] == job_file.parent / "pki" / "ca.crt"
    seen = load_in_pod(tmp_path / "out", "eu-west", tmp_path)
    assert seen.control is not None and seen.control.broker.tls_ca is not None
    assert seen.control.broker.tls_ca.endswith("/etc/isthmus/certs/control-ca.crt")


def test_secrets_script_makes_one_secret_per_site_and_the_brokers(kubernetes):
    script = kubernetes / "secrets.sh"
    subprocess.run(["bash", "-n", str(script)], check=True)
    assert os.access(script, os.X_OK)
    text = script.read_text()
    assert text.count("kubectl create secret generic") == len(SITES) + 1
    for files in secret_branches(text).values():
        assert all(path.is_file() for path in files.values())
    usage = subprocess.run(["bash", str(script)], capture_output=True, text=True)
    assert usage.returncode == 2 and "us-east|eu-west|asia-east|broker" in usage.stderr


# -- Slurm --------------------------------------------------------------------------------
def run_sbatch(script: Path, tmp_path: Path) -> list[str]:
    """Run a batch script with stand-ins for scontrol and srun; srun's arguments."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(parents=True, exist_ok=True)
    (bin_dir / "scontrol").write_text('#!/bin/sh\nprintf "gpu17\\ngpu18\\n"\n')
    (bin_dir / "srun").write_text('#!/bin/sh\nprintf "%s\\n" "$@" > "$SRUN_ARGS"\n')
    for tool in ("scontrol", "srun"):
        (bin_dir / tool).chmod(0o755)
    calls = tmp_path / "srun.args"
    env = {
        **os.environ,
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "SLURM_JOB_NODELIST": "gpu[17-18]",
        "SRUN_ARGS": str(calls),
    }
    subprocess.run(["bash", str(script)], check=True, env=env, cwd=tmp_path)
    return calls.read_text().splitlines()


def test_batch_scripts_start_one_isthmus_site_per_node(slurm, job, job_file, tmp_path):
    for site in job.sites:
        script = slurm / f"{site.name}.sbatch"
        subprocess.run(["bash", "-n", str(script)], check=True)
        text = script.read_text()
        directives = re.findall(r"^#SBATCH (\S+)$", text, re.M)
        assert directives == [
            f"--job-name=isthmus-demo-{site.name}",
            f"--nodes={site.nodes}",
            "--ntasks-per-node=1",
            # Every rank of the node gets a CPU of its own: with task/affinity, one
            # CPU per task pinned a 2-rank site's launcher and ranks to one core.
            f"--cpus-per-task={site.ranks_per_node}",
            f"--gpus-per-node={site.ranks_per_node}",
        ]
        assert f"sbatch {slurm}/{site.name}.sbatch" in text  # the header: as the docs say
        assert "set -euo pipefail" in text
        # The run lands beside the job file, wherever sbatch is run from.
        out = str(job_file.resolve().parent / "runs" / f"demo-{site.name}")
        expected = [
            f"--cpus-per-task={site.ranks_per_node}",
            *("isthmus", "site", str(job_file.resolve()), "--site", site.name, "--out", out),
        ]
        if site.nodes > 1:
            expected += ["--rdzv-endpoint", "gpu17:29400"]
        # One node: no fixed rendezvous port (isthmus site runs torchrun --standalone).
        assert run_sbatch(script, tmp_path) == expected
        assert run_sbatch(script, tmp_path / "elsewhere") == expected


def test_gpus_and_paths_come_from_the_flags(capsys, job_file, tmp_path):
    out = tmp_path / "out"
    code, _, stderr = render(
        capsys, job_file, out, "--target", "slurm",
        "--job-path", "/shared/jobs/demo.yaml", "--run-dir", "/scratch/{site}",
    )  # fmt: skip
    assert code == 0, stderr
    text = (out / "us-east.sbatch").read_text()
    assert "--gpus-per-node" not in text
    assert "JOB_FILE=/shared/jobs/demo.yaml" in text and "RUN_DIR=/scratch/us-east" in text
    code, _, stderr = render(
        capsys, job_file, tmp_path / "cpus", "--target", "slurm",
        "--job-path", "/shared/jobs/demo.yaml", "--run-dir", "runs/{site}", "--cpus-per-rank", "4",
    )  # fmt: skip
    assert code == 0, stderr
    text = (tmp_path / "cpus" / "us-east.sbatch").read_text()
    assert "#SBATCH --cpus-per-task=8" in text and "srun --cpus-per-task=8 " in text
    # The limits a cluster may ask for, commented out where an operator fills them in.
    for line in ("##SBATCH --time=HH:MM:SS", "##SBATCH --partition=", "##SBATCH --account="):
        assert line in text, line
    assert "RUN_DIR=/shared/jobs/runs/us-east" in text  # relative: from the job file's folder
    code, _, stderr = render(
        capsys, job_file, tmp_path / "none", "--target", "slurm", "--cpus-per-rank", "0"
    )
    assert code == 2 and "--cpus-per-rank: must be >= 1, got 0" in stderr
    code, _, stderr = render(capsys, job_file, tmp_path / "k", "--target", "kubernetes")
    assert code == 0, stderr
    _, _, indexed_job, _ = site_objects(tmp_path / "k", "us-east")
    (container,) = indexed_job["spec"]["template"]["spec"]["containers"]
    assert "resources" not in container and container["image"] == "isthmus:latest"


# -- the broker ---------------------------------------------------------------------------
def test_the_acl_lets_each_site_write_only_its_own_topics(slurm, kubernetes):
    acl = (slurm / "broker" / "acl").read_text()
    (config_map,) = manifests(kubernetes / "broker")["ConfigMap"]
    assert config_map["data"]["acl"] == acl  # one ACL for both targets
    lines = [line for line in acl.splitlines() if line and not line.startswith("#")]
    assert "pattern read isthmus/demo/#" in lines
    assert "pattern write isthmus/demo/sites/%u/status" in lines
    assert "pattern write isthmus/demo/metrics/%u" in lines
    users: dict[str, list[str]] = {}
    for line in lines:
        if line.startswith("user "):
            users[line.split()[1]] = current = []
        elif line.startswith("topic "):
            current.append(line)
    assert users == {
        **{site: ["topic write isthmus/demo/membership"] for site in SITES},
        "operator": ["topic write isthmus/demo/config"],
    }
    conf = (slurm / "broker" / "mosquitto.conf").read_text()
    for setting in (
        "require_certificate true",
        "use_identity_as_username true",
        "allow_anonymous false",
        "acl_file acl",
    ):
        assert setting in conf.splitlines()


@needs_mosquitto
def test_the_rendered_broker_admits_the_sites_and_enforces_the_acl(slurm, job, tmp_path):
    broker = shutil.copytree(slurm / "broker", tmp_path / "broker")
    (broker / "certs").mkdir()
    for name in ("ca.crt", "broker.crt", "broker.key"):  # as broker/README.md says
        shutil.copy(Path(job.source).parent / "pki" / name, broker / "certs")
    # Started as root, Mosquitto switches to its own user, which cannot read the
    # test's private folder: stay who we are.
    with (broker / "mosquitto.conf").open("a") as conf:
        conf.write(f"user {getpass.getuser()}\n")
    assert job.control is not None
    port = job.control.broker.port
    process = subprocess.Popen(
        [MOSQUITTO, "-c", "mosquitto.conf"], cwd=broker, stderr=subprocess.PIPE
    )
    try:
        deadline = time.monotonic() + 10
        while not listening(port):
            assert process.poll() is None, process.stderr.read() if process.stderr else ""
            assert time.monotonic() < deadline, "mosquitto did not start"
            time.sleep(0.02)
        received = asyncio.run(_exchange(job))
    finally:
        process.terminate()
        process.wait(10)
    assert received == {
        "isthmus/demo/sites/us-east/status",
        "isthmus/demo/metrics/us-east",
        "isthmus/demo/membership",
        "isthmus/demo/config",  # from the operator
    }


async def _exchange(job: Job) -> set[str]:
    """Site us-east publishes to its own topics and to others'; the operator to the
    config; return the topics the operator, subscribed to the whole job, receives."""
    assert job.control is not None
    attempts = [
        "isthmus/demo/sites/us-east/status",
        "isthmus/demo/metrics/us-east",
        "isthmus/demo/membership",
        "isthmus/demo/sites/eu-west/status",  # another site's: dropped
        "isthmus/demo/metrics/eu-west",  # dropped
        "isthmus/demo/config",  # the operator's: dropped
    ]
    received: set[str] = set()
    async with job.control.broker_for(None).client("operator") as operator:
        await operator.subscribe("isthmus/demo/#", qos=1)
        async with job.control.broker_for("us-east").client("us-east") as site:
            for topic in attempts:
                await site.publish(topic, b"{}", qos=1)
        await operator.publish("isthmus/demo/config", b"{}", qos=1)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(1.0):
                async for message in operator.messages:
                    received.add(str(message.topic))
    return received


# -- no secrets, bad input ----------------------------------------------------------------
def test_no_rendered_file_holds_a_key_or_the_password(capsys, job_file, tmp_path, monkeypatch):
    monkeypatch.setenv("ISTHMUS_TEST_MQTT_PASSWORD", "hunter2-never-rendered")
    keys = [
        "".join(path.read_text().splitlines()[1:-1])  # the key's base64 body
        for path in (job_file.parent / "pki").glob("*.key")
    ]
    assert len(keys) == len(SITES) + 3  # sites, ca, broker, operator
    for target in ("slurm", "kubernetes"):
        out = tmp_path / target
        code, _, stderr = render(capsys, job_file, out, "--target", target, "--gpus")
        assert code == 0, stderr
        for path in out.rglob("*"):
            if path.is_file():
                flat = "".join(path.read_text().split())
                assert "PRIVATE KEY" not in flat and "hunter2" not in flat, path
                assert not any(key in flat for key in keys), path


def bad_job(tmp_path: Path, job_file: Path, old: str, new: str) -> Path:
    path = tmp_path / "bad.yaml"
    text = job_file.read_text()
    assert old in text
    path.write_text(text.replace(old, new).replace("pki/", f"{job_file.parent}/pki/"))
    return path


@pytest.mark.parametrize(
    ("old", "new", "message"),
    [
        (
            "  password_env: ISTHMUS_TEST_MQTT_PASSWORD\n",
            "  password: hunter2\n",
            "control.password: an inline password",
        ),
        (", address: 0.0.0.0:7300", "", "sites[2].address: missing for site 'asia-east'"),
        ("name: eu-west", "name: operator", "sites[1].name: 'operator'"),
    ],
)
def test_a_job_that_cannot_be_deployed_is_refused(capsys, job_file, tmp_path, old, new, message):
    path = bad_job(tmp_path, job_file, old, new)
    for target in ("slurm", "kubernetes"):
        out = tmp_path / target
        code, _, stderr = render(capsys, path, out, "--target", target)
        assert code == 2
        assert message in stderr and len(stderr.strip().splitlines()) == 1, stderr
        assert not out.exists()
    if "password" in message:
        assert "password_env" in stderr


def test_names_too_long_for_kubernetes_are_refused(capsys, job_file, tmp_path):
    path = bad_job(tmp_path, job_file, "name: demo", f"name: {'x' * 50}")
    code, _, stderr = render(capsys, path, tmp_path / "out", "--target", "kubernetes")
    assert code == 2 and "longer than 63 characters" in stderr
    code, _, stderr = render(capsys, path, tmp_path / "slurm", "--target", "slurm")
    assert code == 0, stderr  # Slurm takes long job names


def test_an_out_folder_with_files_is_never_overwritten(capsys, job_file, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "mine.txt").write_text("keep")
    code, _, stderr = render(capsys, job_file, out, "--target", "slurm")
    assert code == 2 and "--out" in stderr and "not empty" in stderr
    assert [p.name for p in out.iterdir()] == ["mine.txt"]


def test_pods_declare_every_ranks_metrics_port_for_prometheus(capsys, job_file, tmp_path):
    scraped = tmp_path / "job.yaml"
    scraped.write_text(job_file.read_text() + "metrics: {prometheus_port: 9400}\n")
    for certs in job_file.parent.iterdir():  # the certificates the job file names
        if certs.is_dir():
            (tmp_path / certs.name).symlink_to(certs)
    out = tmp_path / "k8s"
    code, _, stderr = render(capsys, scraped, out, "--target", "kubernetes")
    assert code == 0, stderr
    for site in load_job(scraped).sites:
        indexed_job = site_objects(out, site.name)[2]
        template = indexed_job["spec"]["template"]
        assert template["metadata"]["annotations"] == {
            "prometheus.io/scrape": "true",
            "prometheus.io/port": "9400",
            "prometheus.io/path": "/metrics",
        }
        (container,) = template["spec"]["containers"]
        metrics = [p for p in container["ports"] if p["name"].startswith("metrics-")]
        assert [p["containerPort"] for p in metrics] == [
            9400 + r for r in range(site.ranks_per_node)
        ]


@pytest.mark.parametrize(
    ("image", "ok"),
    [
        ("isthmus:latest", True),
        ("ghcr.io/acme/isthmus:0.1", True),
        ("registry.local:5000/team/isthmus-cuda:2026.11", True),
        ("isthmus@sha256:" + "ab" * 32, True),
        ("", False),
        ("my image", False),
        ("Isthmus:latest", False),
        ("isthmus:", False),
        ("isthmus:latest ", False),
    ],
)
def test_the_image_is_checked_before_anything_is_written(capsys, job_file, tmp_path, image, ok):
    out = tmp_path / "k8s"
    code, _, stderr = render(capsys, job_file, out, "--target", "kubernetes", "--image", image)
    if ok:
        assert code == 0, stderr
        indexed_job = site_objects(out, "us-east")[2]
        assert indexed_job["spec"]["template"]["spec"]["containers"][0]["image"] == image
    else:
        assert code == 2 and "--image:" in stderr and "is not an image reference" in stderr
        assert not out.exists()


def test_the_podman_variant_of_the_manifests_differs_only_where_podman_cannot_play_them(
    tmp_path, capsys
):
    """benchmarks/kube_play.py's list of differences, checked on a rendered site of
    two nodes (tests/test_containers.py plays a real one)."""
    import importlib.util
    import sys

    bench = Path(__file__).resolve().parents[1] / "benchmarks"
    sys.path.insert(0, str(bench))
    spec = importlib.util.spec_from_file_location("kube_play", bench / "kube_play.py")
    assert spec is not None and spec.loader is not None
    kube = importlib.util.module_from_spec(spec)
    sys.modules["kube_play"] = kube  # its dataclasses look their module up
    spec.loader.exec_module(kube)
    job = tmp_path / "job.yaml"
    job.write_text(
        "name: v\nsites:\n"
        "  - {name: a, ranks: 4, nodes: 2, address: 0.0.0.0:7100, advertise: a.example:7100}\n"
        "  - {name: b, address: 0.0.0.0:7100, advertise: b.example:7100}\n"
        "control: {broker: mqtt://broker.example:1883}\ninsecure: true\n"
    )
    out = tmp_path / "deploy"
    assert main(["deploy", "render", str(job), "--target", "kubernetes", "--out", str(out)]) == 0
    capsys.readouterr()
    rendered = [d for p in sorted((out / "a").glob("*.yaml")) for d in yaml.safe_load_all(p.read_text())]
    (indexed,) = [d for d in rendered if d["kind"] == "Job"]
    variant = kube.podman_variant(rendered)
    assert sorted(d["kind"] for d in variant) == ["ConfigMap", "Pod", "Pod"]  # no Services
    pods = [d for d in variant if d["kind"] == "Pod"]
    for k, pod in enumerate(pods):
        assert pod["metadata"]["name"] == f"{indexed['metadata']['name']}-{k}"
        assert pod["metadata"]["labels"][kube.INDEX_LABEL] == str(k)
        template = indexed["spec"]["template"]["spec"]
        (container,) = pod["spec"]["containers"]
        (original,) = template["containers"]
        assert container["command"] == original["command"]  # the same command
        assert {"name": "JOB_COMPLETION_INDEX", "value": str(k)} in container["env"]
        assert "ports" not in container and container["imagePullPolicy"] == "IfNotPresent"
        assert all("subPath" not in m for m in container["volumeMounts"])
        volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
        assert f"{pod['metadata']['name']}-out" in volumes  # an emptyDir of its own
        assert all(v["secret"]["optional"] is False for v in volumes.values() if "secret" in v)
    # The rendered files themselves are left as they were.
    assert any("subPath" in m for m in indexed["spec"]["template"]["spec"]["containers"][0]["volumeMounts"])
