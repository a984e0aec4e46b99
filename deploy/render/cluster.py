"""Ready-to-submit files for a job whose sites are real clusters (``isthmus deploy render``).

For Slurm, one batch script per site and a Mosquitto configuration for a broker
on a stable host; for Kubernetes, per site a ConfigMap with the job file, a
headless Service for torchrun's rendezvous, an Indexed Job (one pod per node)
and a LoadBalancer Service per node for the ports the other sites dial, plus the
broker as a Deployment (:mod:`isthmus.deploy.render.kubernetes`). Both targets
share one broker configuration (:func:`broker_files`): TLS with client
certificates of the job's CA, and an ACL that lets each site write only its own
topics.

Rendering is pure (a job in, ``{relative path: text}`` out); :func:`write_files`
is the only part that touches the disk. No secret material is ever rendered:
certificates and keys reach Kubernetes through ``secrets.sh`` (``kubectl create
secret ... --from-file``), and a job file with an inline broker password is
refused, because the job file itself is copied into a ConfigMap.
"""

from __future__ import annotations

import shlex
from pathlib import Path

from isthmus.deploy.usage import UsageError
from isthmus.inter.control_topics import config_topic, membership_topic, metrics_topic, status_topic
from isthmus.job.file import Job, SiteSpec
from isthmus.job.ports import RDZV_PORT

TARGETS = ("slurm", "kubernetes")
DEFAULT_IMAGE = "isthmus:latest"
"""What deploy/images/Dockerfile builds by default (CPU torch)."""
DEFAULT_GPU_IMAGE = "isthmus:latest-cuda"
"""What it builds with torch's CUDA wheels (the default with --gpus)."""
DEFAULT_BROKER_PORT = 8883

RESERVED_SITE_NAMES = ("broker", "operator")
"""Names of the broker's and operator's certificates and logins."""


# -- checks -------------------------------------------------------------------------
def check_job(job: Job) -> None:
    """Refuse what cannot be deployed as rendered files, naming the field and the fix."""
    if job.control is not None and job.control.broker.password is not None:
        raise UsageError(
            f"{job.source}: control.password: an inline password would be copied into the "
            "rendered files (the ConfigMap holds the job file); remove it and give "
            "control.password_env: VARIABLE, set where each site runs"
        )
    for index, site in enumerate(job.sites):
        if site.name in RESERVED_SITE_NAMES:
            raise UsageError(
                f"{job.source}: sites[{index}].name: {site.name!r} is the name of the "
                "broker's or operator's certificate and login; rename the site"
            )
        if site.address is None:
            raise UsageError(
                f"{job.source}: sites[{index}].address: missing for site {site.name!r}; a site "
                "on a real cluster listens for the others there (rank r on port + r) and the "
                "rendered files open those ports: add e.g. address: 0.0.0.0:7100"
            )


# -- the broker (both targets) ----------------------------------------------------------
def broker_port(job: Job) -> int:
    return job.control.broker.port if job.control is not None else DEFAULT_BROKER_PORT


def certs_dir(job: Job) -> Path:
    """Where ``isthmus certs`` put the job's CA (and the broker's files beside it): the
    folder of the control plane's or the sites' CA, else ``certs`` beside the job file,
    where ``isthmus certs JOB.yaml --out certs`` writes them."""
    if job.control is not None and job.control.broker.tls_ca is not None:
        return Path(job.control.broker.tls_ca).parent
    if job.tls is not None:
        return (job.tls.base / job.tls.ca).resolve().parent
    return Path(job.source).resolve().parent / "certs"


def broker_files(job: Job, *, certs: str, acl: str) -> dict[str, str]:
    """``mosquitto.conf`` and ``acl`` for the job's broker; ``certs`` is the folder that
    holds ca.crt, broker.crt and broker.key, ``acl`` the path of the ACL file, both as
    Mosquitto will see them."""
    return {"mosquitto.conf": mosquitto_conf(job, certs=certs, acl=acl), "acl": mosquitto_acl(job)}


