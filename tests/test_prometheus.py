"""Every rank's /metrics for Prometheus (``metrics: {prometheus_port: PORT}``)."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from isthmus.deploy.cli import main
from isthmus.job.file import JobFileError, parse_job
from isthmus.job.ports import free_ports

ROOT = Path(__file__).resolve().parents[1]
JOB = """\
name: scraped
sites:
  - {name: a, ranks: 1}
  - {name: b, ranks: 2}
wan:
  default: {rtt_ms: 10, bandwidth_mbit: 200}
train: {strategy: diloco, steps: 120, sync_every: 4, warmup_steps: 2, eval_every: 0}
metrics: {prometheus_port: 9400}
"""


def samples(text: str) -> dict[tuple[str, frozenset], float]:
    """The Prometheus text format's samples: (name, labels) -> value."""
    out = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        head, value = line.rsplit(" ", 1)
        name, _, rest = head.partition("{")
        labels = frozenset(
            tuple(part.split("=", 1)) for part in rest.rstrip("}").split(",") if "=" in part
        )
        out[(name, labels)] = float(value)
    return out


def total(found: dict[tuple[str, frozenset], float], name: str) -> float:
    return sum(v for (n, _), v in found.items() if n == name)


def scrape(url: str) -> dict[tuple[str, frozenset], float]:
    with urllib.request.urlopen(url, timeout=5) as response:
        return samples(response.read().decode())


def test_the_port_is_checked_against_the_ranks_of_a_node():
    for bad in ("0", "65536", "'9400'", "true"):
        with pytest.raises(JobFileError, match=r"metrics.prometheus_port: must be a port"):
            parse_job(JOB.replace("prometheus_port: 9400", f"prometheus_port: {bad}"))
    with pytest.raises(JobFileError, match=r"metrics.prometheus_prot: unknown key"):
        parse_job(JOB.replace("prometheus_port: 9400", "prometheus_prot: 9400"))
    assert parse_job(JOB).metrics.prometheus_port == 9400


def test_print_ports_names_the_metrics_ports_to_open(tmp_path, capsys):
    job = tmp_path / "job.yaml"
    job.write_text(
        "name: x\nsites:\n  - {name: a, ranks: 4, nodes: 2, address: '127.0.0.1:7100'}\n"
        "  - {name: b, address: '127.0.0.1:7200'}\ncontrol: {broker: 'mqtt://127.0.0.1:1883'}\n"
        "metrics: {prometheus_port: 9400}\n"
    )
    assert main(["site", str(job), "--site", "a", "--print-ports"]) == 0
    out = capsys.readouterr().out
    assert "from your Prometheus (TCP): /metrics on port 9400-9401 of every node" in out


@pytest.mark.slow  # a site process: torch's import alone is seconds
def test_a_metrics_port_in_use_is_refused_before_the_site_joins(tmp_path):
    held = socket.socket()
    held.bind(("0.0.0.0", 0))
    held.listen()
    port = held.getsockname()[1]
    a, b = free_ports("127.0.0.1", 2)
    job = tmp_path / "job.yaml"
    job.write_text(
        f"name: x\nsites: [{{name: a, address: '127.0.0.1:{a}'}}, "
        f"{{name: b, address: '127.0.0.1:{b}'}}]\n"
        f"control: {{broker: 'mqtt://127.0.0.1:{free_ports('127.0.0.1', 1)[0]}'}}\n"
        f"metrics: {{prometheus_port: {port}}}\n"
    )
    try:
        site = subprocess.run(
            [
                sys.executable,
                "-m",
                "isthmus",
                "site",
                str(job),
                "--site",
                "a",
                "--log-format",
                "json",
            ],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=120,
        )
    finally:
        held.close()
    assert site.returncode == 2, site.stderr
    # --log-format json: the one-line error is a JSON object, as a log shipper wants it.
    lines = [json.loads(line) for line in site.stderr.splitlines() if line.startswith("{")]
    errors = [line for line in lines if line["level"] == "ERROR"]
    assert len(errors) == 1 and errors[0]["site"] == "a", site.stderr
    assert errors[0]["message"].startswith(
        f"metrics.prometheus_port: rank 0 of site a cannot serve /metrics on 0.0.0.0:{port}"
    )
    assert "in use" in errors[0]["message"] and "Traceback" not in site.stderr


