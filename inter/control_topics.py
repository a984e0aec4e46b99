"""The control plane's MQTT topics and messages: a public interface.

==========================================  ========  =====================================
topic                                       retained  payload (JSON object)
==========================================  ========  =====================================
``isthmus/<job>/sites/<site>/status``       yes       ``state`` ("online" / "offline"),
                                                      ``ranks``, ``step``, ``round``,
                                                      ``address``, ``protocol``, ``t``,
                                                      ``membership`` (the site's report:
                                                      ``phase``, ``epoch``, ``rounds``,
                                                      ``engine_round``, ``unreachable``,
                                                      ``conflict``), ``spec`` (on a real
                                                      network: ``ranks``, ``parallel``,
                                                      ``dial``, for sites that do not have
                                                      it in their job file); the Last Will
                                                      is the same with ``state: "offline"``
``isthmus/<job>/config``                    yes       ``settings`` (``train:`` keys),
                                                      ``from_round`` (the outer round from
                                                      which every site applies them),
                                                      ``version``, ``t``
``isthmus/<job>/membership``                yes       the membership view (see
                                                      :mod:`isthmus.inter.membership`):
                                                      ``epoch``, ``members``,
                                                      ``start_round``, ``engine_round``,
                                                      ``catch_up``, ``donor``,
                                                      ``reason``, ``leader``,
                                                      ``newcomers`` (member -> its ``spec``,
                                                      for members not in the job file)
``isthmus/<job>/metrics/<site>``            no        one per round: ``round``, ``step``,
                                                      ``loss``, ``tokens_per_s``,
                                                      ``wan_bytes_sent``, ``round_s``,
                                                      ``waiting_s``, ``blocked_s``,
                                                      ``compute_s``, ``round_steps``,
                                                      ``sync_every``, ``t``
==========================================  ========  =====================================

Parsing never raises: a malformed message is returned as an error string,
which receivers log once and otherwise ignore.
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

from isthmus.job.settings import SettingError, TrainSettings

PROTOCOL = 1
"""Version of these messages; a site ignores config of a newer protocol."""

LIVE_SETTINGS = ("sync_every", "codec", "outer_lr", "outer_momentum", "inner_lr")
"""The ``train:`` keys a running job can change (the others shape the run itself)."""


def status_topic(job: str, site: str) -> str:
    return f"isthmus/{job}/sites/{site}/status"


def config_topic(job: str) -> str:
    return f"isthmus/{job}/config"


def membership_topic(job: str) -> str:
    return f"isthmus/{job}/membership"


def metrics_topic(job: str, site: str) -> str:
    return f"isthmus/{job}/metrics/{site}"


def site_of(topic: str, job: str) -> tuple[str, str] | None:
    """(kind, site) for a status or metrics topic of ``job``: ("status", "a")."""
    parts = topic.split("/")
    if len(parts) == 5 and parts[:3] == ["isthmus", job, "sites"] and parts[4] == "status":
        return "status", parts[3]
    if len(parts) == 4 and parts[:3] == ["isthmus", job, "metrics"]:
        return "metrics", parts[3]
    return None


def encode(message: dict[str, Any]) -> bytes:
    """Compact JSON; a non-finite number (a loss this rank does not compute) is null."""
    clean = {
        k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in message.items()
    }
    return json.dumps(clean, separators=(",", ":")).encode()


def decode(payload: bytes | bytearray | str | Any) -> dict[str, Any] | str:
    """The JSON object in ``payload``, or why it is not one."""
    if isinstance(payload, bytes | bytearray):
        try:
            payload = payload.decode()
        except UnicodeDecodeError:
            return "not UTF-8"
    if not isinstance(payload, str):
        return f"unexpected payload type {type(payload).__name__}"
    try:
        value = json.loads(payload)
    except ValueError as exc:
        return f"not JSON ({exc.msg})"
    if not isinstance(value, dict):
        return f"not a JSON object ({type(value).__name__})"
    return value


@dataclasses.dataclass(frozen=True)
class ConfigChange:
    """Validated live settings and the outer round they take effect from."""

    settings: dict[str, Any]
    from_round: int
    version: int


def parse_config(message: dict[str, Any], current: TrainSettings) -> ConfigChange | str:
    """A config message checked against the job's settings, or the reason it is refused."""
    protocol = message.get("protocol", PROTOCOL)
    if protocol != PROTOCOL:
        return f"protocol {protocol!r}, this site speaks {PROTOCOL}"
    settings = message.get("settings")
    if not isinstance(settings, dict) or not settings:
        return "'settings' must be a non-empty object of train: keys"
    fixed = sorted(set(settings) - set(LIVE_SETTINGS))
    if fixed:
        return f"{fixed} cannot change while running; live settings: {', '.join(LIVE_SETTINGS)}"
    unset = sorted(key for key, value in settings.items() if value is None)
    if unset:
        # A job file's null means "the strategy's default", filled in before the run
        # starts; a running strategy needs a value.
        return f"{unset} need a value while running (null is a job file's default, not a setting)"
    from_round = message.get("from_round")
    if not (isinstance(from_round, int) and not isinstance(from_round, bool) and from_round >= 0):
        return f"'from_round' must be an integer >= 0, got {from_round!r}"
    version = message.get("version", 0)
    if not (isinstance(version, int) and not isinstance(version, bool)):
        return f"'version' must be an integer, got {version!r}"
    try:
        dataclasses.replace(current, **settings)
    except SettingError as exc:
        return f"train.{exc.field}: {exc.reason}"
    except TypeError as exc:
        return str(exc)
    return ConfigChange(dict(settings), from_round, version)


def parse_status(message: dict[str, Any]) -> dict[str, Any] | str:
    state = message.get("state")
    address = message.get("address")
    if address is not None and not isinstance(address, str):
        return f"'address' must be host:port, got {address!r}"
    if state not in ("online", "offline"):
        return f"'state' must be 'online' or 'offline', got {state!r}"
    for key in ("step", "round", "ranks"):
        value = message.get(key, 0)
        if not (isinstance(value, int) and not isinstance(value, bool)):
            return f"{key!r} must be an integer, got {value!r}"
    return message


def parse_metrics(message: dict[str, Any]) -> dict[str, Any] | str:
    for key in ("round", "step"):
        if not isinstance(message.get(key), int):
            return f"{key!r} must be an integer, got {message.get(key)!r}"
    for key in ("round_steps", "sync_every"):
        value = message.get(key)
        if value is not None and not (isinstance(value, int) and not isinstance(value, bool)):
            return f"{key!r} must be an integer or null, got {value!r}"
    for key in ("loss", "tokens_per_s", "round_s", "waiting_s", "blocked_s", "compute_s"):
        value = message.get(key)
        if value is not None and not (isinstance(value, int | float) and math.isfinite(value)):
            return f"{key!r} must be a finite number or null, got {value!r}"
    return message
