"""``isthmus bench ...``: benchmarks that print the figures the issues' targets name."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from isthmus.deploy.usage import UsageError, add_command


def register(commands: Any) -> None:
    bench = commands.add_parser("bench", help="measure Isthmus on this machine")
    kinds = bench.add_subparsers(dest="kind", metavar="BENCHMARK", parser_class=type(bench))
    kinds.required = True
    wan = add_command(
        kinds,
        "wan",
        _wan,
        help="throughput, added RTT, jitter and memory of the emulated links",
        description="Runs 'isthmus wan proxy' as a separate process and measures what "
        "traffic through it sees, against the targets of the emulator.",
    )
    allreduce = add_command(
        kinds,
        "allreduce",
        _allreduce,
        help="the cross-site all-reduce between site processes over emulated links",
        description="Runs SITES site processes linked through 'isthmus wan up' and reports "
        "the round time against the alpha-beta bound, bytes moved and error.",
    )
    allreduce.add_argument(
        "--job",
        metavar="JOB.yaml",
        help="run over this job file's sites (one process each), regions and links "
        "instead of --sites identical ones",
    )
    allreduce.add_argument("--sites", type=int, help="2-8 (default 3), without --job")
    allreduce.add_argument(
        "--size-mib",
        type=float,
        default=64.0,
        help="MiB of float32 each site averages (default 64)",
    )
    allreduce.add_argument("--rtt-ms", type=float, help="every link's RTT (default 50)")
    allreduce.add_argument("--bandwidth-mbit", type=float, help="every link's rate (default 200)")
    allreduce.add_argument("--codec", default="none", help="e.g. none, bf16, int8, int4+zstd")
    allreduce.add_argument(
        "--algorithm",
        choices=("direct", "gather", "ring", "two_level", "auto"),
        default="direct",
        help="direct (full mesh, every site owns a slice), gather (every site sends "
        "everything to every site: one trip), ring (successor only), "
        "two_level (inside regions, across them, inside again; needs --job with "
        "regions), or auto (whichever the alpha-beta model predicts fastest on these "
        "links and regions)",
    )
    allreduce.add_argument(
        "--queue-ms",
        type=float,
        default=None,
        help="each link's bottleneck queue in milliseconds of its rate (default: the "
        "emulator's 25 ms); a queue of one RTT holds a bandwidth-delay product",
    )
    allreduce.add_argument(
        "--tcp-rmem-max",
        type=int,
        metavar="BYTES",
        help="with --hosts: the hosts' largest TCP receive buffer (default 32 MiB); about "
        "2x the links' bandwidth-delay product keeps TCP from overrunning their queues",
    )
    allreduce.add_argument(
        "--connections",
        default="auto",
        metavar="N|auto",
        help="TCP connections from each site to each other; a call's chunks are dealt over "
        "them. auto (default): enough that each carries at most its TCP window per round "
        "trip (the emulator's 16 MiB; with --hosts the hosts' largest receive buffer)",
    )
    allreduce.add_argument(
        "--repeats", type=int, default=3, help="all-reduces timed per size (the median is reported)"
    )
    allreduce.add_argument(
        "--idle-s",
        type=float,
        default=0.0,
        help="seconds every site pauses between rounds, as compute would: how the "
        "links behave after going quiet (default 0: back to back)",
    )
    allreduce.add_argument(
        "--hosts",
        action="store_true",
        help="every site in its own emulated host (packet level, real TCP); needs root",
    )
    allreduce.add_argument(
        "--vs-gloo",
        action="store_true",
        help="also time Gloo's all-reduce over the same hosts (implies --hosts)",
    )
    allreduce.add_argument("--json", action="store_true", help="print the results as JSON")
    codec = add_command(
        kinds,
        "codec",
        _codec,
        help="speed (one core), compression ratio and error of every codec",
        description="Encode and decode speed per core, and ratio and error on a real "
        "pseudo-gradient, for every codec.",
    )
    codec.add_argument("--size-mib", type=float, default=64.0, help="tensor size for speed")
    codec.add_argument("--json", action="store_true", help="print the results as JSON")
    wan.add_argument("--json", action="store_true", help="print the results as JSON")
    wan.add_argument("--repeats", type=int, default=3, help="runs per throughput point (median)")
    wan.add_argument("--seconds", type=float, default=2.0, help="length of each throughput run")
    wan.add_argument("--plot", metavar="FILE.png", help="also draw the results into a PNG")
    wan.add_argument(
        "--hosts",
        action="store_true",
        help="benchmark the packet-level backend (separate hosts, real TCP, "
        "Gloo baseline); needs root",
    )


def _bench_job(args: argparse.Namespace) -> Any:
    """The job file of ``--job``, refused with the flags it replaces or a problem."""
    from isthmus.job.file import JobFileError, load_job

    flags = {
        "--sites": args.sites,
        "--rtt-ms": args.rtt_ms,
        "--bandwidth-mbit": args.bandwidth_mbit,
    }
    given = [flag for flag, value in flags.items() if value is not None]
    if given:
        raise UsageError(
            f"{', '.join(given)}: the job file gives the sites and links; drop "
            f"{'them' if len(given) > 1 else 'it'} or --job"
        )
    if args.queue_ms is not None:
        raise UsageError("--queue-ms: set queue_ms on the job file's links instead")
    try:
        job = load_job(args.job)
    except JobFileError as exc:
        raise UsageError(str(exc)) from None
    except OSError as exc:
        raise UsageError(f"--job: cannot read {args.job}: {exc.strerror}") from None
    if len(job.sites) < 2:
        raise UsageError(f"--job: {args.job} has {len(job.sites)} site; an all-reduce needs 2")
    if args.algorithm == "two_level" and not job.regions:
        raise UsageError(
            f"--algorithm two_level: {args.job} has no regions: section; add one, or use "
            "direct, gather, ring or auto"
        )
    return job


def _allreduce(args: argparse.Namespace) -> int:
    from isthmus.deploy.bench.allreduce import (
        SitesFailed,
        format_allreduce_report,
        run_allreduce_bench,
    )
    from isthmus.inter.codecs import CodecError, parse_codec

    job = None
    if args.job is not None:
        job = _bench_job(args)
    else:
        args.sites = 3 if args.sites is None else args.sites
        args.rtt_ms = 50.0 if args.rtt_ms is None else args.rtt_ms
        args.bandwidth_mbit = 200.0 if args.bandwidth_mbit is None else args.bandwidth_mbit
        if not 2 <= args.sites <= 8:
            raise UsageError(f"--sites: must be in 2..8, got {args.sites}")
        if args.rtt_ms < 0:
            raise UsageError(f"--rtt-ms: must be >= 0, got {args.rtt_ms}")
        if args.bandwidth_mbit <= 0:
            raise UsageError(f"--bandwidth-mbit: must be > 0, got {args.bandwidth_mbit}")
        if args.algorithm == "two_level":
            raise UsageError(
                "--algorithm two_level: needs regions; give --job with a regions: section"
            )
    for flag, value in (("--size-mib", args.size_mib),):
        if value <= 0:
            raise UsageError(f"{flag}: must be > 0, got {value}")
    if args.repeats < 1:
        raise UsageError(f"--repeats: must be >= 1, got {args.repeats}")
    if args.queue_ms is not None and args.queue_ms < 0:
        raise UsageError(f"--queue-ms: must be >= 0, got {args.queue_ms}")
    if not 0 <= args.idle_s <= 3600:
        raise UsageError(f"--idle-s: must be in [0, 3600] seconds, got {args.idle_s}")
    connections = _connections_flag(args.connections)
    try:
        parse_codec(args.codec)
    except CodecError as exc:
        raise UsageError(f"--codec: {exc}") from None
    hosts = args.hosts or args.vs_gloo
    if args.tcp_rmem_max is not None:
        from isthmus.deploy.launch.wan_hosts import check_tcp_rmem_max

        check_tcp_rmem_max(args.tcp_rmem_max, hosts=hosts)
    if hosts:
        from isthmus.sim.hosts import HostsUnavailable, check_support

        try:
            check_support()
        except HostsUnavailable as exc:
            raise UsageError(f"--hosts: {exc}") from None
    try:
        results = run_allreduce_bench(
            sites=args.sites,
            size_mib=args.size_mib,
            rtt_ms=args.rtt_ms,
            bandwidth_mbit=args.bandwidth_mbit,
            codec=args.codec,
            repeats=args.repeats,
            algorithm=args.algorithm,
            hosts=hosts,
            vs_gloo=args.vs_gloo,
            idle_s=args.idle_s,
            queue_ms=args.queue_ms,
            tcp_rmem_max=args.tcp_rmem_max,
            verbose=not args.json,
            job=job,
            connections=connections,
        )
    except SitesFailed as exc:
        print(f"{args.prog}: a round failed: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(results, indent=2) if args.json else format_allreduce_report(results))
    return 0


def _connections_flag(value: str) -> int | None:
    """``--connections``: a count, or None for auto."""
    from isthmus.job.setting_groups import MAX_CONNECTIONS_PER_PEER

    if value == "auto":
        return None
    try:
        count = int(value)
    except ValueError:
        count = 0
    if not 1 <= count <= MAX_CONNECTIONS_PER_PEER:
        raise UsageError(
            f"--connections: must be auto or a count in 1..{MAX_CONNECTIONS_PER_PEER}, "
            f"got {value!r}"
        )
    return count


def _codec(args: argparse.Namespace) -> int:
    from isthmus.deploy.bench.codec import format_codec_report, run_codec_bench

    if args.size_mib <= 0:
        raise UsageError(f"--size-mib: must be > 0, got {args.size_mib}")
    results = run_codec_bench(size_mib=args.size_mib)
    print(json.dumps(results, indent=2) if args.json else format_codec_report(results))
    return 0 if results["ok"] else 1


def _wan(args: argparse.Namespace) -> int:
    from isthmus.deploy.bench.emulator_bench import format_report, plot_report, run_wan_bench

    if args.repeats < 1:
        raise UsageError(f"--repeats: must be >= 1, got {args.repeats}")
    if args.seconds <= 0:
        raise UsageError(f"--seconds: must be > 0, got {args.seconds}")
    if args.hosts:
        return _wan_hosts(args)
    results, samples = run_wan_bench(
        repeats=args.repeats, seconds=args.seconds, verbose=not args.json
    )
    print(json.dumps(results, indent=2) if args.json else format_report(results))
    if args.plot:
        plot_report(results, samples, args.plot)
        print(f"plot: {args.plot}", file=sys.stderr)
    return 0 if results["ok"] else 1


def _wan_hosts(args: argparse.Namespace) -> int:
    from isthmus.deploy.bench.hosts import format_hosts_report, run_hosts_bench
    from isthmus.sim.hosts import HostsUnavailable, check_support

    try:
        check_support()
    except HostsUnavailable as exc:
        raise UsageError(str(exc)) from None
    seconds = max(args.seconds, 6.0)  # long enough for TCP to ramp up on a 50 ms path
    results = run_hosts_bench(seconds=seconds, verbose=not args.json)
    print(json.dumps(results, indent=2) if args.json else format_hosts_report(results))
    return 0 if results["ok"] else 1
