"""The rendered Kubernetes manifests, played by ``podman kube play``: a 2-site
DiLoCo job rendered by ``isthmus deploy render --target kubernetes``, its Secrets
made by the rendered ``secrets.sh`` (run unchanged, with a ``kubectl`` that makes
podman secrets), the broker's and each site's files played on one podman
network, every site finished with one ``param_sha256``.

    python benchmarks/kube_play.py [--out DIR]

podman 4.3 plays Pods, Deployments, ConfigMaps and Secrets; it skips Services
and Jobs. What this plays differs from the rendered files in exactly these
ways (:func:`podman_variant`), each for a podman limit, not a choice:

1. each Indexed Job becomes its pods, ``<job>-<k>``, with the template's labels
   plus ``batch.kubernetes.io/job-completion-index`` and ``JOB_COMPLETION_INDEX``
   in the environment (what the Job controller adds);
2. a secret volume says ``optional: false`` (podman 4.3 dereferences an unset
   ``optional`` and panics);
3. a ``subPath`` mount becomes the whole volume at the parent folder (podman
   ignores ``subPath`` and would make ``job.yaml`` a directory);
4. an ``emptyDir`` gets its pod's name (podman names the volume after the
   ``emptyDir`` alone, so every pod would share ``out``);
5. containers publish no ports (podman publishes every ``containerPort`` on the
   host, where two sites' 7100 collide; pods reach each other on the network);
6. ``imagePullPolicy: IfNotPresent`` (no registry is reachable here).

Services have no podman counterpart: the names they give (the rendezvous
service's ``<job>-0.<service>``, the LoadBalancers' advertised names, the
broker's) become network aliases of the pods. Not exercised here: Services
and LoadBalancers themselves, ``fsGroup`` and ``defaultMode`` (podman ignores
both), ``backoffLimit``, multi-node sites (one pod per node on one host), and
the strict schemas, which tests/test_render.py checks instead.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import posixpath
import subprocess
import sys
import tempfile
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from podman import SITE_IMAGE, Network, build_images, environment, podman, wait_for_log

ISTHMUS = [sys.executable, "-m", "isthmus"]
INDEX_LABEL = "batch.kubernetes.io/job-completion-index"
# `kubectl create secret generic NAME --from-file=KEY=PATH ... --dry-run=client -o
# yaml | kubectl apply -f -`, as secrets.sh runs it, made a podman secret (replaced
# when it exists): a Secret-shaped YAML document with the files' text as plain
# values, the form podman 4.3's secret volumes write out as is.
KUBECTL = r"""#!/usr/bin/env bash
set -euo pipefail
if [ "$*" = "apply -f -" ]; then
  doc=$(cat)
  name=$(printf '%s\n' "$doc" | sed -n 's/^  name: //p' | sed -n 1p)
  podman secret rm "$name" >/dev/null 2>&1 || true
  printf '%s\n' "$doc" | podman secret create "$name" - >/dev/null
  exit 0
fi
if [ "$1 $2 $3" != "create secret generic" ]; then
  echo "kubectl (podman): only 'create secret generic ... | apply -f -'" >&2; exit 2
