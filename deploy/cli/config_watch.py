"""``isthmus config set`` and ``isthmus watch``: the control plane from any terminal."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import TYPE_CHECKING, Any

from isthmus.deploy.usage import UsageError, add_command
from isthmus.inter.control_topics import LIVE_SETTINGS, parse_config
from isthmus.job.broker import Broker

if TYPE_CHECKING:
    from isthmus.inter.control_plane import ControlPlane
from isthmus.job.file import Job, load_job, load_yaml

CONNECT_S = 5.0
SILENT_S = 3.0
"""A site whose status is older than this is shown as silent."""
SETTLE_S = 1.0
"""How long to listen for retained messages (statuses, the current config)."""


BROKER_HELP = (
    "the broker, mqtt[s]://host:port (default: the job file's control.broker, else the "
    "broker of the `isthmus run` of this job running here, from ./JOB.control.json)"
)


def broker_for(job: Job, url: str | None) -> Broker:
    """``--broker``, else the job file's ``control.broker``, else the embedded broker
    of a running ``isthmus run`` (its state file in this directory)."""
    if url:
        try:
            return Broker.from_url(url)
        except ValueError as exc:
            raise UsageError(f"--broker: {exc}") from None
    if job.control is not None:
        return job.control.broker_for(None)
    from isthmus.deploy.launch.broker import control_state_path  # asyncio: not for --help

    state = control_state_path(job)
    try:
        return Broker.from_url(json.loads(state.read_text())["broker"])
    except (OSError, ValueError, KeyError):
        raise UsageError(
            f"no broker for job {job.name!r}: the job file has no control.broker and no "
            f"{state} is here (is 'isthmus run' running in this directory?); "
            "or pass --broker mqtt://host:port"
        ) from None


def register(commands: Any) -> None:
    config = add_command(commands, "config", _config, help="change a running job's live settings")
    actions = config.add_subparsers(dest="action", metavar="ACTION", parser_class=type(config))
    actions.required = True
    config_set = actions.add_parser(
        "set",
        help="publish new settings; every site applies them at the same outer round",
        description="publish new settings; every site applies them at the same outer round. "
        f"Live settings: {', '.join(LIVE_SETTINGS)}",
    )
    config_set.set_defaults(handler=_config, prog="isthmus config set")
    config_set.add_argument("job", metavar="JOB.yaml", help="the running job's file")
    config_set.add_argument(
        "settings",
        nargs="+",
        metavar="KEY=VALUE",
        help="live settings, e.g. sync_every=25 codec=int8",
    )
    config_set.add_argument("--broker", metavar="URL", help=BROKER_HELP)
    config_set.add_argument(
        "--from-round",
        type=int,
        metavar="N",
        help="the outer round from which sites apply them (default: 2 after the furthest site)",
    )
    watch = add_command(
        commands, "watch", _watch, help="a live table of a job's sites and metrics, from its broker"
    )
    watch.add_argument("job", metavar="JOB.yaml", help="the running job's file")
    watch.add_argument("--broker", metavar="URL", help=BROKER_HELP)
    watch.add_argument(
        "--once", type=float, metavar="SECONDS", help="listen this long, print once, exit"
    )


def _parse_settings(pairs: list[str]) -> dict[str, Any]:
    settings: dict[str, Any] = {}
    for pair in pairs:
        key, sep, text = pair.partition("=")
        if not sep or not key:
            raise UsageError(f"{pair!r}: write settings as key=value, e.g. sync_every=20")
        if key not in LIVE_SETTINGS:
            raise UsageError(f"{key}: not a live setting; use one of {', '.join(LIVE_SETTINGS)}")
        settings[key] = load_yaml(text)
    return settings


def _config(args: argparse.Namespace) -> int:
    job = load_job(args.job)
    settings = _parse_settings(args.settings)
    checked = parse_config({"settings": settings, "from_round": 0}, job.train)
    if isinstance(checked, str):
        raise UsageError(checked)
    if args.from_round is not None and args.from_round < 0:
        raise UsageError(f"--from-round: must be >= 0, got {args.from_round}")
    broker = broker_for(job, args.broker)
    with _observer(broker, job) as plane:
        online = {n: s for n, s in plane.peers.items() if s.get("state") == "online"}
        furthest = max((s.get("round", 0) for s in online.values()), default=0)
        from_round = args.from_round if args.from_round is not None else furthest + 2
        try:
            version = plane.publish_config(settings, from_round)
        except ConnectionError as exc:
            raise UsageError(str(exc)) from None
    changes = ", ".join(f"{k}={v}" for k, v in settings.items())
    where = ", ".join(f"{n} at round {s.get('round', 0)}" for n, s in sorted(online.items()))
    print(f"published config v{version}: {changes} from outer round {from_round}")
    print(f"sites online: {where or 'none yet (they apply it when they reach that round)'}")
    return 0


class _observer:
    """A site-less control-plane client that has heard the retained messages."""

    def __init__(self, broker: Broker, job: Job) -> None:
        from isthmus.inter.control_plane import ControlPlane  # MQTT: not for --help

        self.plane = ControlPlane(broker, job.name, None, settings=job.train)

    def __enter__(self) -> ControlPlane:
        try:
            self.plane.start(wait_s=CONNECT_S)
        except ConnectionError as exc:
            raise UsageError(str(exc)) from None
        time.sleep(SETTLE_S)
        return self.plane

    def __exit__(self, *exc: object) -> None:
        self.plane.close()


def _watch(args: argparse.Namespace) -> int:
    job = load_job(args.job)
    broker = broker_for(job, args.broker)
    with _observer(broker, job) as plane:
        if args.once is not None:
            time.sleep(max(0.0, args.once - SETTLE_S))
            _print_table(plane, job)
            return 0
        from rich.live import Live

        try:
            with Live(_table(plane, job), refresh_per_second=2) as live:
                while True:
                    time.sleep(0.5)
                    live.update(_table(plane, job))
        except KeyboardInterrupt:
            return 0


def _rows(plane: ControlPlane, job: Job) -> list[list[str]]:
    rows = []
    for site in [s.name for s in job.sites]:
        status = plane.peers.get(site, {})
        metrics = plane.metrics.get(site, {})
        loss = metrics.get("loss")
        state = status.get("state", "unknown")
        # A live site refreshes its status every second; a hung host sends no Last
        # Will until the broker's keepalive check, so say it has gone quiet. Measured
        # by this host's clock since the status arrived: the site's own clock may be
        # off by a minute (another data centre, an NTP step).
        quiet = time.monotonic() - plane.heard_at.get(site, time.monotonic())
        if state == "online" and quiet > SILENT_S:
            state = f"silent {quiet:.0f}s"
        phase = (status.get("membership") or {}).get("phase")
        if state == "online" and phase not in (None, "training"):
            state = f"online, {phase}"
        rows.append(
            [
                site,
                state,
                str(status.get("step", "-")),
                str(status.get("round", "-")),
                f"{loss:.3f}" if isinstance(loss, int | float) else "-",
                f"{metrics.get('tokens_per_s', 0):,.0f}" if metrics else "-",
                f"{metrics.get('wan_bytes_sent', 0) / 1e6:.1f} MB" if metrics else "-",
                f"{metrics.get('round_s', 0):.2f} s" if metrics else "-",
                f"{metrics.get('waiting_s', 0):.2f} s" if metrics else "-",
            ]
        )
    return rows


COLUMNS = ("site", "state", "step", "round", "loss", "tok/s", "WAN sent", "round", "waiting")


def _table(plane: ControlPlane, job: Job) -> Any:
    from rich.table import Table

    config = plane.config
    caption = (
        f"config v{config.version}: {config.settings} from round {config.from_round}"
        if config
        else "config: as the job file says"
    )
    if plane.view is not None:
        caption += f"; {_view_line(plane.view)}"
    table = Table(title=f"{job.name} via {plane.broker.url}", caption=caption)
    for column in COLUMNS:
        table.add_column(column)
    for row in _rows(plane, job):
        table.add_row(*row)
    return table


def _view_line(view: dict[str, Any]) -> str:
    return (
        f"view {view.get('epoch')}: members {view.get('members')} from round "
        f"{view.get('start_round')} ({view.get('reason', '')})"
    )


def _print_table(plane: ControlPlane, job: Job) -> None:
    print(" ".join(f"{c:>10}" for c in COLUMNS))
    for row in _rows(plane, job):
        print(" ".join(f"{c:>10}" for c in row))
    if plane.config is not None:
        c = plane.config
        print(f"config v{c.version}: {json.dumps(c.settings)} from round {c.from_round}")
    if plane.view is not None:
        print(_view_line(plane.view))
    sys.stdout.flush()