@pytest.mark.slow
def test_every_rank_serves_metrics_that_rise_and_end_at_the_summary_s_figures(tmp_path):
    job = tmp_path / "job.yaml"
    job.write_text(JOB)
    out = tmp_path / "run"
    run = subprocess.Popen(
        [sys.executable, "-m", "isthmus", "run", str(job), "--out", str(out), "--no-report"],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        endpoints_file = out / "endpoints.json"
        deadline = time.monotonic() + 120
        while not endpoints_file.exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        endpoints = json.loads(endpoints_file.read_text())
        assert sorted(endpoints) == ["a", "b"] and sorted(endpoints["b"]) == ["0", "1"]
        url = endpoints["b"]["1"]

        def scrape_until(done) -> dict:
            """Scrape until ``done(samples)``: tied to the run's progress, not the clock."""
            found: dict = {}
            while time.monotonic() < deadline:
                try:
                    found = scrape(url)
                except OSError:  # not serving yet
                    found = {}
                if done(found):
                    return found
                time.sleep(0.3)
            raise AssertionError(f"{url}: not seen in time; last scrape {found}")

        deadline = time.monotonic() + 180
        first = scrape_until(lambda f: total(f, "isthmus_outer_rounds_total") >= 1)
        rising = ("isthmus_inner_steps_total", "isthmus_wan_bytes_sent_total")
        assert all(total(first, name) > 0 for name in rising)
        # Two rounds later (of 30: the scrapes poll every 0.3 s, and even a fast machine
        # takes about 0.1 s a round, so most of the run is still to go): both have risen.
        second = scrape_until(
            lambda f: (
                total(f, "isthmus_outer_rounds_total")
                >= total(first, "isthmus_outer_rounds_total") + 2
            )
        )
        for name in rising:
            assert total(second, name) > total(first, name), name
        labels = {dict(k[1]).get("site") for k in second}
        assert labels == {'"b"'}
        assert ("isthmus_membership_epoch", frozenset({("site", '"b"'), ("rank", '"1"')})) in (
            second
        )
        codec = [dict(k[1]) for k in second if k[0] == "isthmus_settings"]
        assert codec and codec[0]["strategy"] == '"diloco"'
        assert (codec[0]["model"], codec[0]["inner_optimizer"]) == ('"tiny"', '"SiteAdamW"')
        _, stderr = run.communicate(timeout=600)
    finally:
        run.kill()
    assert run.returncode == 0, stderr
    summary = json.loads((out / "summary.json").read_text())
    finals = sorted((out / "sites").glob("*/metrics-rank-*.prom"))
    assert [p.relative_to(out / "sites").as_posix() for p in finals] == [
        "a/metrics-rank-0.prom",
        "b/metrics-rank-0.prom",
        "b/metrics-rank-1.prom",
    ]
    ended = [samples(p.read_text()) for p in finals]
    assert sum(total(f, "isthmus_wan_bytes_sent_total") for f in ended) == summary["wan_bytes"]
    # Received counts the same bytes from the other end: a's is what b's ranks sent.
    received_a = total(ended[0], "isthmus_wan_bytes_received_total")
    sent_b = sum(total(f, "isthmus_wan_bytes_sent_total") for f in ended[1:])
    assert received_a == sent_b > 0
    assert sum(total(f, "isthmus_wan_bytes_received_total") for f in ended) == summary["wan_bytes"]
    assert total(ended[0], "isthmus_inner_steps_total") == summary["sites"]["a"]["inner_steps"]
    # The Grafana dashboard asks only for series a rank serves.
    dashboard = json.loads((ROOT / "deploy" / "grafana" / "isthmus-dashboard.json").read_text())
    asked = {
        name
        for panel in dashboard["panels"]
        for target in panel["targets"]
        for name in re.findall(r"isthmus_\w+", target["expr"])
    }
    served = {name for f in ended for name, _ in f}
    assert asked and asked <= served, asked - served
