"""The control plane's targets: a killed site seen offline within 2 s; telemetry <= 1% of a step.

    python benchmarks/control_plane.py [--trials 5] [--steps 200]

1. Last Will latency, against Mosquitto (when installed) and the embedded
   broker: a site process holding a control-plane client is killed with
   SIGKILL (the kernel closes its socket, so the broker knows at once), or
   frozen with SIGSTOP (no packet at all, as when a host dies or the network
   cuts it off: only the 1 s keepalive finds it); measured is the time until
   (a) another client and (b) an outside ``mosquitto_sub`` see it offline.
   Median and max of the trials.
2. Telemetry cost: the built-in tiny GPT trains with and without a connected
   site client that publishes its status every step and a metrics message
   every step (the worst case), as a run sends them (status at most once a
   second, metrics once per round of 50 steps), or not at all, in interleaved
   blocks of 10 steps; medians of per-step time and their ratios, and the time
   of the two calls themselves over the step time.
"""

from __future__ import annotations

import argparse
import math
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from local_broker import mosquitto_binary, start_mosquitto

from isthmus.deploy.launch.broker import EmbeddedBroker
from isthmus.inter.control_plane import Broker, ControlPlane
from isthmus.intra.data import Dataset, ShardSpec, stdlib_corpus
from isthmus.intra.model import GPT, config_for, lm_loss

GIVE_UP_S = 15.0

SITE = """
import sys, time
from isthmus.inter.control_plane import Broker, ControlPlane
plane = ControlPlane(Broker("127.0.0.1", int(sys.argv[1])), "bench", "victim", status={"ranks": 1})
plane.start(wait_s=10)
print("up", flush=True)
time.sleep(600)
"""


def last_will_latency(
    broker: Broker, mosquitto_sub: str | None, sig: int
) -> tuple[float, float | None]:
    """Seconds from ``sig`` to offline, seen by a client and by mosquitto_sub."""
    outside = None
    if mosquitto_sub:
        outside = subprocess.Popen(
            [mosquitto_sub, "-p", str(broker.port), "-t", "isthmus/bench/sites/victim/status"],
            stdout=subprocess.PIPE,
            text=True,
        )
    site = subprocess.Popen(
        [sys.executable, "-c", SITE, str(broker.port)], stdout=subprocess.PIPE, text=True
    )
    assert site.stdout is not None and site.stdout.readline().strip() == "up"
    with ControlPlane(broker, "bench", None).start(wait_s=10) as observer:
        while observer.peers.get("victim", {}).get("state") != "online":
            time.sleep(0.01)
        if outside is not None:
            assert outside.stdout is not None
            while '"online"' not in outside.stdout.readline():
                pass
        killed = time.monotonic()
        site.send_signal(sig)
        while observer.peers["victim"]["state"] != "offline":
            if time.monotonic() - killed > GIVE_UP_S:
                site.kill()
                site.wait()
                if outside is not None:
                    outside.kill()
                    outside.wait()
                return math.inf, None
            time.sleep(0.005)
        seen = time.monotonic() - killed
    seen_outside = None
    if outside is not None:
        assert outside.stdout is not None
        while '"offline"' not in outside.stdout.readline():
            pass
        seen_outside = time.monotonic() - killed
        outside.terminate()
        outside.wait()
    site.kill()
    site.wait()
    return seen, seen_outside


ARMS = ("none", "as a run", "every step")


def telemetry_cost(broker: Broker, steps: int) -> tuple[dict[str, float], float]:
    """Median step time per arm, interleaved in blocks of 10 steps: no telemetry;
    as ``isthmus run`` sends it (status at most once a second, metrics every 50
    steps); status and metrics every step. And the median time of the calls."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = GPT(config_for("tiny"))
    data = Dataset(stdlib_corpus(2_000_000), model.config.seq_len)
    batches = data.batches(ShardSpec(0, (1,), 0), 8)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    plane = ControlPlane(broker, "bench", "site", status={"ranks": 1}).start(wait_s=10)
    last_status = 0.0

    def step(i: int, arm: str) -> float:
        nonlocal last_status
        started = time.perf_counter()
        x, y = next(batches)
        loss = lm_loss(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        every = arm == "every step"
        if every or (arm == "as a run" and time.monotonic() - last_status >= 1.0):
            last_status = time.monotonic()
            plane.update_status(step=i, round=i // 50)
        if every or (arm == "as a run" and i % 50 == 0):
            plane.publish_metrics(
                round=i, step=i, loss=float(loss.detach()), tokens_per_s=1.0, wan_bytes_sent=0,
                round_s=0.0, waiting_s=0.0,
            )  # fmt: skip
        return time.perf_counter() - started

    for i in range(20):  # warm-up
        step(i, "every step")
    times: dict[str, list[float]] = {arm: [] for arm in ARMS}
    for i in range(steps):
        arm = ARMS[(i // 10) % len(ARMS)]
        times[arm].append(step(i, arm))
    calls = []
    for i in range(1000):
        started = time.perf_counter()
        plane.update_status(step=i, round=i // 50)
        plane.publish_metrics(round=i, step=i, loss=1.0, tokens_per_s=1.0, wan_bytes_sent=0)
        calls.append(time.perf_counter() - started)
    plane.close()
    return {arm: statistics.median(t) for arm, t in times.items()}, statistics.median(calls)


def _spread(values: list[float]) -> str:
    if math.isinf(max(values)):
        return (
            f"not seen within {GIVE_UP_S:.0f} s in {sum(map(math.isinf, values))} of {len(values)}"
        )
    return f"median {statistics.median(values):.2f} s, max {max(values):.2f} s"


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--steps", type=int, default=600)
    args = parser.parse_args()
    brokers: list[tuple[str, Broker, object]] = []
    if mosquitto_binary():
        proc, port = start_mosquitto(Path(tempfile.mkdtemp()))
        brokers.append(("mosquitto", Broker("127.0.0.1", port), proc))
    embedded = EmbeddedBroker().start()
    brokers.append(("embedded (amqtt)", embedded.address, embedded))
    sub = shutil.which("mosquitto_sub")
    print("Last Will: a dead site seen offline (target <= 2 s)")
    for sig in (signal.SIGKILL, signal.SIGSTOP):
        for name, broker, _ in brokers:
            seen, outside = [], []
            for _ in range(args.trials):
                client, external = last_will_latency(broker, sub, sig)
                seen.append(client)
                if external is not None:
                    outside.append(external)
            line = f"  {sig.name:7s} {name:17s} client: {_spread(seen)}"
            if outside:
                line += f"; mosquitto_sub: {_spread(outside)}"
            print(line, flush=True)
    medians, call_t = telemetry_cost(brokers[0][1], args.steps)
    base = medians["none"]
    print(f"Telemetry ({brokers[0][0]}, tiny GPT, 1 thread): median step time (target <= +1%)")
    for arm in ARMS:
        print(f"  {arm:10s} {medians[arm] * 1e3:7.2f} ms  {(medians[arm] / base - 1) * 100:+.2f}%")
    print(
        f"  the calls themselves (status + metrics): {call_t * 1e6:.1f} us = "
        f"{call_t / base * 100:.3f}% of a step"
    )
    for _, _, handle in brokers:
        if isinstance(handle, subprocess.Popen):
            handle.terminate()
            handle.wait()
        else:
            handle.stop()  # type: ignore[attr-defined]
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
