"""The job file's ``wan:`` section: default link, per-pair links with their
directions, and the fault schedule; every problem goes to the validator."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from isthmus.job.basics import is_number
from isthmus.job.fault_schedule import Fault, Slowdown, validate_fault, validate_slowdown
from isthmus.job.file.words import join_path, kind, suggest, unknown
from isthmus.job.link import (
    DIRECTION_FIELDS,
    LINK_FIELDS,
    DirectionParams,
    LinkConfigError,
    LinkParams,
    link_changes_to_direction,
)
from isthmus.job.model import WanSpec
from isthmus.job.presets import PRESETS

if TYPE_CHECKING:
    from isthmus.job.file.validate import Validator

WAN_KEYS = ("default", "between_regions", "links", "faults")
FAULT_KEYS = (
    "at_s",
    "at_round",
    "link",
    "action",
    "for_s",
    "for_rounds",
    "rounds_of",
    "mode",
    "period_s",
    "down_s",
    "rate",
    "changes",
)
SLOWDOWN_KEYS = ("slow", "factor", "at_s", "at_round", "for_s", "for_rounds")


def wan_section(check: Validator, raw: Any, names: list[str]) -> WanSpec | None:
    raw = check.mapping(raw, "wan", WAN_KEYS)
    if raw is None:
        return None
    default = link_params(check, raw.get("default") or {}, "wan.default", between=None)
    between_regions = None
    if raw.get("between_regions") is not None:
        between_regions = link_params(
            check, raw["between_regions"], "wan.between_regions", between=None
        )
    overrides: dict[frozenset[str], tuple[tuple[str, str], LinkParams]] = {}
    links = raw.get("links") or []
    if not isinstance(links, list):
        check.fail("wan.links", f"must be a list of links, got {kind(links)}")
        links = []
    for i, entry in enumerate(links):
        path = f"wan.links[{i}]"
        if not isinstance(entry, dict):
            check.fail(path, f"must be a mapping with 'between', got {kind(entry)}")
            continue
        pair = site_pair(check, entry.get("between"), f"{path}.between", names)
        params = link_params(check, entry, path, between=pair)
        if pair is None or params is None:
            continue
        key = frozenset(pair)
        if key in overrides:
            check.fail(f"{path}.between", f"link {pair[0]}<->{pair[1]} is listed twice; merge them")
            continue
        overrides[key] = (pair, params)
    faults, slowdowns = fault_schedule(check, raw.get("faults") or [], names)
    if default is None:
        return None
    return WanSpec(
        default=default,
        overrides=overrides,
        faults=tuple(faults),
        slowdowns=tuple(slowdowns),
        between_regions=between_regions,
    )


def site_pair(check: Validator, value: Any, path: str, names: list[str]) -> tuple[str, str] | None:
    if value is None:
        check.fail(
            path.rsplit(".", 1)[0],
            f"missing '{path.rsplit('.', 1)[1]}': name two sites, e.g. [us-east, eu-west]",
        )
        return None
    if not (isinstance(value, list) and len(value) == 2 and all(isinstance(v, str) for v in value)):
        check.fail(path, f"must name two sites, e.g. [us-east, eu-west], got {value!r}")
        return None
    a, b = value
    ok = True
    for site in (a, b):
        if site not in names:
            check.fail(
                path, f"unknown site {site!r}; {suggest(site, names)}sites: {', '.join(names)}"
            )
            ok = False
    if ok and a == b:
        check.fail(path, f"a link joins two different sites, got [{a}, {b}]")
        ok = False
    return (a, b) if ok else None


def link_params(
    check: Validator, raw: Any, path: str, *, between: tuple[str, str] | None
) -> LinkParams | None:
    if not isinstance(raw, dict):
        check.fail(path, f"must be a mapping of link settings, got {kind(raw)}")
        return None
    allowed = (*sorted(LINK_FIELDS), "preset")
    if between is not None:
        allowed = (*allowed, "between", "egress")
    settings = {k: v for k, v in raw.items() if k not in ("between", "egress")}
    for key in settings:
        if key not in allowed:
            check.fail(join_path(path, key), unknown(key, allowed))
            return None
    preset_name = settings.pop("preset", None)
    base: dict[str, Any] = {}
    if preset_name is not None:
        if not isinstance(preset_name, str) or preset_name not in PRESETS:
            check.fail(
                f"{path}.preset",
                f"unknown preset {preset_name!r}; {suggest(str(preset_name), list(PRESETS))}"
                f"presets: {', '.join(PRESETS)}",
            )
            return None
        base = dict(PRESETS[preset_name])
    base.update(settings)
    try:
        common = DirectionParams().replace(**link_changes_to_direction(base))
    except LinkConfigError as exc:
        check.fail(join_path(path, "rtt_ms" if exc.field == "delay_ms" else exc.field), exc.reason)
        return None
    directions = {"a": common, "b": common}
    egress = raw.get("egress")
    if egress is not None and between is not None:
        if not isinstance(egress, dict):
            check.fail(f"{path}.egress", "must map a site of the link to its outgoing settings")
            return None
        for site, changes in egress.items():
            epath = f"{path}.egress.{site}"
            if site not in between:
                check.fail(epath, f"not an end of this link; use {between[0]} or {between[1]}")
                return None
            if not isinstance(changes, dict):
                check.fail(epath, f"must be a mapping of link settings, got {kind(changes)}")
                return None
            bad = [k for k in changes if k not in DIRECTION_FIELDS | {"rtt_ms"}]
            if bad:
                check.fail(join_path(epath, bad[0]), unknown(bad[0], tuple(sorted(LINK_FIELDS))))
                return None
            one_way = dict(changes)
            if "rtt_ms" in one_way:
                check.fail(f"{epath}.rtt_ms", "one direction has no RTT; give delay_ms (one-way)")
                return None
            try:
                directions["a" if site == between[0] else "b"] = common.replace(**one_way)
            except LinkConfigError as exc:
                check.fail(join_path(epath, exc.field), exc.reason)
                return None
    return LinkParams(directions["a"], directions["b"])


def fault_schedule(
    check: Validator, raw: Any, names: list[str]
) -> tuple[list[Fault], list[Slowdown]]:
    """The link faults and the site slowdowns (entries with ``slow:``) of ``wan.faults``."""
    if not isinstance(raw, list):
        check.fail("wan.faults", f"must be a list of faults, got {kind(raw)}")
        return [], []
    out = []
    slowdowns = []
    for i, entry in enumerate(raw):
        path = f"wan.faults[{i}]"
        if isinstance(entry, dict) and "slow" in entry:
            slowdown = _slowdown(check, entry, path, names)
            if slowdown is not None:
                slowdowns.append(slowdown)
            continue
        entry = check.mapping(entry, path, FAULT_KEYS)
        if entry is None:
            continue
        missing = [k for k in ("link", "action") if k not in entry]
        if "at_s" not in entry and "at_round" not in entry:
            missing.insert(0, "at_s or at_round")
        if missing:
            check.fail(
                path,
                f"missing {', '.join(repr(m) for m in missing)}; "
                "e.g. {at_s: 30, link: [a, b], action: partition, for_s: 10} or "
                "{at_round: 4, link: [a, b], action: partition, for_rounds: 3}",
            )
            continue
        pair = site_pair(check, entry["link"], f"{path}.link", names)
        if pair is None:
            continue
        numbers = {}
        bad = False
        for key in ("at_s", "for_s", "period_s", "down_s", "rate"):
            value = entry.get(key)
            if key == "at_s" and value is None and "at_s" in entry:
                check.fail(f"{path}.at_s", "must be a number of seconds from the start")
                bad = True
            elif value is not None and not is_number(value, finite=False):
                check.fail(f"{path}.{key}", f"must be a number, got {value!r}")
                bad = True
            numbers[key] = value
        for key in ("at_round", "for_rounds"):
            value = entry.get(key)
            if key in entry and not (
                isinstance(value, int) and not isinstance(value, bool) and value >= 1
            ):
                hint = " (round 1 is the first round completed)" if value == 0 else ""
                check.fail(
                    f"{path}.{key}",
                    f"must be a whole number of rounds >= 1, got {value!r}{hint}",
                )
                bad = True
            numbers[key] = value
        rounds_of = entry.get("rounds_of")
        if rounds_of is not None and not isinstance(rounds_of, str):
            check.fail(f"{path}.rounds_of", f"must be a site's name, got {kind(rounds_of)}")
            bad = True
        changes = entry.get("changes") or {}
        if not isinstance(changes, dict):
            check.fail(
                f"{path}.changes", f"must be a mapping of link settings, got {kind(changes)}"
            )
            bad = True
        if bad:
            continue
        fault = Fault(
            at_s=numbers["at_s"],
            at_round=numbers["at_round"],
            link=pair,
            action=str(entry["action"]),
            for_s=numbers["for_s"],
            for_rounds=numbers["for_rounds"],
            rounds_of=rounds_of,
            mode=str(entry.get("mode", "blackhole")),
            period_s=numbers["period_s"],
            down_s=numbers["down_s"],
            rate=numbers["rate"],
            changes=dict(changes),
        )
        try:
            validate_fault(fault, names)
        except LinkConfigError as exc:
            field_path = (
                f"{path}.changes.{exc.field}"
                if fault.action == "brownout" and exc.field not in FAULT_KEYS
                else f"{path}.{exc.field}"
            )
            check.fail(field_path, exc.reason)
            continue
        out.append(fault)
    return out, slowdowns


def _slowdown(check: Validator, raw: dict, path: str, names: list[str]) -> Slowdown | None:
    """A ``{slow: SITE, factor: F, at_round|at_s: ..., for_rounds|for_s: ...}`` entry."""
    entry = check.mapping(raw, path, SLOWDOWN_KEYS)
    if entry is None:
        return None
    if "factor" not in entry:
        check.fail(path, "missing 'factor'; e.g. {slow: b, factor: 4, at_round: 3, for_rounds: 5}")
        return None
    numbers = {}
    for key in ("factor", "at_s", "for_s"):
        value = entry.get(key)
        if key in entry and not is_number(value, finite=True):
            check.fail(f"{path}.{key}", f"must be a number, got {value!r}")
            return None
        numbers[key] = value
    for key in ("at_round", "for_rounds"):
        value = entry.get(key)
        if key in entry and not (
            isinstance(value, int) and not isinstance(value, bool) and value >= 1
        ):
            check.fail(f"{path}.{key}", f"must be a whole number of rounds >= 1, got {value!r}")
            return None
        numbers[key] = value
    slowdown = Slowdown(slow=str(entry["slow"]), **numbers)
    try:
        validate_slowdown(slowdown, names)
    except LinkConfigError as exc:
        check.fail(f"{path}.{exc.field}", exc.reason)
        return None
    return slowdown
