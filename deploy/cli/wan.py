"""``isthmus wan ...``: run emulated links, change them while traffic flows, read counters."""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
from pathlib import Path
from typing import Any

from isthmus.deploy.usage import UsageError, add_command
from isthmus.inter.allocator import keep_freed_memory
from isthmus.job.addressing import AddressError, default_state_path, load_state
from isthmus.job.file import Job, load_job, load_yaml, parse_address
from isthmus.job.link import LinkConfigError, LinkParams, describe_link
from isthmus.job.presets import PRESETS
from isthmus.sim.emulator import BackgroundEmulator
from isthmus.sim.emulator_control import ControlClient, ControlError, format_stats
from isthmus.sim.topology import EmulatedSite, Topology
from isthmus.training.orphan import end_with_parent
from isthmus.training.records import write_json_atomic

STATE_HELP = "the emulator's state file (default: the job's `wan up`, else its `isthmus run`)"

# Flags of `wan proxy` and `wan demo` -> link settings (units in the names).
LINK_FLAGS: list[tuple[str, str, type, str]] = [
    ("--rtt-ms", "rtt_ms", float, "round-trip time added by the link (each way rtt/2)"),
    ("--jitter-ms", "jitter_ms", float, "standard deviation of the one-way delay"),
    ("--jitter-distribution", "jitter_distribution", str, "normal, uniform or pareto"),
    ("--bandwidth-mbit", "bandwidth_mbit", float, "rate cap in Mbit/s each way (default uncapped)"),
    ("--loss", "loss", float, "fraction of TCP segments lost (each stalls the stream one RTO)"),
    (
        "--loss-burst-segments",
        "loss_burst_segments",
        float,
        "mean loss burst length in segments (1 = independent; >1 = Gilbert-Elliott)",
    ),
    ("--queue-ms", "queue_ms", float, "bottleneck queue in milliseconds of the rate"),
    ("--corrupt", "corrupt", float, "fraction of bytes with one bit flipped"),
    ("--min-rto-ms", "min_rto_ms", float, "lower bound of the retransmission timeout"),
    ("--window-bytes", "window_bytes", int, "most bytes in flight per connection and direction"),
]
_FLAG_OF = {name: flag for flag, name, _, _ in LINK_FLAGS}


def register(commands: Any) -> None:
    wan = commands.add_parser(
        "wan",
        help="emulate WAN links on this machine",
        description="Emulate long-haul links between sites with user-space TCP proxies "
        "(no root, no netem).",
    )
    verbs = wan.add_subparsers(dest="verb", metavar="VERB", parser_class=type(wan))
    verbs.required = True

    proxy = add_command(verbs, "proxy", _proxy, help="run one emulated link in the foreground")
    proxy.add_argument("--listen", required=True, metavar="HOST:PORT", help="where clients connect")
    proxy.add_argument("--connect", required=True, metavar="HOST:PORT", help="the real destination")
    _add_link_flags(proxy)
    proxy.add_argument("--seed", type=int, default=0, help="seed of jitter, loss and corruption")

    up = add_command(
        verbs, "up", _up, help="run every link of a job's topology until SIGINT/SIGTERM"
    )
    up.add_argument("job", metavar="JOB.yaml", help="the job file whose wan: links to emulate")
    up.add_argument(
        "--state",
        metavar="FILE",
        help="where to write the addresses to dial (default: ./<job name>.wan.json)",
    )
    up.add_argument(
        "--hosts",
        action="store_true",
        help="packet level: every site a separate host (network namespace) behind "
        "an emulating router; needs root",
    )
    up.add_argument(
        "--tcp-rmem-max",
        type=int,
        metavar="BYTES",
        help="with --hosts: the hosts' largest TCP receive buffer (default 32 MiB); about "
        "2x a link's bandwidth-delay product keeps TCP from overrunning a shallow queue",
    )
    up.add_argument("--host", default="127.0.0.1", help="address the link listeners bind")
    up.add_argument(
        "--stats-every",
        type=float,
        default=10.0,
        metavar="SECONDS",
        help="print each busy link's throughput this often (0: never)",
    )

    setter = add_command(verbs, "set", _set, help="change a running link's settings")
    _add_link_target(setter)
    setter.add_argument(
        "changes",
        nargs="+",
        metavar="KEY=VALUE",
        help="link settings, e.g. rtt_ms=120 bandwidth_mbit=50 loss=0.01",
    )
    setter.add_argument(
        "--from", dest="source", metavar="SITE", help="change only the direction leaving SITE"
    )

    cut = add_command(verbs, "cut", _cut, help="partition a running link")
    _add_link_target(cut)
    cut.add_argument(
        "--mode",
        choices=("blackhole", "reset"),
        default="blackhole",
        help="blackhole: bytes stop, connections hang; reset: connections torn down",
    )

    heal = add_command(verbs, "heal", _heal, help="end a partition")
    _add_link_target(heal)

    exe = add_command(
        verbs,
        "exec",
        _exec,
        help="run a command inside a site's host (after 'wan up --hosts')",
        description="Run COMMAND in the network namespace of SITE, as if on that host: "
        "isthmus wan exec JOB.yaml SITE -- COMMAND [ARGS...]",
    )
    exe.add_argument("job", metavar="JOB.yaml", help="the job file of the running emulator")
    exe.add_argument("site", metavar="SITE", help="the site whose emulated host runs it")
    exe.add_argument(
        "command", nargs=argparse.REMAINDER, metavar="-- COMMAND", help="the command to run there"
    )

    stats = add_command(verbs, "stats", _stats, help="print the counters of every running link")
    stats.add_argument("job", metavar="JOB.yaml", help="the job file of the running emulator")
    stats.add_argument(
        "--state",
        metavar="FILE",
        help=STATE_HELP,
    )
    stats.add_argument("--json", action="store_true", help="print JSON")

    demo = add_command(
        verbs,
        "demo",
        _demo,
        help="measure RTT and throughput through one emulated link",
        description="Start one emulated link in this process and measure its round trip "
        "and throughput as a user's traffic would see them.",
    )
    demo.add_argument(
        "--preset", default="transatlantic", choices=sorted(PRESETS), help="the link to emulate"
    )
    _add_link_flags(demo, defaults_from_preset=True)
    demo.add_argument("--seconds", type=float, default=3.0, help="length of the throughput test")


