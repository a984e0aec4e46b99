"""One site of a DiLoCo job whose rounds the test scripts, through the public API.

    python tests/workers/diloco_rounds.py JOB SITE OUT.json --rounds 3 [--steps-in ROUND=N]
        [--poison ROUND] [--scale-tokens ROUND=N] [--site-adamw]
    python tests/workers/diloco_rounds.py JOB SITE OUT.json --round-seconds T --steps N
        [--step-sleep S]

Scripted rounds: every round the site takes a number of inner steps (default 2; ``--steps-in 1=0``
makes it idle in round 1), then calls ``DiLoCo.sync()``. ``--poison R`` puts a NaN
into the model just before round R's sync, as a diverged step would.
``--scale-tokens R=N`` makes the site send round R's data at scale N whatever
the others use (a site out of step with them, which the seal must catch). ``--site-adamw``: the
inner optimizer is SiteAdamW (each batch in two halves), not SGD. The report
holds, per round, the local parameters just before the sync and the model after
it, so the test can check what the round averaged.

Time-budgeted rounds: the site trains up to N steps, each taking at least S
seconds (a slow site), rounds ending every T seconds, and stops when
``training_over`` says a site has finished. The report holds every seal's
weights and the final parameters.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time

import torch

import isthmus


def scripted(args, site, model, inner, inner_step) -> dict:
    steps_in = {int(r): int(n) for r, n in (item.split("=") for item in args.steps_in)}
    scales = {int(r): int(n) for r, n in (item.split("=") for item in args.scale_tokens)}
    rounds = []
    with (
        site,
        isthmus.DiLoCo(
            site, model, inner, sync_every=10_000, outer_lr=1.0, outer_momentum=0.0, codec="none"
        ) as diloco,
    ):
        first_share = getattr(inner, "batch_share", None)
        for r in range(args.rounds):
            for _ in range(steps_in.get(r, 2)):
                inner_step()
            if r == args.poison:
                with torch.no_grad():
                    model.weight[0, 0] = float("nan")
            before = [p.detach().clone().tolist() for p in model.parameters()]
            if r in scales:
                diloco._scale_tokens = scales[r]
            diloco.sync()
            seal = diloco.last_seal
            rounds.append(
                {
                    "before": before,
                    "after": [p.detach().tolist() for p in model.parameters()],
                    "participants": seal.participants,
                    "refused": seal.refused,
                    "weights": seal.weights,
                    "scale_tokens": seal.scale_tokens,
                    "batch_share": getattr(inner, "batch_share", None),
                }
            )
        saved_share = diloco.state_dict().get("batch_share")
    return {
        "rounds": rounds,
        "outer_steps": diloco.outer_steps,
        "first_share": first_share,
        "share_after_close": getattr(inner, "batch_share", None),
        "saved_share": saved_share,
    }


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("job")
    parser.add_argument("site")
    parser.add_argument("out")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps-in", action="append", default=[], help="ROUND=STEPS")
    parser.add_argument("--poison", type=int, default=-1)
    parser.add_argument("--scale-tokens", action="append", default=[], help="ROUND=N")
    parser.add_argument("--round-seconds", type=float)
    parser.add_argument("--steps", type=int, default=0)
    parser.add_argument("--step-sleep", type=float, default=0.0)
    parser.add_argument("--site-adamw", action="store_true", help="the inner optimizer")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    torch.manual_seed(0)  # the same initial model everywhere
    model = torch.nn.Linear(8, 4)
    inner: torch.optim.Optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    if args.site_adamw:
        inner = isthmus.SiteAdamW(model.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(sum(map(ord, args.site)))  # each site its own data
    site = isthmus.join(args.job, site=args.site)

    def inner_step() -> None:
        x = torch.randn(16, 8, generator=gen)
        if isinstance(inner, isthmus.SiteAdamW):  # two halves: the noise it corrects for
            for half in (x[:8], x[8:]):
                (model(half).pow(2).mean() / 2).backward()
                inner.record_micro_batch()
        else:
            model(x).pow(2).mean().backward()
        time.sleep(args.step_sleep)
        inner.step()
        inner.zero_grad()

    if args.round_seconds is not None:
        seals = []
        with (
            site,
            isthmus.DiLoCo(
                site,
                model,
                inner,
                sync_every=10_000,
                round_seconds=args.round_seconds,
                codec="none",
            ) as diloco,
        ):
            for _ in range(args.steps):
                before = diloco.last_seal
                inner_step()
                if diloco.last_seal is not before:
                    seals.append(diloco.last_seal.weights)
                if diloco.training_over:
                    break
        if diloco.last_seal is not None and (
            not seals or diloco.last_seal.weights is not seals[-1]
        ):
            seals.append(diloco.last_seal.weights)  # the last round, run by leaving the block
        report = {
            "seals": seals,
            "inner_steps": diloco.inner_steps,
            "outer_steps": diloco.outer_steps,
            "params": [p.detach().tolist() for p in model.parameters()],
        }
    else:
        report = scripted(args, site, model, inner, inner_step)
    with open(args.out, "w") as f:
        json.dump(report, f)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
