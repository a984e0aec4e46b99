"""``summary.json``: a run's figures, a contract for tooling (documented in docs/run.md)."""

from __future__ import annotations

import json
import statistics
import time
from itertools import combinations
from pathlib import Path
from typing import Any

from isthmus.deploy.launch.run_state import RunState
from isthmus.job.exposure import insecure_warning
from isthmus.job.settings import applied_settings

SITE_FIELDS = (
    "status",
    "final_loss",
    "eval_loss",
    "tokens",
    "inner_steps",
    "outer_steps",
    "compute_seconds",
    "wall_seconds",
    "eval_seconds",
    "all_reduce_rounds",
    "param_sha256",
)


def build_summary(state: RunState, *, ended: float | None = None) -> dict[str, Any]:
    ended = ended if ended is not None else time.time()
    sites: dict[str, dict[str, Any]] = {}
    sent_to: dict[str, dict[str, int]] = {}
    for name, site in state.sites.items():
        result = _read_result(state.run_dir / "sites" / name / "result.json")
        if site.status in ("finished", "left") and result is not None:
            entry = {key: result.get(key) for key in SITE_FIELDS}
            if "late_contributions_applied" in result:  # async only
                entry["late_contributions_applied"] = result["late_contributions_applied"]
            sent_to[name] = result.get("wan_bytes_sent_to", {})
        else:  # what its records said last
            entry = {
                "status": site.status if site.status in ("failed", "lost") else "lost",
                "final_loss": site.loss,
                "eval_loss": site.eval_loss,
                "tokens": site.tokens,
                "inner_steps": site.step,
                "outer_steps": site.outer_steps,
                "compute_seconds": site.compute_s,
                "wall_seconds": ended - site.started if site.started else 0.0,
                "eval_seconds": site.eval_s,
                "all_reduce_rounds": None,
                "param_sha256": None,
            }
            sent_to[name] = site.wan_bytes_sent_to
        if site.reason:
            entry["reason"] = site.reason
        # When it ended, from the run's start (the launcher's view), and how often it
        # was started again (--restart-lost).
        entry["ended_s"] = site.ended - state.started if site.ended is not None else None
        entry["restarts"] = site.restarts
        if site.ran:
            parameters = (result or {}).get("parameters")
            entry["ran"] = {**site.ran, **({"parameters": parameters} if parameters else {})}
        sites[name] = entry
    by_link = {
        f"{a}<->{b}": sent_to[a].get(b, 0) + sent_to[b].get(a, 0)
        for a, b in combinations([s.name for s in state.job.sites], 2)
    }
    utilisation = [u for s in sites.values() if (u := compute_utilization(s)) is not None]
    summary: dict[str, Any] = {
        "job": state.job.name,
        "strategy": state.job.train.strategy,
        "command": state.command,
        "status": state.status,
        "started": state.started,
        "wall_seconds": ended - state.started,
        "compute_utilization": statistics.fmean(utilisation) if utilisation else 0.0,
        "wan_bytes": sum(by_link.values()),
        "wan_bytes_by_link": by_link,
    }
    if state.links:
        summary["emulator_wire_bytes"] = int(sum(v["bytes"] for v in state.links.values()))
        summary["emulator_wire_bytes_by_link"] = {
            k: int(v["bytes"]) for k, v in state.links.items()
        }
    # Only what applied: the strategy's settings and its loop's; the built-in loop's
    # optimizer, schedule and batches only where it ran (a script trains with its own).
    builtin = state.command is None
    summary["settings"] = applied_settings(state.job.train, builtin_loop=builtin)
    changes = live_changes(state)
    summary["live_changes"] = changes
    summary["final_settings"] = {
        **summary["settings"],
        **{k: v for c in changes for k, v in c["settings"].items() if k in summary["settings"]},
    }
    # Said at every start, kept with the results: this run crossed networks in plaintext.
    summary["insecure"] = insecure_warning(state.job) is not None
    if state.job.tune.online:
        summary["sync_every_changes"] = state.sync_every_changes
    ran = next((s.ran for s in state.sites.values() if s.ran), {})
    summary["model"] = ran.get("model", state.job.model if builtin else None)
    summary["data"] = ran.get("data", state.job.data if builtin else "the script's own")
    summary["sites"] = sites
    return summary


def live_changes(state: RunState) -> list[dict[str, Any]]:
    """The live settings the run applied, in order of round: every site applies a change
    at the same round, so each is listed once, with the sites that applied it."""
    merged: dict[tuple[int, str], dict[str, Any]] = {}
    for name, site in state.sites.items():
        for change in site.live_changes:
            key = (change["round"], json.dumps(change["settings"], sort_keys=True))
            entry = merged.setdefault(key, {**change, "sites": []})
            entry["sites"].append(name)
    return [merged[k] for k in sorted(merged, key=lambda k: k[0])]


def optimizer_text(ran: dict[str, Any]) -> str | None:
    """A site's inner optimizer as a report names it: ``SGD (lr=0.05, momentum=0.9)``."""
    optimizer = ran.get("optimizer")
    if not optimizer:
        return None
    shown = ("lr", "momentum", "betas", "weight_decay", "eps", "nesterov")
    settings = optimizer.get("settings", {})
    figures = ", ".join(f"{k}={settings[k]}" for k in shown if k in settings)
    return f"{optimizer['name']} ({figures})" if figures else optimizer["name"]


def _read_result(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def compute_utilization(site: dict[str, Any]) -> float | None:
    """A site's compute utilisation, the one definition (docs/run.md; the performance
    model predicts the same): its compute seconds over its training wall time, which
    runs from its first step to the end of its final synchronisation, less the
    held-out evaluations in it (neither training nor waiting for the network)."""
    training = (site.get("wall_seconds") or 0.0) - (site.get("eval_seconds") or 0.0)
    if training <= 0:
        return None
    return (site.get("compute_seconds") or 0.0) / training


def training_figures(run_dir: Path, summary: dict[str, Any]) -> dict[str, dict[str, float]]:
    """Per site: wall seconds per inner step and compute utilisation, held-out
    evaluations left out (what the performance model predicts)."""
    from isthmus.training.records import read_records

    records = None
    figures = {}
    for name, site in summary["sites"].items():
        if not site.get("inner_steps") or not site.get("wall_seconds"):
            continue
        if site.get("eval_seconds") is None:  # a summary from before eval_seconds
            if records is None:
                records = read_records(run_dir / "metrics.jsonl")
            site = site | {
                "eval_seconds": sum(
                    r.get("seconds") or 0.0
                    for r in records
                    if r.get("site") == name and r.get("kind") == "eval"
                )
            }
        wall = site["wall_seconds"] - site["eval_seconds"]
        figures[name] = {
            "step_s": wall / site["inner_steps"],
            "utilization": compute_utilization(site) or 0.0,
        }
    return figures
