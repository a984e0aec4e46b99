"""The packet-level emulator benchmark behind ``isthmus bench wan --hosts``.

It starts ``isthmus wan up --hosts`` for three sites, runs real TCP (and Gloo)
inside the hosts with ``isthmus wan exec``, and measures, against the targets
of the packet-level issue:

* throughput of one flow through a 200 Mbit/s, 50 ms link, after ramp-up,
  within +-5 % of the cap; its RTT within +-(1 ms + 2 %);
* the router's CPU per 200 Mbit/s flow (<= 20 % of a core) and the uncapped
  throughput between two hosts (>= 1 GB/s);
* Gloo's all-reduce of 64 MiB across three hosts, against the alpha-beta bounds;
* bulk TCP under 1 % loss for bbr and cubic, next to the Mathis estimate;
* the proxy backend's bulk throughput next to this backend's for the same link
  settings (its loss model is calibrated against real TCP here).
"""

from __future__ import annotations

import json
import math
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from isthmus.deploy.bench.emulator_bench import proxy_process
from isthmus.deploy.bench.gloo_baseline import time_on_hosts
from isthmus.sim.cost import LinkCost, predict
from isthmus.sim.probe import ProbeServer, measure_throughput

ISTHMUS = [sys.executable, "-m", "isthmus"]
RATE_MBIT = 200
RTT_MS = 50
PROBE_PORT = 9000
MSS_BYTES = 1448
LOSSY_REPEATS = 5
"""Runs of each lossy cubic and proxy measurement (their median is reported)."""
LOSSY_SECONDS = 20.0
"""Length of each lossy run: at 1% loss and 50 ms a 6 s run holds about a dozen loss
events, and cubic's throughput over one such run ranged 2.0-3.3 Mbit/s."""
JOB = f"""\
name: bench-hosts
sites: [{{name: a}}, {{name: b}}, {{name: c}}]
wan:
  default: {{rtt_ms: {RTT_MS}, bandwidth_mbit: {RATE_MBIT}}}
"""


