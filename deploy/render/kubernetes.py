"""``isthmus deploy render --target kubernetes``: per site a ConfigMap, a headless
Service, an Indexed Job (a pod per node) and a LoadBalancer per node; the broker's
Deployment and Service; ``secrets.sh`` for the certificates.

What both targets share (checks, ports, the broker's files) is
:mod:`isthmus.deploy.render.cluster`.
"""

from __future__ import annotations

import copy
import re
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from isthmus.deploy.render.cluster import (
    broker_files,
    broker_port,
    certs_dir,
    check_job,
)
from isthmus.deploy.usage import UsageError
from isthmus.job.file import Job, SiteSpec
from isthmus.job.model import MetricsSpec
from isthmus.job.ports import RDZV_PORT

BROKER_IMAGE = "eclipse-mosquitto:2"
MOSQUITTO_UID = 1883
"""The user eclipse-mosquitto drops to; it must be able to read the broker's key."""

# Where things are inside a site's pod. The certificates are mounted beside the
# job file, so the job file names them relative to itself (certs/ca.crt).
POD_JOB_FILE = "/etc/isthmus/job.yaml"
POD_CERTS_RELATIVE = "certs"
POD_CERTS = f"/etc/isthmus/{POD_CERTS_RELATIVE}"
POD_OUT = "/var/lib/isthmus"
K8S_NAME_LIMIT = 63


def _listen_port(site: SiteSpec, rank: int) -> int:
    assert site.address is not None  # check_job
    return site.address[1] + rank


def _node_ranks(site: SiteSpec, node: int) -> range:
    """The site's ranks that torchrun starts on ``node``: node-major, as its node rank."""
    per_node = site.ranks_per_node
    return range(node * per_node, (node + 1) * per_node)


@dataclass(frozen=True)
class _SiteObjects:
    """The names of one site's Kubernetes objects."""

    job: str
    """The Indexed Job; its pod k is ``<job>-k``."""
    rdzv: str
    config: str
    tls: str
    labels: dict[str, str]

    def node_service(self, node: int) -> str:
        return f"{self.job}-node-{node}"


def _k8s_name(*parts: str) -> str:
    """Isthmus names allow ``_``, ``.`` and capitals; Kubernetes object names are
    lower-case DNS labels."""
    return re.sub(r"[^a-z0-9-]+", "-", "-".join(parts).lower()).strip("-")


def _site_objects(job: Job, site: SiteSpec) -> _SiteObjects:
    base = _k8s_name("isthmus", job.name, site.name)
    names = _SiteObjects(
        job=base,
        rdzv=f"{base}-rdzv",
        config=f"{base}-job",
        tls=f"{base}-tls",
        labels={
            "app.kubernetes.io/name": "isthmus",
            "isthmus/job": _k8s_name(job.name),
            "isthmus/site": _k8s_name(site.name),
        },
    )
    _check_length(job, names.node_service(site.nodes - 1))  # longer than pod names (<job>-k)
    return names


def _check_length(job: Job, name: str) -> str:
    if len(name) > K8S_NAME_LIMIT:
        raise UsageError(
            f"{job.source}: the Kubernetes name {name!r} is longer than {K8S_NAME_LIMIT} "
            "characters; shorten the job's or the site's name"
        )
    return name


@dataclass(frozen=True)
class _PodCerts:
    """The certificate files a site's pods need, and the job file's TLS paths
    rewritten to where the Secret holding them is mounted."""

    files: dict[str, Path]
    """Secret key (its file name under :data:`POD_CERTS`) -> the file on this machine."""
    tls: dict[str, str] | None
    control_tls: dict[str, str] | None


