"""``isthmus run --compare``: one job, one run per strategy, one report that compares them."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from isthmus.deploy.run.records import read_records, write_json_atomic


def comparison_rows(summaries: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    for strategy, summary in summaries.items():
        losses = [s["eval_loss"] for s in summary["sites"].values() if s["eval_loss"] is not None]
        rows.append(
            {
                "strategy": strategy,
                "status": summary["status"],
                "eval_loss": statistics.fmean(losses) if losses else None,
                "wan_bytes": summary["wan_bytes"],
                "compute_utilization": summary["compute_utilization"],
                "wall_seconds": summary["wall_seconds"],
                "identical_sites": len({s["param_sha256"] for s in summary["sites"].values()}) == 1
                and all(s["param_sha256"] for s in summary["sites"].values()),
            }
        )
    return rows


def write_comparison(out: Path, summaries: dict[str, dict[str, Any]]) -> Path:
    """``compare.json``, ``compare.md`` and ``compare.png`` in ``out``; returns the report."""
    rows = comparison_rows(summaries)
    write_json_atomic(out / "compare.json", rows)
    image = _plot(out, summaries)
    first = next(iter(summaries.values()))
    lines = [
        f"# `{first['job']}`: which strategy on these links?",
        "",
        "| strategy | held-out loss | WAN bytes | compute utilisation | wall s | status |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for row in rows:
        loss = f"{row['eval_loss']:.3f}" if row["eval_loss"] is not None else "-"
        lines.append(
            f"| {row['strategy']} | {loss} | {row['wan_bytes'] / 1e6:.1f} MB | "
            f"{row['compute_utilization']:.0%} | {row['wall_seconds']:.0f} | {row['status']} |"
        )
    settings = {k: v for k, v in first["settings"].items() if k != "strategy"}
    lines += [
        "",
        "Same job, data and tokens for every strategy; each run's own report is in its "
        "sub-directory (`STRATEGY/report.md`).",
        "",
        f"![held-out loss and WAN bytes]({image})",
        "",
        "Settings: " + ", ".join(f"{k}={v}" for k, v in settings.items()),
    ]
    report = out / "compare.md"
    report.write_text("\n".join(lines) + "\n")
    return report


def _plot(out: Path, summaries: dict[str, dict[str, Any]]) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (curves, bars) = plt.subplots(1, 2, figsize=(12, 4.2))
    for strategy in summaries:
        records = read_records(out / strategy / "metrics.jsonl")
        first_site = next((r["site"] for r in records if r.get("site")), None)
        evals = [
            r
            for r in records
            if r["kind"] == "eval" and r["site"] == first_site and r["eval_loss"] is not None
        ]
        curves.plot(
            [r["tokens"] for r in evals], [r["eval_loss"] for r in evals], "o-", label=strategy
        )
    curves.set_xlabel(f"tokens per site ({next(iter(summaries.values()))['job']})")
    curves.set_ylabel("held-out loss")
    curves.grid(alpha=0.3)
    curves.legend()
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
