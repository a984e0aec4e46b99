"""``isthmus run --compare``: one job, one run per strategy, one report that compares them."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from isthmus.deploy.launch.summary import optimizer_text
from isthmus.training.records import read_records, write_json_atomic


def first_site_evals(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The held-out evaluations of the run's first site, in the order written. Where
    a strategy's sites differ between rounds, the built-in loop evaluates after each
    round (its default), when they hold the shared model."""
    first_site = next((r["site"] for r in records if r.get("site")), None)
    return [
        r
        for r in records
        if r["kind"] == "eval" and r["site"] == first_site and r.get("eval_loss") is not None
    ]


def held_out_curve(records: list[dict[str, Any]], started: float) -> list[tuple[float, float]]:
    """(seconds since the run started, held-out loss) of the model the sites share,
    in time order (:func:`first_site_evals`)."""
    return sorted((r["t"] - started, r["eval_loss"]) for r in first_site_evals(records))


def seconds_to_loss(curve: list[tuple[float, float]], target: float) -> float | None:
    """When the curve first reached ``target`` (None: never)."""
    return next((t for t, loss in curve if loss <= target), None)


def comparison_rows(
    summaries: dict[str, dict[str, Any]],
    curves: dict[str, list[tuple[float, float]]] | None = None,
) -> list[dict[str, Any]]:
    """One row per strategy. With ``curves`` (:func:`held_out_curve` of each run) and
    sync among the strategies, each row also says when its shared model first
    reached the best held-out loss sync reached (``seconds_to_sync_loss``), and
    that time over sync's own (``time_to_sync_loss_vs_sync``)."""
    curves = curves or {}
    sync_curve = curves.get("sync") or []
    target = min((loss for _, loss in sync_curve), default=None)
    sync_time = seconds_to_loss(sync_curve, target) if target is not None else None
    rows = []
    for strategy, summary in summaries.items():
        losses = [s["eval_loss"] for s in summary["sites"].values() if s["eval_loss"] is not None]
        row: dict[str, Any] = {
            "strategy": strategy,
            "status": summary["status"],
            "eval_loss": statistics.fmean(losses) if losses else None,
            "wan_bytes": summary["wan_bytes"],
            "compute_utilization": summary["compute_utilization"],
            "wall_seconds": summary["wall_seconds"],
            "identical_sites": len({s["param_sha256"] for s in summary["sites"].values()}) == 1
            and all(s["param_sha256"] for s in summary["sites"].values()),
        }
        if target is not None:
            reached = seconds_to_loss(curves.get(strategy, []), target)
            row["sync_best_loss"] = target
            row["seconds_to_sync_loss"] = reached
            row["time_to_sync_loss_vs_sync"] = (
                reached / sync_time if reached is not None and sync_time else None
            )
        rows.append(row)
    return rows


def _curves(
    evals: dict[str, list[dict[str, Any]]], summaries: dict[str, dict[str, Any]]
) -> dict[str, list[tuple[float, float]]]:
    curves = {}
    for strategy, summary in summaries.items():
        started = summary.get("started")
        if started is not None:  # a summary written before runs recorded their start
            curves[strategy] = held_out_curve(evals[strategy], started)
    return curves