fi
name=$4; shift 4
echo "kind: Secret"; echo "metadata:"; echo "  name: $name"; echo "data:"
for source in "$@"; do
  case "$source" in --from-file=*) ;; *) continue ;; esac
  source=${source#--from-file=}
  echo "  ${source%%=*}: |"; sed 's/^/    /' "${source#*=}"
done
"""


def _pod_spec(spec: dict[str, Any], pod: str) -> None:
    """Changes 2-6 of the module's list, on one pod's spec."""
    renamed = {}
    for volume in spec.get("volumes", []):
        if "emptyDir" in volume:
            renamed[volume["name"]] = volume["name"] = f"{pod}-{volume['name']}"
        if "secret" in volume:
            volume["secret"].setdefault("optional", False)
    for container in spec.get("containers", []):
        container.pop("ports", None)
        container["imagePullPolicy"] = "IfNotPresent"
        for mount in container.get("volumeMounts", []):
            mount["name"] = renamed.get(mount["name"], mount["name"])
            sub = mount.pop("subPath", None)
            if sub is not None:
                if posixpath.basename(mount["mountPath"]) != sub:
                    raise ValueError(f"a subPath mount not at .../{sub}: {mount}")
                mount["mountPath"] = posixpath.dirname(mount["mountPath"])


def podman_variant(manifests: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The manifests as podman 4.3 can play them (the module's list of changes)."""
    played = []
    for manifest in map(copy.deepcopy, manifests):
        kind = manifest["kind"]
        if kind == "Job":
            spec = manifest["spec"]
            for k in range(spec.get("completions", 1)):
                template = copy.deepcopy(spec["template"])
                metadata = template.setdefault("metadata", {})
                metadata["name"] = f"{manifest['metadata']['name']}-{k}"
                metadata.setdefault("labels", {})[INDEX_LABEL] = str(k)
                for container in template["spec"]["containers"]:
                    env = container.setdefault("env", [])
                    env.append({"name": "JOB_COMPLETION_INDEX", "value": str(k)})
                _pod_spec(template["spec"], metadata["name"])
                played.append(
                    {"apiVersion": "v1", "kind": "Pod", "metadata": metadata,
                     "spec": template["spec"]}
                )  # fmt: skip
        elif kind == "Deployment":
            _pod_spec(manifest["spec"]["template"]["spec"], f"{manifest['metadata']['name']}-pod-0")
            played.append(manifest)
        elif kind in ("ConfigMap", "Secret", "Pod"):
            played.append(manifest)
        # Services: no podman counterpart (their names become network aliases).
    return played


def _read(folder: Path) -> list[dict[str, Any]]:
    return [
        doc
        for path in sorted(folder.glob("*.yaml"))
        for doc in yaml.safe_load_all(path.read_text())
        if doc
    ]


def _aliases(manifests: list[dict[str, Any]], job: dict[str, Any], site: str | None) -> list[str]:
    """The names Services would give this folder's pods: the rendezvous names of a
    Job's pods (``<job>-<k>.<subdomain>``), and the site's advertised hosts or
    the broker's host from the job file."""
    names = []
    for manifest in manifests:
        if manifest["kind"] == "Job":
            sub = manifest["spec"]["template"]["spec"].get("subdomain")
            for k in range(manifest["spec"].get("completions", 1)):
                if sub:
                    names.append(f"{manifest['metadata']['name']}-{k}.{sub}")
    if site is None:
        broker = job["control"]["broker"].split("://", 1)[1]
        names.append(broker.rsplit(":", 1)[0])
    else:
        (spec,) = [s for s in job["sites"] if s["name"] == site]
        names.append(spec["advertise"].rsplit(":", 1)[0])
    return names


@dataclass
class Played:
    digests: dict[str, str]
    wall_s: float
    logs: dict[str, str]


def play(folder: Path, image: str = SITE_IMAGE, steps: int = 20) -> Played:
    """Render a 2-site job for Kubernetes into ``folder`` and play it."""
    started = time.monotonic()
    job_path = folder / "job.yaml"
    job_path.write_text(textwrap.dedent(f"""\
        name: kube
        sites:
          - {{name: a, ranks: 1, address: 0.0.0.0:7100, advertise: a.kube.test:7100}}
          - {{name: b, ranks: 1, address: 0.0.0.0:7100, advertise: b.kube.test:7100}}
        train: {{strategy: diloco, steps: {steps}, sync_every: 10, warmup_steps: 2}}
        tls: {{ca: certs/ca.crt, cert: "certs/{{site}}.crt", key: "certs/{{site}}.key"}}
        control:
          broker: mqtts://broker.kube.test:8883
          tls: {{ca: certs/ca.crt, cert: "certs/{{site}}.crt", key: "certs/{{site}}.key"}}
        """))
    for args in (
        ["certs", "job.yaml", "--out", "certs", "--broker", "broker.kube.test"],
        ["deploy", "render", "job.yaml", "--target", "kubernetes", "--out", "deploy",
         "--image", image],
    ):  # fmt: skip
        done = subprocess.run([*ISTHMUS, *args], cwd=folder, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"isthmus {' '.join(args)}: {done.stderr[-2000:]}")
    job = yaml.safe_load(job_path.read_text())
    tools = folder / "bin"
    tools.mkdir()
    (tools / "kubectl").write_text(KUBECTL)
    (tools / "kubectl").chmod(0o755)
    env = {**environment(), "PATH": f"{tools}{os.pathsep}{os.environ['PATH']}"}
    owners = ["broker", "a", "b"]
    secrets: list[str] = []
    played: list[Path] = []
    with Network() as net:
        try:
            for owner in owners:
                before = set(_secret_names())
                done = subprocess.run(
                    ["bash", "deploy/secrets.sh", owner], cwd=folder, env=env,
                    capture_output=True, text=True, timeout=60,
                )  # fmt: skip
                if done.returncode != 0:
                    raise RuntimeError(f"secrets.sh {owner}: {done.stderr[-2000:]}")
                secrets += sorted(set(_secret_names()) - before)
            for owner in owners:
                manifests = _read(folder / "deploy" / owner)
                variant = folder / f"podman-{owner}.yaml"
                variant.write_text(yaml.safe_dump_all(podman_variant(manifests), sort_keys=False))
                aliases = _aliases(manifests, job, None if owner == "broker" else owner)
                network = f"{net.name}:" + ",".join(f"alias={a}" for a in aliases)
                podman("kube", "play", "--network", network, str(variant), timeout=180)
                played.append(variant)
                if owner == "broker":  # up before the sites start, as an operator would
                    wait_for_log("isthmus-kube-broker-pod-0-mosquitto", " running")
            pods = {site: f"isthmus-kube-{site}-0" for site in ("a", "b")}
            codes = {}
            for site, pod in pods.items():
                done = podman("wait", f"{pod}-site", timeout=600, check=False)
                codes[site] = int(done.stdout.strip() or -1)
            logs = {site: _logs(f"{pod}-site") for site, pod in pods.items()}
            failed = {s: c for s, c in codes.items() if c != 0}
            if failed:
                raise RuntimeError(
                    f"sites exited non-zero {failed}:\n"
                    + "\n".join(f"--- {s}\n{logs[s][-3000:]}" for s in failed)
                )
            digests = {}
            for site, pod in pods.items():
                volume = podman(
                    "volume", "inspect", "--format", "{{.Mountpoint}}", f"{pod}-out"
                ).stdout.strip()
                result = Path(volume) / "sites" / site / "result.json"
                digests[site] = json.loads(result.read_text())["param_sha256"]
        finally:
            for variant in reversed(played):
                podman("kube", "down", str(variant), check=False, timeout=180)
            volumes = podman(
                "volume", "ls", "--quiet", "--filter", "name=isthmus-kube", check=False
            ).stdout.split()
            if volumes:
                podman("volume", "rm", "--force", *volumes, check=False)
            if secrets:
                podman("secret", "rm", *secrets, check=False)
    return Played(digests=digests, wall_s=time.monotonic() - started, logs=logs)


def _logs(container: str) -> str:
    done = podman("logs", container, check=False)
    return done.stdout + done.stderr


def _secret_names() -> list[str]:
    done = podman("secret", "ls", "--format", "{{.Name}}", check=False)
    return done.stdout.split()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="keep the rendered and played files here")
    args = parser.parse_args()
    images = build_images()
    folder = args.out or Path(tempfile.mkdtemp(prefix="kube-play-"))
    folder.mkdir(parents=True, exist_ok=True)
    played = play(folder, images.site)
    for site, digest in played.digests.items():
        print(f"site {site}: param_sha256 {digest}")
    print(f"wall {played.wall_s:.1f} s; {len(set(played.digests.values()))} distinct model(s)")
    return 0 if len(set(played.digests.values())) == 1 else 1


if __name__ == "__main__":
    raise SystemExit(main())
