"""One site of the attack suite's job (see attack_suite.py): DiLoCo on a small model.

``python benchmarks/attack_site.py JOB.yaml SITE --steps N --sync-every H --out DIR``
trains with ``isthmus.join`` as a user's own script would, writes
``DIR/SITE.progress`` (the rounds completed, replaced whole after each step)
so the attacker knows which rounds are over, waits between rounds after
``--pause-after-round`` rounds until ``DIR/go-on`` exists, and at the end ``DIR/SITE.json``:
the model's ``param_sha256``, the rounds, the wall time and what this site's
peer service refused, by kind.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import time
from pathlib import Path

import torch
from torch import nn

import isthmus


def _write(path: Path, data: dict) -> None:
    temporary = path.with_name(f".{path.name}.{os.getpid()}")
    temporary.write_text(json.dumps(data))
    temporary.replace(path)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("job")
    parser.add_argument("site")
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--sync-every", type=int, default=4)
    parser.add_argument("--step-s", type=float, default=0.02, help="pause per step (paces the run)")
    parser.add_argument(
        "--pause-after-round",
        type=int,
        default=2,
        help="after this many rounds wait (between rounds) until DIR/go-on exists",
    )
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    out = Path(args.out)
    site = isthmus.join(args.job, site=args.site)
    torch.manual_seed(0)  # the same initial model on every site
    model = nn.Sequential(nn.Linear(64, 256), nn.Tanh(), nn.Linear(256, 64))
    data = torch.Generator().manual_seed(1 + site.site_index)  # each site its own data
    inner = torch.optim.SGD(model.parameters(), lr=0.05)
    strategy = isthmus.DiLoCo(site, model, inner, sync_every=args.sync_every, outer_lr=0.7)
    started = time.perf_counter()
    with site, strategy:
        for _ in range(args.steps):
            x = torch.randn(32, 64, generator=data)
            loss = ((model(x) - x.flip(1)) ** 2).mean()
            loss.backward()
            inner.step()  # every sync_every steps the round runs here
            inner.zero_grad()
            _write(out / f"{args.site}.progress", {"outer_steps": strategy.outer_steps})
            time.sleep(args.step_s)
            if strategy.outer_steps == args.pause_after_round:
                while not (out / "go-on").exists():  # the attacker's window
                    time.sleep(0.05)
    refusals = site.refusals  # after the last round: everything the run refused
    digest = hashlib.sha256()
    for p in model.parameters():
        digest.update(p.detach().numpy().tobytes())
    _write(
        out / f"{args.site}.json",
        {
            "site": args.site,
            "outer_steps": strategy.outer_steps,
            "wall_seconds": time.perf_counter() - started,
            "param_sha256": digest.hexdigest(),
            "refusals": refusals,
        },
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
