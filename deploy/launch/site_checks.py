"""What ``isthmus site`` checks before any process starts: the site's name, its
network (broker, addresses), its ports (``--print-ports``, and that each rank can
listen), and its GPUs. Each refusal names the job-file field or flag and the fix."""

from __future__ import annotations

import difflib
import errno
import socket
from typing import Any

from isthmus.deploy.usage import UsageError
from isthmus.job.addressing import resolve
from isthmus.job.basics import FieldError
from isthmus.job.file import Job, SiteSpec
from isthmus.job.ports import RDZV_PORT


def site_of(job: Job, name: str) -> tuple[int, SiteSpec]:
    names = [s.name for s in job.sites]
    if name not in names:
        close = difflib.get_close_matches(name, names, n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise UsageError(
            f"--site: the job {job.name!r} has no site {name!r}; {hint}its sites: "
            + ", ".join(names)
        )
    return names.index(name), job.sites[names.index(name)]


def check_real_network(job: Job, spec: SiteSpec) -> None:
    """A site on a real network needs a broker and everyone's addresses."""
    if job.control is None:
        raise UsageError(
            "control.broker: the sites of a job meet at its MQTT broker (membership, "
            "settings, telemetry); name it in the job file, e.g. "
            "control: {broker: mqtts://broker.example.com:8883}"
        )
    resolve(job, spec.name)  # AddressError names the missing address


def describe_ports(job: Job, spec: SiteSpec) -> str:
    """What a firewall must let through for this site, inbound and outbound."""
    listen = spec.listen_addresses() or []
    dialled = spec.dial_addresses() or []
    lines = [f"site {spec.name!r} of job {job.name!r}:", "inbound, from the other sites (TCP):"]
    if not listen:
        lines.append("  (no address in the job file: give this site address: HOST:PORT)")
    for rank, (bound, dial) in enumerate(zip(listen, dialled or listen, strict=True)):
        seen = f" (dialled at {dial[0]}:{dial[1]})" if dial != bound else ""
        node = rank // spec.ranks_per_node
        lines.append(f"  rank {rank} (node {node}): listens on {bound[0]}:{bound[1]}{seen}")
    lines.append("outbound, to the other sites (TCP):")
    for other in job.sites:
        if other.name == spec.name:
            continue
        targets = other.dial_addresses()
        where = ", ".join("{}:{}".format(*a) for a in targets) if targets else "(no address)"
        lines.append(f"  {other.name}: {where}")
    if job.control is not None:
        broker = job.control.broker
        lines.append(f"outbound, to the broker (TCP): {broker.host}:{broker.port}")
    if job.metrics is not None:
        first = job.metrics.prometheus_port
        last = first + spec.ranks_per_node - 1
        ports = f"{first}" if last == first else f"{first}-{last}"
        lines.append(
            f"inbound, from your Prometheus (TCP): /metrics on port {ports} of every node "
            "(rank r of a node: prometheus_port + r)"
        )
    if spec.nodes > 1:
        lines.append(
            f"inside the site only: torchrun's rendezvous (TCP {RDZV_PORT} on the first node) "
            "and the collective backend's ports (NCCL/Gloo) between its nodes"
        )
    return "\n".join(lines)


def check_can_listen(spec: SiteSpec, index: int, ranks: range | list[int]) -> None:
    """Bind each rank's address now, to refuse one that cannot be used before any
    process starts (the peer service binds it again when it starts)."""
    listen = spec.listen_addresses() or []
    for rank in ranks:
        host, port = listen[rank]
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind((host, port))
            except OSError as exc:
                raise UsageError(_bind_problem(index, rank, host, port, exc)) from None


def _bind_problem(index: int, rank: int, host: str, port: int, exc: OSError) -> str:
    where = f"sites[{index}].address: rank {rank} cannot listen on {host}:{port}"
    if exc.errno == errno.EADDRINUSE:
        return f"{where}: the port is in use; stop what holds it, or choose another port"
    if exc.errno == errno.EADDRNOTAVAIL:
        return (
            f"{where}: {host} is not an address of this machine; listen on one of its "
            "addresses (0.0.0.0 for all) and put the address others dial in advertise:"
        )
    if exc.errno == errno.EACCES:
        return f"{where}: permission denied (ports below 1024 need root); choose a port >= 1024"
    return f"{where}: {exc.strerror}"


def check_gpus(job: Any, spec: SiteSpec, index: int, local_ranks: int) -> None:
    """On GPU machines each local rank takes one GPU (``train.device``); more ranks
    than GPUs, or ``device: cuda`` on a machine without one, is refused with the fix."""
    from isthmus.intra.devices import check_site_fits

    try:
        check_site_fits(spec.name, local_ranks, job.train.device)
    except FieldError as exc:
        where = f"sites[{index}]: ranks {spec.ranks}, nodes {spec.nodes}"
        raise UsageError(f"train.{exc} ({where})") from None