def _pod_certs(job: Job, site: str) -> _PodCerts:
    files: dict[str, Path] = {}

    def mount(name: str, path: Path) -> str:
        """The path, relative to the pod's job file, at which ``path`` is mounted;
        a file named by both tls sections is mounted once."""
        path = path.resolve()
        key = next((k for k, known in files.items() if known == path), None)
        if key is None:
            key = name if name not in files else f"control-{name}"
            files[key] = path
        return f"{POD_CERTS_RELATIVE}/{key}"

    tls = None
    if job.tls is not None:
        spec = job.tls
        tls = {
            "ca": mount("ca.crt", spec.base / spec.ca),
            "cert": mount(f"{site}.crt", spec.base / spec.cert.replace("{site}", site)),
            "key": mount(f"{site}.key", spec.base / spec.key.replace("{site}", site)),
        }
        if spec.crl_path is not None:
            # Mounted from the site's secret: a secret updated in place reaches the
            # pod and the site reads the list again (no restart).
            tls["crl"] = mount("revoked.crl", spec.crl_path)
    control_tls = None
    if job.control is not None and job.control.broker.tls_ca is not None:
        login = job.control.broker_for(site)
        assert login.tls_ca is not None
        control_tls = {"ca": mount("ca.crt", Path(login.tls_ca))}
        if login.tls_cert is not None and login.tls_key is not None:
            control_tls["cert"] = mount(f"{site}.crt", Path(login.tls_cert))
            control_tls["key"] = mount(f"{site}.key", Path(login.tls_key))
    return _PodCerts(files=files, tls=tls, control_tls=control_tls)


def pod_job_file(job: Job, certs: _PodCerts) -> str:
    """The job file as a site's pod reads it: TLS paths point into the mounted Secret."""
    raw = copy.deepcopy(job.raw)
    if certs.tls is not None:
        raw["tls"] = certs.tls
    if certs.control_tls is not None:
        raw["control"]["tls"] = certs.control_tls
    # Flow style for short lists and mappings, as job files are written by hand.
    return yaml.dump(raw, Dumper=_Dumper, sort_keys=False, default_flow_style=None)


def render_kubernetes(job: Job, *, image: str, gpus: bool) -> dict[str, str]:
    """Per site ``<site>/*.yaml``, the broker's ``broker/*.yaml``, and ``secrets.sh``."""
    check_job(job)
    files: dict[str, str] = {}
    secrets: list[_Secret] = []
    for site in job.sites:
        names = _site_objects(job, site)
        certs = _pod_certs(job, site.name)
        secrets.append(_Secret(site.name, names.tls, certs.files))
        for name, manifest in site_manifests(job, site, names, certs, image=image, gpus=gpus):
            files[f"{site.name}/{name}"] = _manifest_text(
                manifest, f"site {site.name} of the Isthmus job {job.name!r}: apply in its cluster"
            )
    broker = _k8s_name("isthmus", job.name, "broker")
    broker_certs = {key: certs_dir(job) / key for key in ("ca.crt", "broker.crt", "broker.key")}
    secrets.append(_Secret("broker", _check_length(job, f"{broker}-tls"), broker_certs))
    for name, manifest in broker_manifests(job, broker):
        files[f"broker/{name}"] = _manifest_text(
            manifest, f"the broker of the Isthmus job {job.name!r}"
        )
    files["secrets.sh"] = secrets_script(job, secrets)
    return files


def site_manifests(
    job: Job, site: SiteSpec, names: _SiteObjects, certs: _PodCerts, *, image: str, gpus: bool
) -> list[tuple[str, dict[str, Any]]]:
    manifests = [
        (
            "configmap.yaml",
            _config_map(names.config, names.labels, {"job.yaml": pod_job_file(job, certs)}),
        ),
        ("headless-service.yaml", _headless_service(names)),
        (
            "indexed-job.yaml",
            _indexed_job(site, names, certs, image=image, gpus=gpus, metrics=job.metrics),
        ),
    ]
    for node in range(site.nodes):
        manifests.append((f"node-{node}-service.yaml", _node_service(site, names, node)))
    return manifests


def _config_map(name: str, labels: dict[str, str], data: dict[str, str]) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": name, "labels": labels},
        "data": data,
    }


def _headless_service(names: _SiteObjects) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": names.rdzv, "labels": names.labels},
        "spec": {
            "clusterIP": "None",  # headless: DNS names the pods themselves
            # Pod 0's name must resolve while the pods start, before any is Ready.
            "publishNotReadyAddresses": True,
            "selector": names.labels,
            "ports": [{"name": "rdzv", "port": RDZV_PORT, "targetPort": RDZV_PORT}],
        },
    }