def mosquitto_conf(job: Job, *, certs: str, acl: str) -> str:
    return f"""\
# Mosquitto for the Isthmus job "{job.name}" (rendered by isthmus deploy render).
# Clients log in with a certificate of the job's CA (isthmus certs JOB.yaml
# --out DIR --broker HOST); its common name is their user name, which the ACL
# matches: a site's name, or operator.
per_listener_settings false
persistence false

# TLS only: the control plane carries who is in the job and its settings.
listener {broker_port(job)}
cafile {certs}/ca.crt
certfile {certs}/broker.crt
keyfile {certs}/broker.key
tls_version tlsv1.2
require_certificate true
use_identity_as_username true

allow_anonymous false
acl_file {acl}

# Sites set a 5 s keepalive: a killed site's Last Will goes out at once (its
# socket closes); a hung host's 7.5 s after its last packet, at the broker's
# next keepalive check.
max_keepalive 60
"""


def mosquitto_acl(job: Job) -> str:
    everything = f"isthmus/{job.name}/#"
    membership = "\n".join(
        f"user {site.name}\ntopic write {membership_topic(job.name)}" for site in job.sites
    )
    return f"""\
# ACL for the Isthmus job "{job.name}" (rendered by isthmus deploy render).
# A client's user name is its certificate's common name: a site, or operator.

# Everyone in the job reads everything of the job.
pattern read {everything}

# A site writes only its own status (and Last Will) and metrics (%u: the site).
pattern write {status_topic(job.name, "%u")}
pattern write {metrics_topic(job.name, "%u")}

# Every site may publish the membership view (the leader, the first live site, does).
{membership}

# Only the operator publishes live settings (isthmus config set, the online tuner).
user operator
topic write {config_topic(job.name)}
"""


# -- Slurm ------------------------------------------------------------------------------
def render_slurm(
    job: Job,
    *,
    job_path: str,
    run_dir: str,
    gpus: bool,
    submit_from: str = ".",
    cpus_per_rank: int = 1,
) -> dict[str, str]:
    """A batch script per site (``<site>.sbatch``) and the broker (``broker/``).

    ``job_path`` is where the job file is on the clusters; ``run_dir`` where each
    site writes its run, ``{site}`` replaced by the site's name (absolute: the same
    wherever sbatch is run); ``submit_from`` the scripts' folder as the operator
    names it to sbatch (the scripts' headers say so)."""
    check_job(job)
    files = {
        f"{site.name}.sbatch": sbatch_script(
            job,
            site,
            job_path=job_path,
            run_dir=run_dir,
            gpus=gpus,
            submit_from=submit_from,
            cpus_per_rank=cpus_per_rank,
        )
        for site in job.sites
    }
    for name, text in broker_files(job, certs="certs", acl="acl").items():
        files[f"broker/{name}"] = text
    files["broker/README.md"] = broker_readme(job)
    return files


def sbatch_script(
    job: Job,
    site: SiteSpec,
    *,
    job_path: str,
    run_dir: str,
    gpus: bool,
    submit_from: str = ".",
    cpus_per_rank: int = 1,
) -> str:
    per_node = site.ranks_per_node
    gpu_line = f"#SBATCH --gpus-per-node={per_node}\n" if gpus else ""
    script = f"{submit_from.rstrip('/')}/{site.name}.sbatch"
    if site.nodes == 1:
        # One node: torchrun's rendezvous stays inside the launcher (--standalone, a
        # free port). A fixed port would meet whatever else holds it on the node.
        rendezvous = ""
        head = ""
    else:
        rendezvous = f' \\\n    --rdzv-endpoint "$HEAD_ADDR:{RDZV_PORT}"'
        head = f"""
# torchrun's c10d rendezvous store runs on the allocation's first node, port
# {RDZV_PORT}, dialled at the address Slurm reaches it at (its NodeAddr; the node's
# name where it has none). (sed, not head: head stops reading, and with a long
# host list scontrol then dies of SIGPIPE, which pipefail would turn into a
# failed job.)
HEAD=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | sed -n 1p)
HEAD_ADDR=$(scontrol show node "$HEAD" | sed -n 's/.*NodeAddr=\\([^ ]*\\).*/\\1/p')
HEAD_ADDR=${{HEAD_ADDR:-$HEAD}}
"""
    return f"""\
#!/bin/bash
# Isthmus job "{job.name}", site {site.name}: {site.ranks} ranks on {site.nodes} node(s), \
{per_node} per node.
# Submit on {site.name}'s cluster: sbatch {shlex.quote(script)}
# sbatch passes the submitting shell's environment on: submit where `isthmus` is on PATH.
#SBATCH --job-name=isthmus-{job.name}-{site.name}
#SBATCH --nodes={site.nodes}
#SBATCH --ntasks-per-node=1
#SBATCH --cpus-per-task={per_node * cpus_per_rank}
{gpu_line}# What your cluster may require: remove one '#' and fill in (the job runs until
# train.steps are done; give it room for a restart or two).
##SBATCH --time=HH:MM:SS
##SBATCH --partition=PARTITION
##SBATCH --account=ACCOUNT
set -euo pipefail

JOB_FILE={shlex.quote(job_path)}
RUN_DIR={shlex.quote(run_dir.replace("{site}", site.name))}
{head}
# One `isthmus site` per node; each starts torchrun with its node's
# {per_node} rank(s) (--nnodes {site.nodes} --nproc-per-node {per_node}), on the
# task's {per_node * cpus_per_rank} CPUs (srun gives a step only what it asks for).
srun --cpus-per-task={per_node * cpus_per_rank} isthmus site "$JOB_FILE" --site {site.name} \\
    --out "$RUN_DIR"{rendezvous}
"""


