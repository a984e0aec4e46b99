"""The WAN emulator benchmark behind ``isthmus bench wan``.

Each point starts ``isthmus wan proxy`` as its own process (as a user would),
drives traffic through it from this process with :mod:`isthmus.sim.probe`, and
stops it. Targets (from the emulator's issue):

* throughput at caps from 10 Mbit/s to 1 Gbit/s within +-5 % of the cap;
  uncapped, >= 300 MB/s through the proxy on loopback;
* added RTT within +-(1 ms + 2 %) of the configured RTT;
* the standard deviation of the one-way delay within 10 % of the configured jitter;
* memory of a link under a full-speed sender about bandwidth x delay plus a fixed buffer.
"""

from __future__ import annotations

import math
import os
import signal
import statistics
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from isthmus.job.link import DirectionParams
from isthmus.job.ports import free_port
from isthmus.sim.jitter import JitterSampler
from isthmus.sim.probe import (
    ProbeServer,
    measure_one_way_ms,
    measure_rtt_ms,
    measure_throughput,
)
from isthmus.sim.topology import direction_rng

CAPS_MBIT = (10, 100, 500, 1000)
RTTS_MS = (10, 50, 150)
JITTERS = (("normal", 5.0), ("uniform", 5.0), ("pareto", 2.0))
PARETO_SHAPE = 3.0
# Messages 20 ms apart, so jitter never has to be clamped to keep the stream in
# order. With 1000 the sampling error of a normal or uniform standard deviation
# is ~2%.
JITTER_SAMPLES = 1000