def write_comparison(out: Path, summaries: dict[str, dict[str, Any]], *, plot: bool = True) -> Path:
    """``compare.json``, ``compare.md`` and (``plot``) ``compare.png`` in ``out``; returns
    the report. Without the plot, the runs' own reports were not written either."""
    # Each run's records read once, for the rows and the plot.
    evals = {s: first_site_evals(read_records(out / s / "metrics.jsonl")) for s in summaries}
    curves = _curves(evals, summaries)
    rows = comparison_rows(summaries, curves)
    write_json_atomic(out / "compare.json", rows)
    image = _plot(out, summaries, evals, curves) if plot else None
    first = next(iter(summaries.values()))
    timed = any("seconds_to_sync_loss" in row for row in rows)
    header = "| strategy | held-out loss | WAN bytes | compute utilisation | wall s |"
    header += " s to sync's best loss |" if timed else ""
    lines = [
        f"# `{first['job']}`: which strategy on these links?",
        "",
        header + " status |",
        "| --- " * (header.count("|") - 1) + "| --- |",
    ]
    for row in rows:
        loss = f"{row['eval_loss']:.3f}" if row["eval_loss"] is not None else "-"
        line = (
            f"| {row['strategy']} | {loss} | {row['wan_bytes'] / 1e6:.1f} MB | "
            f"{row['compute_utilization']:.0%} | {row['wall_seconds']:.0f} |"
        )
        if timed:
            reached, ratio = row["seconds_to_sync_loss"], row["time_to_sync_loss_vs_sync"]
            line += (
                " never |"
                if reached is None
                else f" {reached:.0f}" + (f" ({ratio:.2f}x sync) |" if ratio else " |")
            )
        lines.append(line + f" {row['status']} |")
    shared, own = _shared_settings(summaries)
    lines += [
        "",
        "Same job, data and tokens for every strategy; each run's own report is in its "
        "sub-directory (`STRATEGY/report.md`)."
        if plot
        else "Same job, data and tokens for every strategy; `isthmus report OUT/STRATEGY` "
        "writes a run's own report.",
    ]
    if timed:
        target = next(r["sync_best_loss"] for r in rows if "sync_best_loss" in r)
        lines += [
            "",
            f"Time to sync's best loss: the wall time from the run's start at which the "
            f"model the sites share first reached the lowest held-out loss sync reached "
            f"({target:.3f}); the loss a user gets per hour on these links.",
        ]
    if image:
        lines += ["", f"![held-out loss against tokens and wall time, and WAN bytes]({image})"]
    lines += ["", "Settings: " + ", ".join(f"{k}={v}" for k, v in shared.items())]
    if any(own.values()):
        lines += [
            "Where they differ: "
            + "; ".join(
                f"{strategy} " + ", ".join(f"{k}={v}" for k, v in differing.items())
                for strategy, differing in own.items()
            )
        ]
    report = out / "compare.md"
    report.write_text("\n".join(lines) + "\n")
    return report


def _shared_settings(
    summaries: dict[str, dict[str, Any]],
) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """The settings every run had, and each run's own where they differ: a job file
    that leaves ``codec`` unset gives the DiLoCo family ``int2+zstd`` and sync none,
    and one line of the first run's settings would state sync's for all."""
    runs = {strategy: _what_ran(summary) for strategy, summary in summaries.items()}
    first = next(iter(runs.values()))
    keys = list(dict.fromkeys(k for r in runs.values() for k in r if k != "strategy"))
    shared = {
        k: first[k] for k in keys if all(k in r and r[k] == first.get(k) for r in runs.values())
    }
    own = {s: {k: r[k] for k in keys if k not in shared and k in r} for s, r in runs.items()}
    return shared, own


def _what_ran(summary: dict[str, Any]) -> dict[str, Any]:
    """One run's settings that applied, then its model and inner optimizer as its sites
    described them (a script's own: never the job file's optimizer settings)."""
    ran = next((s["ran"] for s in summary["sites"].values() if s.get("ran")), {})
    trained = {"model": summary.get("model"), "inner optimizer": optimizer_text(ran)}
    return {**summary["settings"], **{k: v for k, v in trained.items() if v is not None}}


def _plot(
    out: Path,
    summaries: dict[str, dict[str, Any]],
    evals: dict[str, list[dict[str, Any]]],
    curves: dict[str, list[tuple[float, float]]],
) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (by_tokens, by_time, bars) = plt.subplots(1, 3, figsize=(16, 4.2))
    for strategy in summaries:
        points = evals[strategy]
        by_tokens.plot(
            [r["tokens"] for r in points], [r["eval_loss"] for r in points], "o-", label=strategy
        )
        if curves.get(strategy):
            seconds, losses = zip(*curves[strategy], strict=True)
            by_time.plot(seconds, losses, "o-", label=strategy)
    by_tokens.set_xlabel(f"tokens per site ({next(iter(summaries.values()))['job']})")
    by_time.set_xlabel("wall time since the run started (s)")
    for axes in (by_tokens, by_time):
        axes.set_ylabel("held-out loss")
        axes.grid(alpha=0.3)
        axes.legend()
    target = min((loss for _, loss in curves.get("sync", [])), default=None)
    if target is not None:
        by_time.axhline(target, color="grey", linestyle=":", linewidth=1)
    names = list(summaries)
    bars.bar(names, [summaries[s]["wan_bytes"] / 1e6 for s in names], color="#1e88e5")
    bars.set_yscale("log")
    bars.set_ylabel("WAN bytes (MB, log scale)")
    for i, s in enumerate(names):
        bars.text(
            i,
            summaries[s]["wan_bytes"] / 1e6,
            f"{summaries[s]['wan_bytes'] / 1e6:.1f}",
            ha="center",
            va="bottom",
            fontsize=8,
        )
    fig.tight_layout()
    fig.savefig(out / "compare.png", dpi=110)
    plt.close(fig)
    return "compare.png"