def broker_readme(job: Job) -> str:
    host = job.control.broker.host if job.control is not None else "BROKER_HOST"
    port = broker_port(job)
    source = certs_dir(job)
    return f"""\
# The broker of the Isthmus job "{job.name}"

Mosquitto on one host that every site can reach and that outlives the jobs (a
login node, a small VM), listening on port {port} with TLS. Sites and the
operator log in with certificates of the job's CA; the ACL (`acl`) lets a site
write only its own status and metrics and the membership view, and only
`operator` change settings.

1. Make the certificates once, naming the broker as the sites dial it:

       isthmus certs JOB.yaml --out {source} --broker {host}

2. On the broker host, in a copy of this folder:

       mkdir -p certs
       cp {source}/ca.crt {source}/broker.crt {source}/broker.key certs/
       mosquitto -c mosquitto.conf

   Run it as an ordinary user under a supervisor (systemd, tmux): started as
   root, Mosquitto switches to the `mosquitto` user, which must then be able
   to read `certs/broker.key`.

3. Open port {port} to the sites, and name the broker in the job file:

       control:
         broker: mqtts://{host}:{port}
         tls: {{ca: certs/ca.crt, cert: "certs/{{site}}.crt", key: "certs/{{site}}.key"}}
"""


# -- writing ----------------------------------------------------------------------------
def write_files(files: dict[str, str], out: Path) -> list[Path]:
    """Write ``files`` under ``out``, which must not exist or be empty: rendered files
    never overwrite others (a half-old, half-new set would deploy neither job)."""
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UsageError(
            f"--out: {out} exists and is not empty; rendered files never overwrite "
            "others: pass another --out, or remove it"
        )
    written = []
    for relative, text in files.items():
        path = out / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        if path.suffix in (".sh", ".sbatch"):
            path.chmod(0o755)
        written.append(path)
    return written


def next_steps(job: Job, target: str, out: Path) -> list[str]:
    """What to do with the files, in order: broker first (sites wait for it at start)."""
    if target == "slurm":
        steps = [
            f"Start the broker on a stable host: {out}/broker/README.md",
            "Copy the job file and each site's certificates to every cluster (same paths).",
            f"On each site's cluster: sbatch {out}/SITE.sbatch",
        ]
    else:
        steps = [
            f"In the broker's cluster: bash {out}/secrets.sh broker "
            f"&& kubectl apply -f {out}/broker/",
            f"In each site's cluster: bash {out}/secrets.sh SITE && kubectl apply -f {out}/SITE/",
            "Make control.broker and each site's advertise the LoadBalancer addresses "
            "(kubectl get svc), then render again if they changed.",
        ]
    if job.control is None:
        steps.append(
            "The job file has no control: section: add one naming this broker "
            "(docs/deploy.md); sites on real clusters share status and membership there."
        )
    return steps
