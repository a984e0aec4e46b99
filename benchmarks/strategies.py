"""Convergence of the sync strategies side by side, at equal tokens, with their WAN bytes.

The strategies issue's protocol: the built-in tiny model (2 layers, d128,
byte-level) on the standard library's source, 4 sites of one rank each,
batch 16 x 64 per site, 600 inner steps from scratch, inner AdamW (3e-3,
30 steps of warm-up, cosine decay to 10%, gradients clipped to norm 1); every
strategy with the same seeds, each site a separate process talking real gRPC
over loopback (convergence does not depend on link speed). Reported per
configuration: held-out loss (mean and spread over seeds), its gap to
``sync``, and the WAN bytes all sites sent, every byte counted (seals, final
synchronisation), with the ratio to ``sync``'s.

    python benchmarks/strategies.py [--seeds 0 1 2] [--steps 600] [--only diloco-h50 ...]
        [--lr-schedule cosine|constant] [--beta2 B] [--json FILE] [--plot FILE.png]

``--lr-schedule constant --beta2 0.95`` is the recipe the single-process trials
(``benchmarks/convergence_trials.py``) found closest to the issue's reference:
the peak rate held after the warm-up, AdamW's second beta 0.95.

With ``--json``, results already in FILE are kept and the configurations run
now are added or replaced, so a long protocol can be measured in parts;
``--report-only`` runs nothing and prints (and plots) what FILE holds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from example_sites import loopback_job, run_sites

from isthmus.deploy.examples.diloco_train import add_recipe_arguments

SITES = ["s0", "s1", "s2", "s3"]
# Means of closing the gap to sync at a small fraction of its bytes: an outer
# step that is plain averaging (lr 1, no momentum: the paper's Nesterov 0.7/0.9
# overshoots in short runs from scratch), a sync interval that grows as the
# learning rate decays, int4 pseudo-gradients with error feedback.
FEDAVG = ["--outer-lr", "1.0", "--outer-momentum", "0.0"]
INT4_EF = ["--codec", "int4", "--error-feedback"]
GROWING_H = "5:100,10:200,25:400,50"
SHRINKING_H = "4:300,3"
INT2_ZSTD_EF = ["--codec", "int2+zstd", "--error-feedback"]
TOPK_EF = ["--codec", "topk", "--error-feedback"]
CONFIGS: dict[str, list[str]] = {
    "sync": ["--strategy", "sync"],
    "diloco-h50": ["--strategy", "diloco", "--sync-every", "50"],
    "diloco-h100": ["--strategy", "diloco", "--sync-every", "100"],
    "diloco-h50-int8": ["--strategy", "diloco", "--sync-every", "50", "--codec", "int8"],
    "streaming-h50-p2-int4": [
        *("--strategy", "streaming", "--sync-every", "50", "--fragments", "2"),
        *("--overlap-steps", "5", "--codec", "int4"),
    ],
    "async-h50": ["--strategy", "async", "--sync-every", "50"],
    "diloco-avg-h50": ["--strategy", "diloco", "--sync-every", "50", *FEDAVG],
    "diloco-avg-growing-int4-ef": [
        *("--strategy", "diloco", "--sync-every-schedule", GROWING_H, *FEDAVG, *INT4_EF),
    ],
    "diloco-avg-h150-int4-ef": ["--strategy", "diloco", "--sync-every", "150", *FEDAVG, *INT4_EF],
    # Ternary pseudo-gradients with error feedback, zstd on top (most of them are
    # zero): about 24x smaller than float32 on this model, so sites can exchange
    # every 3-4 steps at over 100x fewer bytes than sync; more often late in the
    # run, where the learning rate held to the end makes the last rounds count.
    "diloco-avg-h4-int2zstd-ef": [
        *("--strategy", "diloco", "--sync-every", "4", *FEDAVG, *INT2_ZSTD_EF),
    ],
    # The outer step beyond plain averaging at the same H and codec: a rate above 1
    # (extrapolating each round's average), or Nesterov momentum at rate 1.
    "diloco-lr1.3-h4-int2zstd-ef": [
        *("--strategy", "diloco", "--sync-every", "4", "--outer-lr", "1.3"),
        *("--outer-momentum", "0.0", *INT2_ZSTD_EF),
    ],
    "diloco-nesterov0.5-h4-int2zstd-ef": [
        *("--strategy", "diloco", "--sync-every", "4", "--outer-lr", "1.0"),
        *("--outer-momentum", "0.5", *INT2_ZSTD_EF),
    ],
    "diloco-avg-shrinking-int2zstd-ef": [
        *("--strategy", "diloco", "--sync-every-schedule", SHRINKING_H, *FEDAVG, *INT2_ZSTD_EF),
    ],
    # The inner rate beside sync's: local AdamW steps on a quarter of sync's batch,
    # averaged, may move less per step than one step on the averaged gradient. Each
    # is held against sync at the same rate (argparse takes the last --lr).
    "sync-lr4.5e-3": ["--strategy", "sync", "--lr", "4.5e-3"],
    "diloco-avg-shrinking-int2zstd-ef-lr4.5e-3": [
        *("--strategy", "diloco", "--sync-every-schedule", SHRINKING_H, *FEDAVG, *INT2_ZSTD_EF),
        *("--lr", "4.5e-3"),
    ],
    "sync-lr6e-3": ["--strategy", "sync", "--lr", "6e-3"],
    "diloco-avg-shrinking-int2zstd-ef-lr6e-3": [
        *("--strategy", "diloco", "--sync-every-schedule", SHRINKING_H, *FEDAVG, *INT2_ZSTD_EF),
        *("--lr", "6e-3"),
    ],
    "diloco-avg-h34-int2zstd-ef-lr4.5e-3": [
        *("--strategy", "diloco", "--sync-every", "34", *FEDAVG, *INT2_ZSTD_EF, "--lr", "4.5e-3"),
    ],
    "diloco-avg-h34-int2zstd-ef": [
        *("--strategy", "diloco", "--sync-every", "34", *FEDAVG, *INT2_ZSTD_EF),
    ],
    # The inner AdamW's second moment corrected to the sites' averaged batch
    # (isthmus.SiteAdamW, each batch taken as two halves): a site's gradient carries
    # four times the noise of the batch the averaged step stands for, and plain
    # AdamW's steps shrink by it.
    "diloco-avg-shrinking-int2zstd-ef-site": [
        *("--strategy", "diloco", "--sync-every-schedule", SHRINKING_H, *FEDAVG, *INT2_ZSTD_EF),
        *("--inner", "site-adamw"),
    ],
    "diloco-avg-h4-int2zstd-ef-site": [
        *("--strategy", "diloco", "--sync-every", "4", *FEDAVG, *INT2_ZSTD_EF),
        *("--inner", "site-adamw"),
    ],
    "diloco-avg-h34-int2zstd-ef-site": [
        *("--strategy", "diloco", "--sync-every", "34", *FEDAVG, *INT2_ZSTD_EF),
        *("--inner", "site-adamw"),
    ],
    # Sparse pseudo-gradients (codec topk): the largest 2% (or 1%) of every 4,096
    # values, 2-bit, with error feedback; an owner sends the union of the sites'
    # positions back. "-decay": SparseLoCo's form, the residual decaying by 0.95 a
    # round in place of outer momentum (there is none: plain averaging).
    "diloco-avg-h4-topk-ef": ["--strategy", "diloco", "--sync-every", "4", *FEDAVG, *TOPK_EF],
    "diloco-avg-h4-topk1-ef": [
        *("--strategy", "diloco", "--sync-every", "4", *FEDAVG),
        *("--codec", "topk:density=0.01", "--error-feedback"),
    ],
    "diloco-avg-h4-topk-decay": [
        *("--strategy", "diloco", "--sync-every", "4", *FEDAVG),
        *("--codec", "topk:density=0.02,feedback_decay=0.95", "--error-feedback"),
    ],
    "diloco-avg-h10-topk-ef": ["--strategy", "diloco", "--sync-every", "10", *FEDAVG, *TOPK_EF],
    # With the inner SiteAdamW, by gather (run_one), toward the 1000x: H and
    # density such that the whole run sends 0.1-0.2% of sync's bytes.
    **{
        f"diloco-avg-h{h}-topk{name}-ef-site-gather": [
            *("--strategy", "diloco", "--sync-every", str(h)),
            *FEDAVG,
            *("--codec", f"topk:density={density}", "--error-feedback"),
            *("--inner", "site-adamw"),
        ]
        for h, name, density in (
            (4, "", 0.02),
            (4, "1", 0.01),
            (4, "05", 0.005),
            (8, "1", 0.01),
            (10, "1", 0.01),
        )
    },
    # Overlapped DiLoCo: streaming with one fragment, its exchange on the wire for a
    # whole round (the sites never wait for it), applied eagerly (the new global
    # parameters plus what the site trained meanwhile) or mixed (the paper's 0.5).
    "overlapped-avg-h4-eager-int2zstd-ef": [
        *("--strategy", "streaming", "--fragments", "1", "--sync-every", "4"),
        *("--overlap-steps", "4", "--merge", "eager", *FEDAVG, *INT2_ZSTD_EF),
    ],
    "overlapped-avg-h4-mix-int2zstd-ef": [
        *("--strategy", "streaming", "--fragments", "1", "--sync-every", "4"),
        *("--overlap-steps", "4", "--merge", "mix", *FEDAVG, *INT2_ZSTD_EF),
    ],
    "overlapped-h50-eager": [
        *("--strategy", "streaming", "--fragments", "1", "--sync-every", "50"),
        *("--overlap-steps", "50", "--merge", "eager"),
    ],
}
WARMUP_STEPS = 30
"""Every strategy trains with the same inner schedule: linear warm-up over these
steps, then cosine decay to 10% (as ``isthmus run`` does)."""
GRAD_CLIP = 1.0
"""And the same gradient clipping (sync: of the averaged gradient), as ``isthmus run``
does: without it sync's loss spiked and moved by 0.23 across seeds."""