def _indexed_job(
    site: SiteSpec,
    names: _SiteObjects,
    certs: _PodCerts,
    *,
    image: str,
    gpus: bool,
    metrics: MetricsSpec | None = None,
) -> dict[str, Any]:
    rdzv = f"{names.job}-0.{names.rdzv}:{RDZV_PORT}"
    # One pod template for every node: it declares every rank's port; pod k
    # listens on its own ranks' ports, which node k's Service exposes.
    ports = [{"name": "rdzv", "containerPort": RDZV_PORT, "protocol": "TCP"}]
    ports += [
        {"name": f"rank-{rank}", "containerPort": _listen_port(site, rank), "protocol": "TCP"}
        for rank in range(site.ranks)
    ]
    template_metadata: dict[str, Any] = {"labels": names.labels}
    if metrics is not None:
        # Each rank of the pod serves /metrics on prometheus_port + its local rank; a
        # Prometheus with pod discovery finds every declared port of a scraped pod.
        ports += [
            {"name": f"metrics-{r}", "containerPort": metrics.prometheus_port + r}
            for r in range(site.ranks_per_node)
        ]
        # The annotations most scrape configs key on (one port: rank 0's); the declared
        # metrics-R ports are every rank's (docs/prometheus.md has a scrape config).
        template_metadata["annotations"] = {
            "prometheus.io/scrape": "true",
            "prometheus.io/port": str(metrics.prometheus_port),
            "prometheus.io/path": "/metrics",
        }
    mounts: list[dict[str, Any]] = [
        {"name": "job-file", "mountPath": POD_JOB_FILE, "subPath": "job.yaml"},
        {"name": "out", "mountPath": POD_OUT},
    ]
    volumes: list[dict[str, Any]] = [
        {"name": "job-file", "configMap": {"name": names.config}},
        {"name": "out", "emptyDir": {}},
    ]
    if certs.files:
        mounts.append({"name": "certs", "mountPath": POD_CERTS, "readOnly": True})
        volumes.append({"name": "certs", "secret": {"secretName": names.tls, "defaultMode": 0o400}})
    container: dict[str, Any] = {
        "name": "site",
        "image": image,
        "command": [
            *("isthmus", "site", POD_JOB_FILE, "--site", site.name),
            *("--out", POD_OUT, "--rdzv-endpoint", rdzv),
        ],
        "ports": ports,
        "volumeMounts": mounts,
    }
    if gpus:
        container["resources"] = {"limits": {"nvidia.com/gpu": site.ranks_per_node}}
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": names.job, "labels": names.labels},
        "spec": {
            "completionMode": "Indexed",
            "completions": site.nodes,
            "parallelism": site.nodes,
            # A failed pod ends the site's whole torchrun group, so a replacement pod
            # could not join it: the site is started again as a whole (docs/deploy.md).
            "backoffLimit": 0,
            "template": {
                "metadata": template_metadata,
                "spec": {
                    # Pod k is <job>-k.<subdomain>: how every node finds node 0.
                    "subdomain": names.rdzv,
                    "restartPolicy": "Never",
                    "containers": [container],
                    "volumes": volumes,
                },
            },
        },
    }


def _node_service(site: SiteSpec, names: _SiteObjects, node: int) -> dict[str, Any]:
    ports = []
    for rank in _node_ranks(site, node):
        port = _listen_port(site, rank)
        ports.append({"name": f"rank-{rank}", "port": port, "targetPort": port, "protocol": "TCP"})
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": names.node_service(node), "labels": names.labels},
        "spec": {
            "type": "LoadBalancer",
            "selector": {**names.labels, "batch.kubernetes.io/job-completion-index": str(node)},
            "ports": ports,
        },
    }


