"""The report a person reads after a run: ``report.md`` with plots, from the run's files.

Everything comes from ``metrics.jsonl`` and ``summary.json``, so a report can
be made again (``isthmus report RUN_DIR``) from any run directory, including
one whose run failed or was interrupted.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Any

from isthmus.deploy.launch.progress import busiest
from isthmus.deploy.launch.summary import compute_utilization, optimizer_text
from isthmus.training.records import read_records

COLOURS = {"computing": "#4caf50", "waiting": "#ffb300", "syncing": "#1e88e5"}


def write_report(run_dir: Path) -> Path:
    """Write ``plots/*.png`` and ``report.md``; return the report's path."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display, and no GUI toolkit needed
    summary = json.loads((run_dir / "summary.json").read_text())
    records = read_records(run_dir / "metrics.jsonl")
    started = min((r["t"] for r in records), default=0.0)
    plots = run_dir / "plots"
    plots.mkdir(exist_ok=True)
    by_site: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for record in records:
        if record.get("site"):
            by_site[record["site"]].append(record)
    images = [
        ("Loss", _plot_loss(by_site, started, plots / "loss.png")),
        (
            "WAN traffic",
            _plot_wan(by_site, records, list(summary["sites"]), started, plots / "wan.png"),
        ),
        ("Where the time went", _plot_timeline(by_site, summary, started, plots / "timeline.png")),
    ]
    report = run_dir / "report.md"
    report.write_text(_markdown(summary, images) + _membership(records))
    return report


def _membership(records: list[dict[str, Any]]) -> str:
    """The membership views and state transfers of a run that lost or regained
    sites, as the first site that entered each view recorded it."""
    views: dict[int, dict[str, Any]] = {}
    for r in records:
        if r["kind"] == "view":
            views.setdefault(r["epoch"], r)
    pulls = [r for r in records if r["kind"] in ("catch_up", "rejoin")]
    if not views and not pulls:
        return ""
    started = min(r["t"] for r in records)
    lines = ["", "## Membership", "", "| view | at | from round | members | why |"]
    lines.append("| --- | --- | --- | --- | --- |")
    for epoch, r in sorted(views.items()):
        lines.append(
            f"| {epoch} | {r['t'] - started:.1f} s | {r['start_round']} | "
            f"{', '.join(r['members'])} | {r['reason']} |"
        )
    if pulls:
        lines += ["", "| site | pulled the state after round | from | MB | seconds |"]
        lines.append("| --- | --- | --- | --- | --- |")
        lines += [
            f"| {r['site']} | {r['round']} | {r['donor']} | {r['bytes'] / 1e6:.2f} | "
            f"{r['seconds']:.2f} |"
            for r in pulls
        ]
    return "\n".join(lines) + "\n"


def _plot_loss(by_site: dict[str, list[dict[str, Any]]], started: float, path: Path) -> str:
    import matplotlib.pyplot as plt

    fig, (by_tokens, by_time) = plt.subplots(1, 2, figsize=(12, 4.2), sharey=True)
    # Sites step together, so the job's tokens at step s are s times every site's
    # tokens per step: one x axis for all sites, whatever their sizes.
    per_step = sum(_tokens_per_step(records) for records in by_site.values())
    for site, records in by_site.items():
        steps = [r for r in records if r["kind"] == "step" and r["loss"] is not None]
        evals = [r for r in records if r["kind"] == "eval" and r["eval_loss"] is not None]
        smooth = _ema([r["loss"] for r in steps])
        (line,) = by_tokens.plot(
            [r["step"] * per_step for r in steps], smooth, label=f"{site} train"
        )
        by_time.plot([r["t"] - started for r in steps], smooth, color=line.get_color())
        line_style = {"color": line.get_color(), "markersize": 4}
        by_tokens.plot(
            [r["step"] * per_step for r in evals],
            [r["eval_loss"] for r in evals],
            "o--",
            label=f"{site} held-out",
            **line_style,
        )
        by_time.plot(
            [r["t"] - started for r in evals], [r["eval_loss"] for r in evals], "o--", **line_style
        )
    by_tokens.set_xlabel("tokens, all sites")
    by_time.set_xlabel("wall time (s)")
    by_tokens.set_ylabel("loss (train: moving average)")
    if by_tokens.get_legend_handles_labels()[0]:  # a run that failed at once has none
        by_tokens.legend(fontsize=8)
    for axes in (by_tokens, by_time):
        axes.grid(alpha=0.3)
    return _save(fig, path)


def _plot_wan(
    by_site: dict[str, list[dict[str, Any]]],
    records: list[dict[str, Any]],
    order: list[str],
    started: float,
    path: Path,
) -> str:
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(figsize=(8, 4))
    # Isthmus's own count, both directions of each link: every site's cumulative
    # bytes to each peer, summed per pair as the round records arrive.
    latest: dict[tuple[str, str], int] = {}
    series: dict[str, list[tuple[float, float]]] = defaultdict(list)
    rounds = sorted(
        (r for site_records in by_site.values() for r in site_records if r["kind"] == "round"),
        key=lambda r: r["t"],
    )
    for record in rounds:
        for peer, count in record["wan_bytes_sent_to"].items():
            latest[(record["site"], peer)] = count
            key = "<->".join(sorted((record["site"], peer), key=order.index))  # the job's order
            both = latest.get((record["site"], peer), 0) + latest.get((peer, record["site"]), 0)
            series[key].append((record["t"] - started, both / 1e6))
    links = [r for r in records if r["kind"] == "link"]
    # Many sites have many links (16: 120): the busiest, named, are what a reader
    # can tell apart (by Isthmus's count, or the wire's where no round completed).
    finals = {k: points[-1][1] for k, points in series.items()}
    for record in links:
        for key, count in record["links"].items():
            if key not in series:
                finals[key] = count / 1e6
    shown, more, _ = busiest(finals)
    colours: dict[str, str] = {}
    for key in sorted(k for k in shown if k in series):
        (line,) = axes.step(*zip(*series[key], strict=True), where="post", label=f"{key} (Isthmus)")
        colours[key] = line.get_color()
    for key in sorted({k for r in links for k in r["links"]} & set(shown)):
        xs = [r["t"] - started for r in links if key in r["links"]]
        ys = [r["links"][key] / 1e6 for r in links if key in r["links"]]
        axes.plot(xs, ys, ":", color=colours.get(key), label=f"{key} (emulator's wire)")
    axes.set_xlabel("wall time (s)")
    axes.set_ylabel("MB over the link, both ways (cumulative)")
    if more:
        axes.set_title(f"the {len(shown)} busiest of {len(shown) + more} links", fontsize=9)
    axes.grid(alpha=0.3)
    if shown:
        axes.legend(fontsize=7)
    return _save(fig, path)


def _plot_timeline(
    by_site: dict[str, list[dict[str, Any]]], summary: dict[str, Any], started: float, path: Path
) -> str:
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    names = list(by_site)
    fig, axes = plt.subplots(figsize=(12, 0.8 + 0.6 * len(names)))
    for row, site in enumerate(names):
        records = by_site[site]
        steps = [r for r in records if r["kind"] == "step"]
        if not steps:
            continue
        first = steps[0]["t"] - started - steps[0]["compute_s"]
        last = max(r["t"] for r in records) - started
        axes.broken_barh([(first, last - first)], (row - 0.35, 0.7), color=COLOURS["computing"])
        for kind in ("waiting", "syncing"):
            spans = [
                (r["started"] - started, r["seconds"])
                for r in records
                if r["kind"] == "blocked" and r["what"] == kind
            ]
            axes.broken_barh(spans, (row - 0.35, 0.7), color=COLOURS[kind])
        share = compute_utilization(summary["sites"].get(site, {}))
        if share is not None:
            axes.text(last, row, f"  {share:.0%} computing", va="center", fontsize=8)
    axes.set_yticks(range(len(names)), names)
    axes.set_xlabel("wall time (s)")
    axes.legend(
        handles=[Patch(color=c, label=k) for k, c in COLOURS.items()],
        loc="upper left",
        fontsize=8,
        ncols=3,
    )
    axes.margins(x=0.12)
    return _save(fig, path)


def _save(fig: Any, path: Path) -> str:
    """Write the figure and return its path relative to the report."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return f"plots/{path.name}"


def _tokens_per_step(records: list[dict[str, Any]]) -> int:
    steps = [r for r in records if r["kind"] == "step"]
    return steps[-1]["tokens"] // steps[-1]["step"] if steps else 0


def _ema(values: list[float], weight: float = 0.9) -> list[float]:
    out, level = [], None
    for v in values:
        level = v if level is None else weight * level + (1 - weight) * v
        out.append(level)
    return out


def _fmt(value: Any, spec: str = ".3f") -> str:
    return "-" if value is None else format(value, spec)


def _markdown(summary: dict[str, Any], images: list[tuple[str, str]]) -> str:
    lines = [
        f"# Run of `{summary['job']}`: {summary['strategy']}, {summary['status']}",
        "",
        f"{len(summary['sites'])} sites, {summary['wall_seconds']:.1f} s wall, compute "
        f"utilisation {summary['compute_utilization']:.1%}, {summary['wan_bytes'] / 1e6:.2f} MB "
        "over the WAN (counted by Isthmus)"
        + (
            f", {summary['emulator_wire_bytes'] / 1e6:.2f} MB on the emulated wire."
            if "emulator_wire_bytes" in summary
            else "."
        ),
        "",
        "| site | status | steps | outer steps | tokens | final loss | held-out loss | "
        "computing | wall s | parameters (SHA-256) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, site in summary["sites"].items():
        share = compute_utilization(site) or 0.0
        digest = site["param_sha256"][:16] + "…" if site["param_sha256"] else "-"
        lines.append(
            f"| {name} | {site['status']} | {site['inner_steps']} | {site['outer_steps']} | "
            f"{site['tokens']:,} | {_fmt(site['final_loss'])} | {_fmt(site['eval_loss'])} | "
            f"{share:.0%} | {site['wall_seconds']:.1f} | `{digest}` |"
        )
    failed = {n: s["reason"] for n, s in summary["sites"].items() if s.get("reason")}
    if failed:
        lines += ["", "Sites that did not finish:", ""]
        lines += [f"- **{name}**: {reason}" for name, reason in failed.items()]
    lines += ["", "| link | WAN bytes (Isthmus) | wire bytes (emulator) |", "| --- | --- | --- |"]
    wire = summary.get("emulator_wire_bytes_by_link", {})
    for key, count in summary["wan_bytes_by_link"].items():
        emulated = f"{wire[key] / 1e6:.2f} MB" if key in wire else "-"
        lines.append(f"| {key} | {count / 1e6:.2f} MB | {emulated} |")
    for title, image in images:
        lines += ["", f"## {title}", "", f"![{title}]({image})"]
    lines += _what_trained(summary)
    lines += ["", "## Settings that applied", "", "| setting | value |", "| --- | --- |"]
    lines += [f"| {k} | {v} |" for k, v in summary["settings"].items()]
    changes = summary.get("live_changes") or []
    if changes:
        lines += ["", "Changed live (`isthmus config set`, or the online tuner):", ""]
        lines += [
            f"- from round {c['round']} (step {c['step']}): "
            + ", ".join(f"{k}={v}" for k, v in c["settings"].items())
            + f" ({', '.join(c['sites'])})"
            for c in changes
        ]
    lines += ["", "The resolved job file is `job.yaml`; per-rank logs are in `logs/`."]
    return "\n".join(lines) + "\n"


def _what_trained(summary: dict[str, Any]) -> list[str]:
    """The model, data and inner optimizer: the built-in loop's, or the script's as its
    sites described them (their optimizer and settings, parameters, tokens)."""
    command = summary.get("command")
    lines = ["", "## What trained", ""]
    if command:
        lines.append(f"The script `{' '.join(command)}`, its own model, data and optimizer:")
    else:
        lines.append("The built-in loop:")
    lines += ["", f"- model: {summary['model']}", f"- data: {summary['data']}"]
    described = {n: s["ran"] for n, s in summary["sites"].items() if s.get("ran")}
    texts = {n: optimizer_text(r) for n, r in described.items()}
    if len(set(texts.values())) == 1:
        lines.append(f"- inner optimizer: {next(iter(texts.values()))}")
    else:
        lines += [f"- inner optimizer at {n}: {t}" for n, t in texts.items()]
    counts = {r.get("parameters") for r in described.values()} - {None}
    if len(counts) == 1:
        lines.append(f"- parameters: {counts.pop():,}")
    for name, ran in described.items():
        if ran.get("tokens_counted_from") == "train.batch_size":
            lines.append(
                f"- tokens at {name}: counted as train.batch_size a step (the script "
                "passes no tokens_per_step and logs no tokens)"
            )
    own = {k for r in described.values() for k in r} - {
        "model", "data", "optimizer", "parameters", "tokens_per_step", "tokens_per_step_from",
        "tokens_counted_from", "loss_logged",
    }  # fmt: skip
    first = next(iter(described.values()), {})
    lines += [f"- {k}: {first[k]}" for k in sorted(own) if k in first]
    return lines
