"""``isthmus tune``'s output: the table (printed and in tune.md), tune.json and tune.png."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any


def table_rows(result: dict[str, Any]) -> list[list[str]]:
    """One row per trial (or per model candidate when there were no trials)."""
    rows = []
    for row in result["rows"]:
        marks = []
        if row["label"] == result["choice"]["label"]:
            marks.append("choice")
        if row["label"] == result["model_pick"]["label"]:
            marks.append("model")
        measured = row.get("measured_utilization")
        loss = row.get("eval_loss")
        rows.append(
            [
                row["label"],
                f"{row['predicted_utilization']:.0%}",
                f"{measured:.0%}" if measured is not None else "-",
                f"{row['wan_bytes_per_token']:,.0f}",
                _money(row["egress_cost"]),
                f"{loss:.3f}" if loss is not None else "-",
                ", ".join(marks),
            ]
        )
    return rows


def columns(price_per_gb: float, job_tokens: float) -> list[str]:
    return [
        "setting",
        "predicted util.",
        "measured util.",
        "WAN B/token",
        f"egress $ ({job_tokens / 1e6:,.1f}M tokens @ {price_per_gb:g}/GB)",
        "held-out loss",
        "",
    ]


def markdown(result: dict[str, Any]) -> str:
    head = columns(result["price_per_gb"], result["job_tokens"])
    lines = [
        f"# isthmus tune: {result['job']}",
        "",
        _summary_line(result),
        "",
        "| " + " | ".join(h or "pick" for h in head) + " |",
        "|" + " --- |" * len(head),
    ]
    lines += ["| " + " | ".join(r) + " |" for r in table_rows(result)]
    lines += ["", "![utilisation and loss by setting](tune.png)", ""]
    lines += [f"- {note}" for note in result["notes"]]
    return "\n".join(lines) + "\n"


def _summary_line(result: dict[str, Any]) -> str:
    choice = result["choice"]
    keys = ", ".join(f"{k}: {v}" for k, v in choice["settings"].items())
    source = result["step_source"]
    named = result.get("calibrated", "")
    if named and not named.startswith("calibrated"):  # --step-ms: say whose parameters
        source += f"; {named}"
    return (
        f"Choice: **{choice['label']}** (`train: {{{keys}}}`), {result['strategy']}, target "
        f"utilisation {result['target_utilization']:.0%}; compute "
        f"{result['step_s'] * 1e3:.1f} ms per inner step ({source})."
    )


def print_table(result: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"isthmus tune {result['job']}", title_justify="left")
    for name in columns(result["price_per_gb"], result["job_tokens"]):
        table.add_column(name, justify="left" if name in ("setting", "") else "right")
    for row in table_rows(result):
        table.add_row(*row)
    console = Console(width=max(Console().width, 110))
    console.print(table)
    console.print(_summary_line(result).replace("**", ""))
    for note in result["notes"]:
        console.print(f"note: {note}")


def plot(result: dict[str, Any], path: Path) -> Path:
    """Predicted utilisation against H for each codec (the model's sweep), the trials'
    measured utilisation on it, the target, and the trials' held-out loss."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    curves: dict[str, list[tuple[int, float]]] = {}
    for c in result["sweep"]:
        if c["fragments"] == result["model_pick"]["fragments"]:
            curves.setdefault(c["codec"], []).append((c["sync_every"], c["utilization"]))
    colours = {}
    for codec, points in curves.items():
        points.sort()
        (line,) = left.plot(*zip(*points, strict=True), marker=".", label=f"{codec} (model)")
        colours[codec] = line.get_color()
    trials = [r for r in result["rows"] if r.get("measured_utilization") is not None]
    for row in trials:
        codec = row["settings"]["codec"]
        h = row["settings"].get("sync_every", 1)
        colour = colours.get(codec, "k")
        left.scatter([h], [row["measured_utilization"]], s=70, facecolors="none", edgecolors=colour)
    left.axhline(result["target_utilization"], color="grey", linestyle="--", label="target")
    left.set_xscale("log")
    left.set_xlabel("sync_every (H)")
    left.set_ylabel("compute utilisation")
    left.set_ylim(0, 1.02)
    left.set_title("utilisation: model (lines), trials (circles)")
    left.legend(fontsize=8, loc="lower right")
    with_loss = [r for r in trials if r.get("eval_loss") is not None]
    if with_loss:
        labels = [r["label"] for r in with_loss]
        values = [r["eval_loss"] for r in with_loss]
        bars = right.bar(range(len(values)), values, color="#8aa")
        for bar, row in zip(bars, with_loss, strict=True):
            if row["label"] == result["choice"]["label"]:
                bar.set_color("#c63")
        right.set_xticks(range(len(values)), labels, rotation=20, fontsize=8)
        low = min(values)
        right.set_ylim(low - 0.1 * abs(low) if math.isfinite(low) else 0, max(values) * 1.02)
        right.set_ylabel("held-out loss after the trial")
        right.set_title(f"trials ({trials[0]['steps']} steps each); choice in orange")
    else:
        right.axis("off")
        right.text(0.5, 0.5, "no trials run", ha="center", va="center")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _money(value: float) -> str:
    return f"{value:,.2f}" if value >= 1 else f"{value:.2g}"