class HostsRun:
    """A running ``wan up --hosts`` and helpers to act inside its hosts."""

    def __init__(self, workdir: Path) -> None:
        self.job = workdir / "job.yaml"
        self.job.write_text(JOB)
        self.state_path = workdir / "state.json"
        self.proc = subprocess.Popen(
            [*ISTHMUS, "wan", "up", str(self.job), "--hosts", "--state", str(self.state_path)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stdout is not None
        while line := self.proc.stdout.readline():
            if line.startswith("ready"):
                break
        else:
            err = self.proc.stderr.read() if self.proc.stderr else ""
            raise RuntimeError(f"'wan up --hosts' did not start: {err.strip()}")
        self.state = json.loads(self.state_path.read_text())
        self.background: list[subprocess.Popen] = []

    def address(self, site: str) -> str:
        return self.state["sites"][site]["address"]

    def exec_args(self, site: str, *command: str) -> list[str]:
        return [*ISTHMUS, "wan", "exec", str(self.job), site, "--", *command]

    def run_json(self, site: str, *command: str, timeout: float = 300) -> dict[str, Any]:
        result = subprocess.run(
            self.exec_args(site, *command), capture_output=True, text=True, timeout=timeout
        )
        if result.returncode != 0:
            raise RuntimeError(f"{' '.join(command)} in {site} failed: {result.stderr.strip()}")
        return json.loads(result.stdout.strip().splitlines()[-1])

    def start(self, site: str, *command: str) -> subprocess.Popen:
        proc = subprocess.Popen(self.exec_args(site, *command), stdout=subprocess.PIPE, text=True)
        self.background.append(proc)
        return proc

    def set_link(self, a: str, b: str, **changes: Any) -> None:
        pairs = [f"{k}={'null' if v is None else v}" for k, v in changes.items()]
        subprocess.run(
            [*ISTHMUS, "wan", "set", str(self.job), a, b, *pairs, "--state", str(self.state_path)],
            check=True,
            capture_output=True,
            timeout=30,
        )

    def cpu_seconds(self) -> float:
        with open(f"/proc/{self.proc.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def stop(self) -> None:
        for proc in self.background:
            proc.kill()
        self.proc.send_signal(signal.SIGTERM)
        self.proc.communicate(timeout=60)


@contextmanager
def hosts_run() -> Iterator[HostsRun]:
    with tempfile.TemporaryDirectory(prefix="isthmus-bench-") as tmp:
        run = HostsRun(Path(tmp))
        try:
            yield run
        finally:
            run.stop()


def _probe(*args: str) -> tuple[str, ...]:
    return (sys.executable, "-m", "isthmus.sim.probe", *args)


def _progress(verbose: bool, text: str) -> None:
    if verbose:
        print(f"bench wan --hosts: {text}", file=sys.stderr, flush=True)


def mathis_mbit(rtt_ms: float, loss: float, mss: int = MSS_BYTES) -> float:
    """Mathis et al. (1997): Reno-style TCP under random loss, MSS/RTT * sqrt(3/2) / sqrt(p)."""
    return mss * 8 / (rtt_ms / 1e3) * math.sqrt(1.5) / math.sqrt(loss) / 1e6


def run_hosts_bench(*, seconds: float = 10.0, verbose: bool = True) -> dict[str, Any]:
    results: dict[str, Any] = {"link": {"rtt_ms": RTT_MS, "bandwidth_mbit": RATE_MBIT}}
    skip = min(3.0, seconds / 3)
    with hosts_run() as run:
        server = run.start(
            "b", *_probe("serve", "--host", run.address("b"), "--port", str(PROBE_PORT))
        )
        assert server.stdout is not None and "listening" in server.stdout.readline()
        target = f"{run.address('b')}:{PROBE_PORT}"

        _progress(verbose, "round-trip time a -> b")
        rtts = run.run_json("a", *_probe("rtt", target, "--count", "30"))["rtt_ms"]
        median = statistics.median(rtts)
        tolerance = 1 + 0.02 * RTT_MS
        results["rtt"] = {
            "configured_ms": RTT_MS,
            "median_ms": round(median, 3),
            "error_ms": round(median - RTT_MS, 3),
            "tolerance_ms": tolerance,
            "ok": abs(median - RTT_MS) <= tolerance,
        }

        _progress(verbose, f"one TCP flow at {RATE_MBIT} Mbit/s for {seconds:g} s")
        cpu0, t0 = run.cpu_seconds(), time.monotonic()
        flow = run.run_json(
            "a", *_probe("throughput", target, "--seconds", str(seconds), "--skip-s", str(skip))
        )
        cpu = (run.cpu_seconds() - cpu0) / (time.monotonic() - t0)
        rate = flow["mbit_per_s_after_ramp"]
        results["throughput"] = {
            "cap_mbit": RATE_MBIT,
            "after_ramp_mbit": round(rate, 2),
            "whole_run_mbit": round(flow["mbit_per_s"], 2),
            "ramp_s": skip,
            "error": round((rate - RATE_MBIT) / RATE_MBIT, 4),
            "ok": abs(rate - RATE_MBIT) <= 0.05 * RATE_MBIT,
        }
        results["router_cpu"] = {
            "per_flow_core_fraction": round(cpu, 3),
            "target": "<= 0.20",
            "ok": cpu <= 0.20,
        }

        _progress(verbose, "uncapped throughput a -> b")
        run.set_link("a", "b", bandwidth_mbit=None, rtt_ms=0)
        cpu0, t0 = run.cpu_seconds(), time.monotonic()
        bulk = run.run_json("a", *_probe("throughput", target, "--seconds", "5"))
        cpu = (run.cpu_seconds() - cpu0) / (time.monotonic() - t0)
        results["uncapped"] = {
            "mbyte_per_s": round(bulk["bytes"] / bulk["seconds"] / 1e6, 1),
            "router_core_fraction": round(cpu, 3),
            "target": ">= 1000 MB/s",
            "ok": bulk["bytes"] / bulk["seconds"] >= 1e9,
        }

        loss_rows = []
        for loss in (0.001, 0.01):
            run.set_link("a", "b", bandwidth_mbit=RATE_MBIT, rtt_ms=RTT_MS, loss=loss)
            row: dict[str, Any] = {"loss": loss, "mathis_mbit": round(mathis_mbit(RTT_MS, loss), 2)}
            for cc in ("bbr", "cubic"):
                # Under loss one run holds only a handful of loss events, and
                # cubic's throughput swings with them: take a median.
                repeats = LOSSY_REPEATS if cc == "cubic" else 1
                samples = []
                for i in range(repeats):
                    _progress(verbose, f"bulk TCP ({cc}) under {loss:.1%} loss, run {i + 1}")
                    out = run.run_json(
                        "a",
                        *_probe(
                            "throughput",
                            target,
                            "--seconds",
                            str(max(seconds, LOSSY_SECONDS)),
                            "--skip-s",
                            str(skip),
                            "--congestion",
                            cc,
                        ),
                    )
                    samples.append(round(out["mbit_per_s_after_ramp"], 2))
                row[f"{cc}_mbit"] = statistics.median(samples)
                row[f"{cc}_runs_mbit"] = samples
            loss_rows.append(row)
        results["loss"] = loss_rows
        run.set_link("a", "b", loss=0)

        _progress(verbose, "Gloo all-reduce of 64 MiB across 3 hosts")
        results["gloo"] = _gloo(run)

    _progress(verbose, "proxy backend on the same link settings")
    results["calibration"] = _calibration(results, seconds, skip)
    results["ok"] = all(
        results[k]["ok"] for k in ("rtt", "throughput", "router_cpu", "uncapped")
    ) and all(row["ok"] for row in results["calibration"])
    return results


def _gloo(run: HostsRun, size_mib: float = 64.0) -> dict[str, Any]:
    sites = ["a", "b", "c"]
    data = time_on_hosts(run.job, run.state, sites, size_mib=size_mib, repeats=3)
    cost = LinkCost.of(bandwidth_mbit=RATE_MBIT, rtt_ms=RTT_MS)
    bound = predict(data["bytes"], sites, lambda a, b: cost)
    median = statistics.median(data["seconds"])
    return {
        "size_mib": size_mib,
        "seconds": [round(x, 3) for x in data["seconds"]],
        "median_s": round(median, 3),
        "ring_bound_s": round(bound["ring"], 3),
        "direct_bound_s": round(bound["direct"], 3),
        "efficiency_vs_ring": round(bound["ring"] / median, 3),
        "efficiency_vs_direct": round(bound["direct"] / median, 3),
        "correct": data["ok"],
    }


def _calibration(results: dict[str, Any], seconds: float, skip: float) -> list[dict[str, Any]]:
    """Bulk throughput of the proxy backend under the loss settings measured above."""
    rows = []
    with ProbeServer() as server:
        for row in [{"loss": 0.0}, *results["loss"]]:
            loss = row["loss"]
            flags = [
                "--rtt-ms",
                str(RTT_MS),
                "--bandwidth-mbit",
                str(RATE_MBIT),
                "--loss",
                str(loss),
            ]
            samples = []
            with proxy_process(server.address, *flags) as (address, _):
                for _ in range(LOSSY_REPEATS if loss else 1):
                    length = max(seconds, LOSSY_SECONDS) if loss else seconds
                    measured = measure_throughput(address, seconds=length)
                    samples.append(round(measured.mbit_per_s_after(skip), 2))
            proxy = statistics.median(samples)
            hosts_bbr = row.get("bbr_mbit", results["throughput"]["after_ramp_mbit"])
            hosts_cubic = row.get("cubic_mbit", results["throughput"]["after_ramp_mbit"])
            rows.append(
                {
                    "loss": loss,
                    "proxy_mbit": proxy,
                    "proxy_runs_mbit": samples,
                    "hosts_bbr_mbit": hosts_bbr,
                    "hosts_cubic_mbit": hosts_cubic,
                    "proxy_over_cubic": round(proxy / hosts_cubic, 3) if hosts_cubic else None,
                    "ok": bool(hosts_cubic) and abs(proxy / hosts_cubic - 1) <= 0.20,
                }
            )
    return rows


def format_hosts_report(r: dict[str, Any]) -> str:
    def mark(ok: bool) -> str:
        return "ok" if ok else "MISS"

    rtt, tput, cpu, unc, gloo = r["rtt"], r["throughput"], r["router_cpu"], r["uncapped"], r["gloo"]
    out = [
        f"packet-level hosts, link {r['link']['bandwidth_mbit']} Mbit/s, "
        f"{r['link']['rtt_ms']} ms RTT",
        f"  RTT: median {rtt['median_ms']:.3f} ms (error {rtt['error_ms']:+.3f}, "
        f"allowed +-{rtt['tolerance_ms']:.2f})  {mark(rtt['ok'])}",
        f"  one flow after {tput['ramp_s']:g} s ramp-up: {tput['after_ramp_mbit']:.1f} Mbit/s "
        f"({tput['error']:+.2%} of the cap; whole run {tput['whole_run_mbit']:.1f})"
        f"  {mark(tput['ok'])}",
        f"  router CPU for that flow: {cpu['per_flow_core_fraction']:.0%} of a core "
        f"(target <= 20%)  {mark(cpu['ok'])}",
        f"  uncapped a -> b: {unc['mbyte_per_s']:.0f} MB/s, router at "
        f"{unc['router_core_fraction']:.0%} of a core (target >= 1000 MB/s)  {mark(unc['ok'])}",
        "  bulk TCP under loss (after ramp-up):",
    ]
    for row in r["loss"]:
        out.append(
            f"    loss {row['loss']:.1%}: bbr {row['bbr_mbit']:.1f} Mbit/s, cubic "
            f"{row['cubic_mbit']:.1f} Mbit/s (median of {row['cubic_runs_mbit']}), "
            f"Mathis estimate {row['mathis_mbit']:.1f} Mbit/s"
        )
    out.append(
        f"  Gloo all-reduce of {gloo['size_mib']:g} MiB across 3 hosts: "
        f"median {gloo['median_s']:.2f} s; "
        f"ring bound {gloo['ring_bound_s']:.2f} s ({gloo['efficiency_vs_ring']:.2f} of it), "
        f"direct bound {gloo['direct_bound_s']:.2f} s ({gloo['efficiency_vs_direct']:.2f}); "
        f"result {'correct' if gloo['correct'] else 'WRONG'}"
    )
    out.append("  proxy backend vs real TCP, same link settings (bulk, after ramp-up):")
    for row in r["calibration"]:
        out.append(
            f"    loss {row['loss']:.1%}: proxy {row['proxy_mbit']:.1f} Mbit/s, hosts bbr "
            f"{row['hosts_bbr_mbit']:.1f}, cubic {row['hosts_cubic_mbit']:.1f} "
            f"(proxy / cubic {row['proxy_over_cubic']}, within 20%)  {mark(row['ok'])}"
        )
    out.append("all targets met" if r["ok"] else "some targets MISSED")
    return "\n".join(out)
