"""Whether a job's traffic leaves this machine, and whether it is protected when it does.

A job whose sites are all dialled on this machine (loopback, the wildcard address,
or the job's own emulated hosts of ``isthmus wan up --hosts``) keeps its rounds
and its control plane off any network. Once a site is dialled anywhere else, its
gRPC peers and its MQTT broker carry the model's updates across networks that
other people share: anyone who can reach a port and knows the job's name could
take part in the rounds, and anyone on the path could read them. Such a job needs
mutual TLS between sites (``tls:``) and TLS to a broker it names
(``control.broker: mqtts://`` with ``control.tls``), unless the job file says
``insecure: true`` (a private network the operator trusts), which every start
then repeats as a warning.

Pure functions of the job model: ``isthmus check``, ``isthmus site`` and
``isthmus run`` refuse with :func:`unprotected`; the others (``certs``,
``render``, ``wan``) read such a job as it is, since ``isthmus certs`` is how it
gets its certificates.
"""

from __future__ import annotations

import ipaddress
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from isthmus.job.model import Job

EMULATED_HOSTS_SUBNET = "10.213.0.0/16"
"""Where ``isthmus wan up --hosts`` puts the job's emulated hosts (network
namespaces of this machine, reached only through its router)."""

CERTS_COMMAND = "isthmus certs JOB.yaml --out certs"
"""The one command that makes a job's certificates (it prints the ``tls:`` section)."""


def on_this_machine(host: str) -> bool:
    """Whether dialling ``host`` stays on this machine: loopback, the wildcard
    address (which connects to this host), or an emulated host. A name other
    than ``localhost`` is resolved where the site runs: taken as across a network."""
    if host.lower() == "localhost":
        return True
    try:
        ip = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return False
    return (
        ip.is_loopback
        or ip.is_unspecified
        or (ip.version == 4 and ip in ipaddress.ip_network(EMULATED_HOSTS_SUBNET))
    )


def exposed_sites(job: Job) -> list[tuple[str, str]]:
    """``(field, host)`` for each site dialled off this machine: the first such
    address of the site, under the field that gives it (``advertise`` or
    ``address``)."""
    out = []
    for index, site in enumerate(job.sites):
        field = "advertise" if site.advertise else "address"
        for host, _ in site.dial_addresses() or []:
            if not on_this_machine(host):
                out.append((f"sites[{index}].{field}", host))
                break
    return out


def _first_off_this_machine(job: Job) -> str | None:
    """What first takes the job off this machine (a site's dialled address, else
    the broker), in words; None when nothing does."""
    exposed = exposed_sites(job)
    if exposed:
        return f"{exposed[0][0]} is dialled at {exposed[0][1]}"
    if job.control is not None and not on_this_machine(job.control.broker.host):
        return f"the broker is at {job.control.broker.host}"
    return None


def unprotected(job: Job) -> list[tuple[str, str]]:
    """``(field, message)`` for each way the job would send plaintext across a
    network: none when it stays on this machine or says ``insecure: true``."""
    if job.insecure:
        return []
    where = _first_off_this_machine(job)
    if where is None:
        return []
    broker = job.control.broker if job.control is not None else None
    problems = []
    if job.tls is None:
        problems.append(
            (
                "tls",
                f"{where}, off this machine, and the sites' rounds would cross the network "
                f"in plaintext: run `{CERTS_COMMAND}` and add the tls: section it prints "
                "(or set insecure: true on a private network you trust)",
            )
        )
    if broker is not None and broker.tls_ca is None:
        problems.append(
            (
                "control.broker",
                f"{where}, and the control plane would reach {broker.url} in plaintext: use "
                f"mqtts:// with control.tls (`{CERTS_COMMAND} --broker {broker.host}` makes "
                "the broker's and the sites' certificates), or set insecure: true",
            )
        )
    return problems


def insecure_warning(job: Job) -> str | None:
    """What every start of a job with ``insecure: true`` says, when it would
    otherwise be refused; None when there is nothing to warn of."""
    if not job.insecure:
        return None
    plain = []
    if job.tls is None:
        plain.append("between sites")
    if job.control is not None and job.control.broker.tls_ca is None:
        plain.append(f"to the broker {job.control.broker.url}")
    if not plain or _first_off_this_machine(job) is None:
        return None
    return (
        f"job {job.name!r} runs without TLS {' and '.join(plain)} across a network "
        "(insecure: true): anyone who can reach its ports can read and join its rounds"
    )