def _add_link_flags(parser: argparse.ArgumentParser, defaults_from_preset: bool = False) -> None:
    group = parser.add_argument_group("link settings")
    if not defaults_from_preset:
        group.add_argument("--preset", choices=sorted(PRESETS), help="start from a named link")
    for flag, name, kind, text in LINK_FLAGS:
        group.add_argument(flag, dest=name, type=kind, default=None, help=text)


def _add_link_target(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("job", metavar="JOB.yaml", help="the job file of the running emulator")
    parser.add_argument("site_a", metavar="SITE", help="one end of the link")
    parser.add_argument("site_b", metavar="SITE", help="the other end")
    parser.add_argument(
        "--state",
        metavar="FILE",
        help=STATE_HELP,
    )


def _link_from_flags(args: argparse.Namespace) -> LinkParams:
    settings: dict[str, Any] = dict(PRESETS[args.preset]) if args.preset else {}
    for _, name, _, _ in LINK_FLAGS:
        value = getattr(args, name)
        if value is not None:
            settings[name] = value
    try:
        return LinkParams.symmetric(**settings)
    except LinkConfigError as exc:
        flag = _FLAG_OF.get(exc.field, "--rtt-ms" if exc.field == "delay_ms" else exc.field)
        raise UsageError(f"{flag}: {exc.reason}") from None


def _address(value: str, flag: str) -> tuple[str, int]:
    parsed = parse_address(value)
    if isinstance(parsed, str):
        raise UsageError(f"{flag}: {parsed}")
    return parsed


# -- wan proxy ------------------------------------------------------------------------
def _proxy(args: argparse.Namespace) -> int:
    listen = _address(args.listen, "--listen")
    connect = _address(args.connect, "--connect")
    params = _link_from_flags(args)
    topology = Topology.full_mesh(
        [EmulatedSite(name="client", listen=()), EmulatedSite(name="server", listen=(connect,))],
        default=params,
        seed=args.seed,
    )
    keep_freed_memory()  # the proxy's reads are buffers of 256 KiB: reuse them
    from isthmus.deploy.launch.wan_serve import serve_proxy

    return asyncio.run(serve_proxy(topology, listen, connect))


# -- wan up -----------------------------------------------------------------------------
def _up(args: argparse.Namespace) -> int:
    job = load_job(args.job)
    if job.wan is None:
        raise UsageError(
            f"{args.job} has no 'wan:' section, so there is nothing to emulate; add one, "
            "e.g. wan: {default: {preset: transatlantic}}"
        )
    state_path = Path(args.state) if args.state else default_state_path(job)
    _refuse_a_second_emulator(state_path)
    if args.stats_every < 0:
        raise UsageError(f"--stats-every: must be >= 0 seconds, got {args.stats_every}")
    end_with_parent()  # started by `isthmus run`: stop when it is gone
    if args.tcp_rmem_max is not None:
        from isthmus.deploy.launch.wan_hosts import check_tcp_rmem_max

        check_tcp_rmem_max(args.tcp_rmem_max, hosts=args.hosts)
    if args.hosts:
        from isthmus.deploy.launch.wan_hosts import serve_hosts

        return serve_hosts(job, state_path, write_json_atomic, tcp_rmem_max=args.tcp_rmem_max)
    keep_freed_memory()  # the proxy's reads are buffers of 256 KiB: reuse them
    from isthmus.deploy.launch.wan_serve import serve_topology

    return asyncio.run(serve_topology(job, state_path, args.host, args.stats_every))


def _exec(args: argparse.Namespace) -> int:
    from isthmus.deploy.launch.wan_hosts import exec_in_host

    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    job = load_job(args.job)
    try:
        return exec_in_host(job, args.site, command)
    except KeyError as exc:
        raise UsageError(str(exc.args[0])) from None


def _refuse_a_second_emulator(state_path: Path) -> None:
    """One emulator per state file: a live one is refused, a stale one replaced."""
    if not state_path.exists():
        return
    try:
        state = load_state(state_path)
        control = _address(str(state.get("control")), "--state")
        ControlClient(control, timeout_s=2).stats()
    except (UsageError, AddressError, ControlError):
        print(f"warning: replacing {state_path}, left by an emulator that is gone", file=sys.stderr)
        return
    raise UsageError(
        f"an emulator is already running for {state_path} (pid {state.get('pid')}); "
        "stop it, or pass another --state"
    )


# -- wan set / cut / heal / stats -------------------------------------------------------
def _client(args: argparse.Namespace) -> ControlClient:
    job = load_job(args.job)
    path = Path(args.state) if args.state else _find_state(job)
    if not path.exists():
        if args.state:
            looked = f"{path} (--state) does not exist"
        else:
            from isthmus.deploy.launch.broker import control_state_path

            looked = (
                f"looked for {path} ('isthmus wan up') and {control_state_path(job)} "
                "(a running 'isthmus run' of the job, started in this directory)"
            )
        raise UsageError(
            f"no running emulator for job {job.name!r}: {looked}; start one first, or "
            "pass --state RUN_DIR/wan.json"
        )
    state = load_state(path)
    return ControlClient(_address(str(state.get("control")), "--state"))


def _find_state(job: Job) -> Path:
    """The emulator of ``isthmus wan up`` (its default state file), else that of a
    running ``isthmus run`` of the job (found as ``watch`` finds its broker:
    ./JOB.control.json names the run directory, whose wan.json it is)."""
    from isthmus.deploy.launch.broker import control_state_path

    own = default_state_path(job)
    control = control_state_path(job)
    if own.exists() or not control.exists():
        return own
    try:
        run_dir = Path(json.loads(control.read_text())["run_dir"])
    except (OSError, ValueError, KeyError, TypeError):
        return own
    return run_dir / "wan.json" if (run_dir / "wan.json").exists() else own


def _control(call: Any) -> Any:
    try:
        return call()
    except ControlError as exc:
        raise UsageError(str(exc)) from None


def _set(args: argparse.Namespace) -> int:
    changes: dict[str, Any] = {}
    for item in args.changes:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise UsageError(f"expected KEY=VALUE, got {item!r} (e.g. rtt_ms=120)")
        changes[key] = load_yaml(value)
    client = _client(args)
    link = _control(lambda: client.set(args.site_a, args.site_b, source=args.source, **changes))
    print(f"link {args.site_a}<->{args.site_b}: {link['state']}, rtt {link['rtt_ms']:g} ms")
    return 0


def _cut(args: argparse.Namespace) -> int:
    client = _client(args)
    link = _control(lambda: client.cut(args.site_a, args.site_b, args.mode))
    print(f"link {args.site_a}<->{args.site_b}: {link['state']}")
    return 0


def _heal(args: argparse.Namespace) -> int:
    client = _client(args)
    link = _control(lambda: client.heal(args.site_a, args.site_b))
    print(f"link {args.site_a}<->{args.site_b}: {link['state']}")
    return 0


def _stats(args: argparse.Namespace) -> int:
    client = _client(args)
    stats = _control(client.stats)
    print(json.dumps(stats, indent=2) if args.json else format_stats(stats))
    return 0


# -- wan demo ---------------------------------------------------------------------------
def _demo(args: argparse.Namespace) -> int:
    from isthmus.sim.probe import ProbeServer, measure_rtt_ms, measure_throughput

    params = _link_from_flags(args)
    if args.seconds <= 0:
        raise UsageError(f"--seconds: must be > 0, got {args.seconds}")
    p = params.a_to_b
    print(f"emulating one link ({args.preset}): {describe_link(p, params.rtt_ms)}")
    with ProbeServer() as server:
        topology = Topology.full_mesh(
            [
                EmulatedSite(name="here", listen=()),
                EmulatedSite(name="there", listen=(server.address,)),
            ],
            default=params,
        )
        with BackgroundEmulator(topology) as wan:
            address = wan.dial_address("here", "there", 0)
            direct = statistics.median(measure_rtt_ms(server.address, count=20))
            rtts = measure_rtt_ms(address, count=20)
            print(
                f"round trip: median {statistics.median(rtts):.1f} ms "
                f"(configured {params.rtt_ms:g} ms; {direct:.2f} ms without the link)"
            )
            print(f"throughput: measuring for {args.seconds:g} s ...", flush=True)
            result = measure_throughput(address, seconds=args.seconds)
            cap = f"{p.bandwidth_mbit:g} Mbit/s" if p.bandwidth_mbit else "uncapped"
            print(
                f"throughput: {result.mbit_per_s:.1f} Mbit/s ({result.mbyte_per_s:.1f} MB/s; "
                f"cap {cap}; {result.bytes / 1e6:.0f} MB in {result.seconds:.2f} s)"
            )
            counters = wan.stats()["links"][0]["here->there"]
            print(
                f"link counters: {counters['bytes'] / 1e6:.0f} MB, {counters['segments']} "
                f"segments, {counters['stalls']} loss stalls"
            )
    return 0
