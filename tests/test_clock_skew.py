"""Sites whose wall clocks differ by two minutes train and agree (different data
centres, an NTP step): nothing in the protocol compares wall clocks across sites,
certificates allow for skew, and ``isthmus watch`` measures a site's silence by its
own clock. Site a runs a minute ahead, c a minute behind (libfaketime: the whole
process's clock, its TLS included), b on time."""

from __future__ import annotations

import os
import subprocess
import time

import pytest
from needs import LIBFAKETIME, needs_faketime, needs_mosquitto
from test_control import Mosquitto
from test_site import ISTHMUS, _wait_for_rounds, finish, free_port_block, result, write

SKEW = {"a": "+60", "b": None, "c": "-60"}


@pytest.mark.slow
@needs_mosquitto
@needs_faketime
def test_sites_a_minute_apart_train_one_model_and_all_look_alive(tmp_path):
    broker = Mosquitto(tmp_path).start()
    base = free_port_block(3)
    job = write(
        tmp_path,
        f"""\
        name: skewed
        sites:
          - {{name: a, ranks: 1, address: 127.0.0.1:{base}}}
          - {{name: b, ranks: 1, address: 127.0.0.1:{base + 1}}}
          - {{name: c, ranks: 1, address: 127.0.0.1:{base + 2}}}
        train: {{strategy: diloco, steps: 300, sync_every: 10, warmup_steps: 2, eval_every: 0}}
        tls: {{ca: certs/ca.crt, cert: "certs/{{site}}.crt", key: "certs/{{site}}.key"}}
        control: {{broker: mqtt://127.0.0.1:{broker.port}}}
        """,
    )
    made = subprocess.run([*ISTHMUS, "certs", str(job), "--out", str(tmp_path / "certs")],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert made.returncode == 0, made.stderr

    def start(site: str) -> subprocess.Popen:
        env = dict(os.environ)
        if SKEW[site]:
            env |= {"LD_PRELOAD": str(LIBFAKETIME), "FAKETIME": SKEW[site]}
        return subprocess.Popen(
            [*ISTHMUS, "site", str(job), "--site", site, "--out", str(tmp_path / site)],
            cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip

    procs = {site: start(site) for site in SKEW}
    watched = None
    try:
        _wait_for_rounds(tmp_path / "b" / "sites" / "b" / "metrics.jsonl", 3, procs["b"], 180)
        clock = subprocess.run(
            ["date", "+%s"], env={"LD_PRELOAD": str(LIBFAKETIME), "FAKETIME": "+60"},
            capture_output=True, text=True, check=True,
        )  # fmt: skip
        assert abs(int(clock.stdout) - time.time() - 60) < 5  # the skew holds
        watched = subprocess.run(
            [*ISTHMUS, "watch", str(job), "--once", "2"],
            cwd=tmp_path, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
    finally:
        outputs = finish(procs, broker, timeout=300)
    assert watched is not None and watched.returncode == 0, watched
    rows = {line.split()[0]: line for line in watched.stdout.splitlines() if line.split()}
    for site in SKEW:
        assert site in rows, watched.stdout
        assert rows[site].split()[1] == "online", watched.stdout  # not "silent 61s"
    digests = {result(tmp_path / s, s)["param_sha256"] for s in SKEW}
    assert len(digests) == 1, outputs
    assert all(result(tmp_path / s, s)["outer_steps"] == 30 for s in SKEW)