# The same sparse rounds by gather: no owner sends the union of the positions back,
# so fewer bytes for the same average (a "-gather" name's job says so, run_one).
CONFIGS.update(
    {
        f"{name}-gather": CONFIGS[name]
        for name in ("diloco-avg-h4-topk-ef", "diloco-avg-h4-topk1-ef")
    }
)


def run_one(config: str, seed: int, steps: int, corpus_bytes: int | None, recipe: dict) -> dict:
    with tempfile.TemporaryDirectory(prefix="isthmus-strategies-") as tmp:
        tmpdir = Path(tmp)
        # A "-gather" configuration's rounds take the gather all-reduce (one trip,
        # each site's contribution to every site) instead of the default direct.
        train = "train: {algorithm: gather}\n" if config.endswith("-gather") else ""
        job = loopback_job(tmpdir / "job.yaml", "strategies", SITES, train=train)
        args = ["--steps", str(steps), "--batch", "16", "--seed", str(seed), "--lr", "3e-3"]
        args += ["--warmup-steps", str(WARMUP_STEPS), "--grad-clip", str(GRAD_CLIP)]
        args += ["--lr-schedule", recipe["lr_schedule"], "--beta2", str(recipe["beta2"])]
        # Four sites share this machine's cores: one thread each.
        args += ["--eval-batches", "32", "--threads", "1", *CONFIGS[config]]
        if corpus_bytes:
            args += ["--corpus-bytes", str(corpus_bytes)]
        started = time.monotonic()
        try:
            reports = list(run_sites(job, SITES, args, tmpdir).values())
        except RuntimeError as exc:
            raise SystemExit(f"{config} seed {seed}: {exc}") from None
    if len({r["param_sha256"] for r in reports}) != 1:
        raise SystemExit(f"{config} seed {seed}: sites ended with different parameters")
    return {
        "eval_loss": reports[0]["eval_loss"],
        "wan_bytes": sum(r["wan_bytes_sent"] for r in reports),
        "outer_steps": reports[0]["outer_steps"],
        "seconds": time.monotonic() - started,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--only", nargs="+", choices=list(CONFIGS), default=list(CONFIGS))
    parser.add_argument("--corpus-bytes", type=int, default=None)
    add_recipe_arguments(parser)
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--plot", help="plot of loss gap against WAN bytes (PNG)")
    parser.add_argument(
        "--report-only",
        action="store_true",
        help="run nothing: print the table (and --plot) of the results already in --json",
    )
    args = parser.parse_args()
    results: dict[str, dict] = {}
    if args.json and Path(args.json).exists():
        # Configurations measured by an earlier invocation stay (the table is
        # printed for all of them); the ones run now replace theirs.
        results = json.loads(Path(args.json).read_text())
    recipe = {"lr_schedule": args.lr_schedule, "beta2": args.beta2}
    # Files written before the recipe was recorded hold the cosine one.
    cosine = {"lr_schedule": "cosine", "beta2": 0.999}
    other = {c: r.get("recipe", cosine) for c, r in results.items()}
    other = {c: r for c, r in other.items() if r != recipe}
    if other:  # one table compares one recipe
        parser.error(
            f"--json {args.json} holds results of another recipe ({other}); "
            "give another file or the same --lr-schedule and --beta2"
        )
    if args.report_only:
        if not results:
            parser.error("--report-only needs --json FILE with results in it")
        args.only = []
    total = len(args.only) * len(args.seeds)
    done = 0
    for config in args.only:
        runs = []
        for seed in args.seeds:
            runs.append(run_one(config, seed, args.steps, args.corpus_bytes, recipe))
            done += 1
            print(
                f"[{done}/{total}] {config} seed {seed}: eval loss {runs[-1]['eval_loss']:.4f}, "
                f"WAN {runs[-1]['wan_bytes'] / 1e6:.1f} MB, {runs[-1]['seconds']:.0f} s",
                file=sys.stderr,
                flush=True,
            )
        losses = [r["eval_loss"] for r in runs]
        results[config] = {
            "eval_loss_mean": statistics.mean(losses),
            "eval_loss_spread": max(losses) - min(losses),
            "eval_losses": losses,
            "wan_bytes": statistics.mean(r["wan_bytes"] for r in runs),
            "outer_steps": runs[0]["outer_steps"],
            "recipe": recipe,
        }
        if args.json:  # after every configuration: a long run keeps what it measured
            Path(args.json).write_text(json.dumps(results, indent=2))
    base = results.get("sync")
    print(
        f"{'config':24} {'eval loss':>18} {'gap vs sync':>12} {'WAN MB':>10} {'bytes / sync':>13}"
    )
    for config, r in results.items():
        gap = r["eval_loss_mean"] / base["eval_loss_mean"] - 1 if base else float("nan")
        ratio = r["wan_bytes"] / base["wan_bytes"] if base else float("nan")
        r["gap_vs_sync"] = gap
        r["bytes_vs_sync"] = ratio
        print(
            f"{config:24} {r['eval_loss_mean']:>9.4f} ± {r['eval_loss_spread'] / 2:.4f} "
            f"{gap:>+11.1%} {r['wan_bytes'] / 1e6:>10.1f} {ratio:>12.4f}x"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    if args.plot and base:
        _plot(results, args.plot)
    return 0


def _plot(results: dict[str, dict], path: str) -> None:
    """Left: each configuration's gap to sync against how many times fewer bytes it
    sent, with the targets (<= 1% at >= 100x, <= 3% at >= 1000x) shaded. Right: the
    losses themselves, with the spread over seeds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [n for n in results if n != "sync"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.8))
    gaps = [100 * results[n]["gap_vs_sync"] for n in names]
    low = min(0.0, *gaps) - 1
    left.fill_between(
        [100, 1e4], low, 1, color="tab:green", alpha=0.15, label="target: ≤ 1% at ≥ 100x"
    )
    left.fill_between(
        [1000, 1e4], 1, 3, color="tab:olive", alpha=0.15, label="target: ≤ 3% at ≥ 1000x"
    )
    left.axhline(0, color="black", lw=0.6)
    for name in names:
        r = results[name]
        x, y = 1 / r["bytes_vs_sync"], 100 * r["gap_vs_sync"]
        left.plot(x, y, "o")
        left.annotate(name, (x, y), fontsize=7, xytext=(4, 3), textcoords="offset points")
    left.set_xscale("log")
    left.set_xlim(20, 5000)
    left.set_ylim(low, max(gaps) * 1.15)
    left.set_xlabel("times fewer WAN bytes than sync")
    left.set_ylabel("held-out loss above sync's (%)")
    left.legend(loc="center right", fontsize=8)
    every = list(results)
    losses = [results[n]["eval_loss_mean"] for n in every]
    right.barh(every, losses, xerr=[results[n]["eval_loss_spread"] / 2 for n in every])
    right.set_xlim(min(losses) - 0.1, max(losses) + 0.1)
    right.invert_yaxis()
    right.tick_params(axis="y", labelsize=7)
    right.set_xlabel("held-out loss (nats/byte), mean over seeds")
    fig.suptitle("Strategies at equal tokens: 4 sites, tiny GPT, 600 inner steps")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    raise SystemExit(main())