def broker_manifests(job: Job, name: str) -> list[tuple[str, dict[str, Any]]]:
    labels = {"app.kubernetes.io/name": "isthmus-broker", "isthmus/job": _k8s_name(job.name)}
    config = broker_files(job, certs="/mosquitto/certs", acl="/mosquitto/config/acl")
    port = broker_port(job)
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name, "labels": labels},
        "spec": {
            "replicas": 1,  # one broker per job: retained messages live in it
            "strategy": {"type": "Recreate"},
            "selector": {"matchLabels": labels},
            "template": {
                "metadata": {"labels": labels},
                "spec": {
                    # Mosquitto drops to its own user, which reads the key as this group.
                    "securityContext": {"fsGroup": MOSQUITTO_UID},
                    "containers": [
                        {
                            "name": "mosquitto",
                            "image": BROKER_IMAGE,
                            "ports": [{"name": "mqtts", "containerPort": port, "protocol": "TCP"}],
                            "volumeMounts": [
                                {"name": "config", "mountPath": "/mosquitto/config"},
                                {
                                    "name": "certs",
                                    "mountPath": "/mosquitto/certs",
                                    "readOnly": True,
                                },
                            ],
                        }
                    ],
                    "volumes": [
                        {"name": "config", "configMap": {"name": name}},
                        {
                            "name": "certs",
                            "secret": {"secretName": f"{name}-tls", "defaultMode": 0o440},
                        },
                    ],
                },
            },
        },
    }
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name, "labels": labels},
        "spec": {
            "type": "LoadBalancer",  # the sites are in other clusters
            "selector": labels,
            "ports": [{"name": "mqtts", "port": port, "targetPort": port, "protocol": "TCP"}],
        },
    }
    return [
        ("configmap.yaml", _config_map(name, labels, config)),
        ("deployment.yaml", deployment),
        ("service.yaml", service),
    ]


@dataclass(frozen=True)
class _Secret:
    owner: str
    """The site, or ``broker``: whose cluster the Secret is made in."""
    name: str
    files: dict[str, Path]
    """Key -> the file on this machine."""


def secrets_script(job: Job, secrets: list[_Secret]) -> str:
    """``secrets.sh SITE|broker``: the Secrets, made from the certificate files where
    they are, with kubectl pointed at that site's (or the broker's) cluster."""
    branches = []
    for secret in secrets:
        # Every site has a branch, so the same two steps deploy any site.
        if not secret.files:
            command = f'echo "{secret.owner}: the job file names no certificates; no Secret"'
        else:
            sources = " \\\n      ".join(
                shlex.quote(f"--from-file={key}={path}") for key, path in secret.files.items()
            )
            # create --dry-run | apply: made the first time, replaced by a second run
            # (new certificates), never "already exists".
            command = (
                f"kubectl create secret generic {secret.name} \\\n      {sources} \\\n"
                "      --dry-run=client -o yaml | kubectl apply -f -"
            )
        branches.append(f"  {secret.owner})\n    {command}\n    ;;")
    choices = "|".join([*(s.name for s in job.sites), "broker"])
    return (
        "#!/bin/bash\n"
        f'# The TLS Secrets of the Isthmus job "{job.name}", made from the certificate\n'
        "# files on this machine (nothing secret is in the rendered manifests).\n"
        "# Run once per site, and once for the broker, with kubectl pointed at that cluster\n"
        "# (again after new certificates: it replaces the Secret):\n"
        f"#   bash secrets.sh {choices}\n"
        "set -euo pipefail\n\n"
        'case "${1:-}" in\n' + "\n".join(branches) + "\n"
        f'  *)\n    echo "usage: $0 {choices}" >&2\n    exit 2\n    ;;\nesac\n'
    )


class _Dumper(yaml.SafeDumper):
    """Multi-line text (the job file in a ConfigMap) as a readable ``|`` block, and
    no ``&id001`` anchors where two objects share a dict (the labels)."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def _represent_text(dumper: yaml.SafeDumper, text: str) -> yaml.Node:
    style = "|" if "\n" in text else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", text, style=style)


_Dumper.add_representer(str, _represent_text)


def _manifest_text(manifest: dict[str, Any], what: str) -> str:
    header = f"# {manifest['kind']} for {what} (rendered by isthmus deploy render).\n"
    return header + yaml.dump(manifest, Dumper=_Dumper, sort_keys=False)
