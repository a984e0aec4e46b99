"""The job file's ``regions:`` section: groups of sites that share long-haul capacity.

::

    regions:
      - {name: us, sites: [oregon, virginia, ohio], egress_mbit: 300}
      - {name: eu, sites: [frankfurt, dublin, paris], egress_mbit: 300}

Once any site is in a region every site must be, each in one. ``egress_mbit``
(optional) is what the emulator shares among all traffic leaving the region for
the others, and separately among all traffic entering it; links inside a region
take ``wan.default``, links across regions ``wan.between_regions``.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

from isthmus.job.basics import is_number
from isthmus.job.file.words import bad_name, kind, suggest
from isthmus.job.model import RegionSpec

if TYPE_CHECKING:
    from isthmus.job.file.validate import Validator

REGION_KEYS = ("name", "sites", "egress_mbit")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")


def regions_section(check: Validator, raw: Any, names: list[str]) -> tuple[RegionSpec, ...]:
    """The regions, every problem reported to ``check`` by its field."""
    if not isinstance(raw, list) or not raw:
        check.fail(
            "regions",
            f"must be a list of regions, e.g. [{{name: us, sites: [a, b]}}], got {kind(raw)}",
        )
        return ()
    regions: list[RegionSpec] = []
    home: dict[str, tuple[str, str]] = {}  # site -> (region, its path)
    seen: dict[str, str] = {}  # region name -> its path
    for i, entry in enumerate(raw):
        path = f"regions[{i}]"
        entry = check.mapping(entry, path, REGION_KEYS)
        if entry is None:
            continue
        name = entry.get("name")
        if name is None:
            check.fail(path, "missing 'name': give the region a name, e.g. name: us")
            continue
        if not (isinstance(name, str) and _NAME.match(name)):
            check.fail(f"{path}.name", bad_name(name))
            continue
        if name in seen:
            check.fail(f"{path}.name", f"region {name!r} is already {seen[name]}; merge the two")
            continue
        seen[name] = path
        sites = _sites(check, entry.get("sites"), f"{path}.sites", names)
        for site in sites:
            if site in home:
                other, other_path = home[site]
                check.fail(
                    f"{path}.sites",
                    f"site {site!r} is already in region {other!r} ({other_path}); a site "
                    "belongs to one region: remove it from one of them",
                )
            else:
                home[site] = (name, path)
        egress = entry.get("egress_mbit")
        if egress is not None and not (is_number(egress, finite=False) and egress > 0):
            check.fail(
                f"{path}.egress_mbit",
                "must be a positive number of Mbit/s (the region's long-haul capacity, "
                f"each way, shared by its sites), got {egress!r}; leave it out for no cap",
            )
            egress = None
        regions.append(RegionSpec(name=name, sites=tuple(sites), egress_mbit=egress))
    homeless = [n for n in names if n not in home]
    if home and homeless:
        check.fail(
            "regions",
            f"site{'s' if len(homeless) > 1 else ''} {', '.join(homeless)} in no region: once "
            "any site is in a region, every site must be; add "
            f"{'them' if len(homeless) > 1 else 'it'} to one (a region may hold one site)",
        )
    return tuple(regions)


def _sites(check: Validator, value: Any, path: str, names: list[str]) -> list[str]:
    if value is None:
        check.fail(path.rsplit(".", 1)[0], "missing 'sites': list the region's sites")
        return []
    if not (isinstance(value, list) and value and all(isinstance(v, str) for v in value)):
        check.fail(path, f"must be a list of the job's site names, got {kind(value)}")
        return []
    out = []
    for site in value:
        if site not in names:
            check.fail(
                path, f"unknown site {site!r}; {suggest(site, names)}sites: {', '.join(names)}"
            )
        elif site in out:
            check.fail(path, f"site {site!r} is listed twice")
        else:
            out.append(site)
    return out
