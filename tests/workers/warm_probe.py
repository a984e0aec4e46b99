"""A rank for tests/test_warm_start.py, forked from the warm template: reports what a
fresh interpreter would have (its environment, torch's thread count, its own
``random`` draw, its process group), then ends as told.

    python -m warm_probe OUT.json [--exit N | --raise | --wait | --thread]
"""

from __future__ import annotations

import atexit
import json
import os
import random
import sys
import threading
import time
from pathlib import Path

import torch


def main() -> int:
    out = Path(sys.argv[1])
    how = sys.argv[2] if len(sys.argv) > 2 else ""
    report = {
        "pid": os.getpid(),
        "pgid": os.getpgid(0),
        "sid": os.getsid(0),
        "probe_env": os.environ.get("PROBE"),
        "omp": os.environ.get("OMP_NUM_THREADS"),
        "threads": torch.get_num_threads(),
        "random": random.random(),
        "argv": sys.argv,
        "cwd": os.getcwd(),
        "name": __name__,
        "path0": sys.path[0],
    }
    out.write_text(json.dumps(report))
    print("probe says hello")
    print("probe's error line", file=sys.stderr)
    atexit.register(lambda: out.with_suffix(".atexit").write_text("ran"))
    if how == "--exit":
        return int(sys.argv[3])
    if how == "--raise":
        raise ValueError("the probe's own exception")
    if how == "--wait":
        while True:
            time.sleep(0.1)
    if how == "--thread":  # a non-daemon thread: the process ends only after it
        threading.Thread(target=lambda: (time.sleep(0.5), print("thread done"))).start()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