@contextmanager
def wan_up(
    job: str | os.PathLike[str], state: str | os.PathLike[str], *flags: str
) -> Iterator[None]:
    """Run ``isthmus wan up JOB --state STATE FLAGS`` until the block ends: it has
    written the state file when the block starts, and is stopped with SIGTERM."""
    wan = subprocess.Popen(
        [sys.executable, "-m", "isthmus", "wan", "up", str(job), "--state", str(state), *flags],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert wan.stdout is not None
        while line := wan.stdout.readline():
            if line.startswith("ready"):
                break
        else:
            raise RuntimeError(f"'wan up' did not start: {wan.stderr.read() if wan.stderr else ''}")
        yield
    finally:
        if wan.poll() is None:
            wan.send_signal(signal.SIGTERM)
        wan.communicate(timeout=30)


@contextmanager
def proxy_process(upstream: tuple[str, int], *flags: str) -> Iterator[tuple[tuple[str, int], int]]:
    """Run ``isthmus wan proxy`` until the block ends; yield (listen address, pid)."""
    host = "127.0.0.1"
    port = free_port(host)
    cmd = [
        sys.executable,
        "-m",
        "isthmus",
        "wan",
        "proxy",
        "--listen",
        f"{host}:{port}",
        "--connect",
        f"{upstream[0]}:{upstream[1]}",
        *flags,
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        if not line.startswith("ready"):
            proc.kill()
            raise RuntimeError(
                f"wan proxy did not start: {line}{proc.stderr.read() if proc.stderr else ''}"
            )
        yield (host, port), proc.pid
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()


def _rss_kib(pid: int, field: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not found for pid {pid}")


def _progress(verbose: bool, text: str) -> None:
    if verbose:
        print(f"bench wan: {text}", file=sys.stderr, flush=True)


def run_wan_bench(
    *, repeats: int = 3, seconds: float = 2.0, verbose: bool = True
) -> tuple[dict[str, Any], dict[str, list[float]]]:
    """Measure every point; return the results and the raw delay samples (for plots)."""
    results: dict[str, Any] = {"machine": {"cpus": os.cpu_count()}}
    samples: dict[str, list[float]] = {}
    with ProbeServer() as server:
        up = server.address

        throughput = []
        for cap in CAPS_MBIT:
            _progress(verbose, f"throughput at {cap} Mbit/s ({repeats} x {seconds:g} s)")
            runs = []
            for _ in range(repeats):
                with proxy_process(up, "--bandwidth-mbit", str(cap), "--rtt-ms", "10") as (addr, _):
                    runs.append(measure_throughput(addr, seconds=seconds).mbit_per_s)
            median = statistics.median(runs)
            error = (median - cap) / cap
            throughput.append(
                {
                    "cap_mbit": cap,
                    "median_mbit": round(median, 2),
                    "runs_mbit": [round(r, 2) for r in runs],
                    "error": round(error, 4),
                    "target": "within 5%",
                    "ok": abs(error) <= 0.05,
                }
            )
        results["throughput"] = throughput

        _progress(verbose, f"uncapped throughput ({repeats} x {seconds:g} s)")
        runs = []
        for _ in range(repeats):
            with proxy_process(up) as (addr, _):
                runs.append(measure_throughput(addr, seconds=seconds).mbyte_per_s)
        direct = measure_throughput(up, seconds=seconds).mbyte_per_s
        results["uncapped"] = {
            "median_mbyte_per_s": round(statistics.median(runs), 1),
            "runs_mbyte_per_s": [round(r, 1) for r in runs],
            "direct_mbyte_per_s": round(direct, 1),
            "target": ">= 300 MB/s",
            "ok": statistics.median(runs) >= 300,
        }

        _progress(verbose, "round-trip time")
        base = statistics.median(measure_rtt_ms(up, count=50))
        rtt_rows = []
        for rtt in RTTS_MS:
            with proxy_process(up, "--rtt-ms", str(rtt)) as (addr, _):
                rtt_samples = measure_rtt_ms(addr, count=40, interval_s=0.005)
            added = statistics.median(rtt_samples) - base
            samples[f"added_rtt_ms/{rtt}"] = [x - base for x in rtt_samples]
            tolerance = 1.0 + 0.02 * rtt
            rtt_rows.append(
                {
                    "configured_ms": rtt,
                    "median_added_ms": round(added, 3),
                    "error_ms": round(added - rtt, 3),
                    "tolerance_ms": round(tolerance, 3),
                    "ok": abs(added - rtt) <= tolerance,
                }
            )
        results["rtt"] = {"direct_median_ms": round(base, 3), "points": rtt_rows}

        jitter_rows = []
        for distribution, jitter in JITTERS:
            _progress(verbose, f"jitter ({distribution}, {jitter:g} ms)")
            with proxy_process(
                up,
                "--rtt-ms",
                "50",
                "--jitter-ms",
                str(jitter),
                "--jitter-distribution",
                distribution,
            ) as (addr, _):
                delays = measure_one_way_ms(addr, count=JITTER_SAMPLES, interval_s=0.02)
            samples[f"one_way_ms/{distribution}"] = delays
            sd = statistics.stdev(delays)
            row: dict[str, Any] = {
                "distribution": distribution,
                "jitter_ms": jitter,
                "measured_stdev_ms": round(sd, 3),
                "samples": len(delays),
            }
            # The delays the emulator drew for these messages (the proxy's seed is
            # 0; one draw per message), to tell its fidelity from sampling error.
            sampler = JitterSampler(
                direction_rng(0, "client", "server"),
                delay_ms=25,
                jitter_ms=jitter,
                distribution=distribution,
                pareto_shape=PARETO_SHAPE,
            )
            drawn_sd = statistics.stdev(sampler.sample_s() * 1e3 for _ in delays)
            row["drawn_stdev_ms"] = round(drawn_sd, 3)
            if distribution == "pareto":
                # jitter_ms is the pareto *scale*; shape 3 has an infinite fourth
                # moment, so a sample standard deviation wanders far from the
                # population's (mostly low). Judge the emulator by the draws it made.
                a = PARETO_SHAPE
                row["expected_stdev_ms"] = round(
                    jitter * math.sqrt(a / ((a - 1) ** 2 * (a - 2))), 3
                )
                row["error"] = round((sd - drawn_sd) / drawn_sd, 4)
            else:
                row["expected_stdev_ms"] = jitter
                row["error"] = round((sd - jitter) / jitter, 4)
            row["ok"] = abs(row["error"]) <= 0.10
            jitter_rows.append(row)
        results["jitter"] = jitter_rows

        memory_rows = []
        for cap, rtt in ((1000, 50), (100, 150), (None, 50)):
            label = f"{cap} Mbit/s" if cap else "uncapped"
            _progress(verbose, f"memory under a full-speed sender ({label}, {rtt} ms)")
            flags = ["--rtt-ms", str(rtt)] + (["--bandwidth-mbit", str(cap)] if cap else [])
            with proxy_process(up, *flags) as (addr, pid):
                idle = _rss_kib(pid, "VmRSS")
                measure_throughput(addr, seconds=max(seconds, 2.0))
                peak = _rss_kib(pid, "VmHWM")
            # Bytes a link may hold: its rate for one delay plus its queue, or,
            # uncapped, one connection's window.
            defaults = DirectionParams()
            one_way_s = rtt / 2e3
            in_flight = (
                cap * 1e6 / 8 * (one_way_s + defaults.queue_ms / 1e3)
                if cap
                else defaults.window_bytes
            )
            memory_rows.append(
                {
                    "bandwidth_mbit": cap,
                    "rtt_ms": rtt,
                    "idle_rss_mib": round(idle / 1024, 1),
                    "peak_rss_mib": round(peak / 1024, 1),
                    "growth_mib": round((peak - idle) / 1024, 1),
                    "bound_in_flight_mib": round(in_flight / 2**20, 1),
                }
            )
        results["memory"] = memory_rows
    results["ok"] = all(
        row["ok"] for row in [*results["throughput"], results["uncapped"], *rtt_rows, *jitter_rows]
    )
    return results, samples


def plot_report(results: dict[str, Any], samples: dict[str, list[float]], path: str) -> None:
    """Write a PNG: throughput against the caps, added RTT against the configured
    RTT, and the one-way delay distributions of the jitter settings."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (tput, rtt, jit) = plt.subplots(1, 3, figsize=(15, 4.5))
    caps = [row["cap_mbit"] for row in results["throughput"]]
    tput.axhspan(-5, 5, color="grey", alpha=0.2, label="target +-5%")
    tput.axhline(0, color="grey", lw=1)
    for row in results["throughput"]:
        errors = [(r - row["cap_mbit"]) / row["cap_mbit"] * 100 for r in row["runs_mbit"]]
        tput.scatter([row["cap_mbit"]] * len(errors), errors, color="C0", s=14)
    tput.set_xscale("log")
    tput.set_xticks(caps, [str(c) for c in caps])
    tput.set(
        xlabel="configured cap (Mbit/s)",
        ylabel="measured - cap (%)",
        title="throughput through the proxy",
        ylim=(-7, 7),
    )
    tput.legend()

    points = results["rtt"]["points"]
    for i, row in enumerate(points):
        errors = [x - row["configured_ms"] for x in samples[f"added_rtt_ms/{row['configured_ms']}"]]
        rtt.scatter([i] * len(errors), errors, color="C0", s=8, alpha=0.5)
        rtt.errorbar([i], [0], yerr=[row["tolerance_ms"]], color="grey", capsize=8)
    rtt.axhline(0, color="grey", lw=1)
    rtt.set_xticks(range(len(points)), [f"{row['configured_ms']} ms" for row in points])
    rtt.set(
        xlabel="configured RTT",
        ylabel="measured - configured (ms)",
        title="added round-trip time (bars: target)",
    )

    for row in results["jitter"]:
        delays = samples[f"one_way_ms/{row['distribution']}"]
        median = statistics.median(delays)
        jit.hist(
            [d - median for d in delays],
            bins=40,
            histtype="step",
            lw=1.5,
            label=f"{row['distribution']} {row['jitter_ms']:g} ms: "
            f"sd {row['measured_stdev_ms']:.2f} (emulator drew {row['drawn_stdev_ms']:.2f})",
        )
    jit.set(
        xlabel="one-way delay - median (ms)",
        ylabel="messages",
        title="jitter (25 ms one-way delay)",
    )
    jit.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def format_report(r: dict[str, Any]) -> str:
    def mark(ok: bool) -> str:
        return "ok" if ok else "MISS"

    out = ["throughput (target: within 5% of the cap; median of runs)"]
    out.append("  cap Mbit/s   measured Mbit/s   error    ")
    for row in r["throughput"]:
        out.append(
            f"  {row['cap_mbit']:>10}   {row['median_mbit']:>15.2f}   {row['error']:+7.2%}"
            f"  {mark(row['ok'])}"
        )
    u = r["uncapped"]
    out.append(
        f"uncapped through the proxy: {u['median_mbyte_per_s']:.0f} MB/s "
        f"(direct, no proxy: {u['direct_mbyte_per_s']:.0f} MB/s; target >= 300)  {mark(u['ok'])}"
    )
    direct = r["rtt"]["direct_median_ms"]
    out.append(f"added round-trip time (target: within 1 ms + 2%; direct RTT {direct:.3f} ms)")
    for row in r["rtt"]["points"]:
        out.append(
            f"  configured {row['configured_ms']:>4} ms: added {row['median_added_ms']:8.3f} ms "
            f"(error {row['error_ms']:+.3f}, allowed +-{row['tolerance_ms']:.2f})"
            f"  {mark(row['ok'])}"
        )
    out.append("one-way delay jitter (target: stdev within 10%; pareto: of the emulator's draws)")
    for row in r["jitter"]:
        head = f"  {row['distribution']:>8} {row['jitter_ms']:g} ms: "
        if row["distribution"] == "pareto":
            out.append(
                f"{head}stdev {row['measured_stdev_ms']:.3f} ms; of the emulator's draws "
                f"{row['drawn_stdev_ms']:.3f} ({row['error']:+.1%}); population "
                f"{row['expected_stdev_ms']:.3f} (heavy tail)  {mark(row['ok'])}"
            )
        else:
            out.append(
                f"{head}stdev {row['measured_stdev_ms']:.3f} ms (expected "
                f"{row['expected_stdev_ms']:.3f}, {row['error']:+.1%}; the emulator's draws "
                f"{row['drawn_stdev_ms']:.3f})  {mark(row['ok'])}"
            )
    out.append("memory of the proxy process under a full-speed sender")
    for row in r["memory"]:
        label = f"{row['bandwidth_mbit']} Mbit/s" if row["bandwidth_mbit"] else "uncapped"
        out.append(
            f"  {label:>12}, {row['rtt_ms']} ms RTT: peak RSS {row['peak_rss_mib']} MiB, growth "
            f"{row['growth_mib']} MiB (bytes in flight bound {row['bound_in_flight_mib']} MiB)"
        )
    out.append("all targets met" if r["ok"] else "some targets MISSED")
    return "\n".join(out)
