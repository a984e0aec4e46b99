"""Where each rank listens and which address it dials to reach every peer.

Two sources, one answer: under emulation, the state file that ``isthmus wan up``
writes (peers are dialled through the emulator's link listeners); on a real
network, the job file (peers dial each site's ``advertise`` address, default
its ``address``, plus the rank). Everything that connects sites reads this,
never the job file's addresses directly, so emulated and real runs share code.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from isthmus.job.model import Job

Address = tuple[str, int]


class AddressError(ValueError):
    """Addresses cannot be resolved; the message names the field or file and the fix."""


@dataclass(frozen=True)
class SiteAddresses:
    """What one site needs to take part: its ranks' listen addresses and its peers'."""

    listen: list[Address]
    """Index = local rank."""
    peers: dict[str, list[Address]]
    """Other site -> the address to dial for each of its ranks (index = its rank)."""


def default_state_path(job: Job) -> Path:
    """Where ``isthmus wan up`` writes the job's state file when not told: ./<job>.wan.json."""
    return Path(f"{job.name}.wan.json")


def load_state(path: str | Path) -> dict[str, Any]:
    """Read an emulator state file, checking the fields this module relies on."""
    path = Path(path)
    try:
        state = json.loads(path.read_text())
    except FileNotFoundError:
        raise AddressError(f"{path}: no such state file; start 'isthmus wan up' first") from None
    except ValueError:
        raise AddressError(f"{path}: not JSON; was it written by 'isthmus wan up'?") from None
    if not isinstance(state, dict) or not isinstance(state.get("sites"), dict):
        raise AddressError(f"{path}: missing 'sites'; was it written by 'isthmus wan up'?")
    return state


def resolve(job: Job, site: str, state: dict[str, Any] | None = None) -> SiteAddresses:
    """Addresses for ``site`` of ``job``: from the emulator's ``state`` when given."""
    me = job.site(site)
    if state is not None:
        if state.get("job") != job.name:
            raise AddressError(
                f"the emulator state is for job {state.get('job')!r}, not {job.name!r}; "
                "pass the state file of this job's 'isthmus wan up'"
            )
        entry = state["sites"].get(site)
        if not isinstance(entry, dict):
            raise AddressError(f"the emulator state has no site {site!r}; restart 'isthmus wan up'")
        listen = [_parse(a, f"sites.{site}.listen") for a in entry.get("listen", [])]
        peers = {
            other: [_parse(a, f"sites.{site}.dial.{other}") for a in addresses]
            for other, addresses in entry.get("dial", {}).items()
        }
        return SiteAddresses(listen, peers)
    listen = me.listen_addresses()
    if listen is None:
        raise AddressError(
            f"sites[{_index(job, site)}].address: site {site!r} needs an address to listen on "
            "when there is no emulator, e.g. address: 0.0.0.0:7100"
        )
    peers: dict[str, list[Address]] = {}
    for other in job.sites:
        if other.name == site:
            continue
        dial = other.dial_addresses()
        if dial is None:
            raise AddressError(
                f"sites[{_index(job, other.name)}].address: site {site!r} cannot reach "
                f"{other.name!r}: give {other.name!r} an address (and advertise, behind NAT)"
            )
        peers[other.name] = dial
    return SiteAddresses(listen, peers)


def _index(job: Job, name: str) -> int:
    return [s.name for s in job.sites].index(name)


def _parse(value: Any, where: str) -> Address:
    parsed = parse_address(value)
    if isinstance(parsed, str):
        raise AddressError(f"emulator state {where}: {parsed}")
    return parsed


def parse_address(value: Any) -> tuple[str, int] | str:
    """``host:port`` (IPv6 as ``[::1]:7100``) -> (host, port), or a message saying the fix."""
    if not isinstance(value, str):
        return f"must be 'host:port', e.g. 127.0.0.1:7100, got {value!r}"
    match = re.fullmatch(r"\[([0-9A-Fa-f:.]+)\]:(\d+)|([^:\s\[\]]+):(\d+)", value.strip())
    if not match:
        return f"must be 'host:port' (IPv6 as [::1]:7100), got {value!r}"
    host = match.group(1) or match.group(3)
    port = int(match.group(2) or match.group(4))
    if not 1 <= port <= 65535:
        return f"port must be in 1..65535, got {port}"
    return host, port
