"""Live progress of ``isthmus run``: a table in a terminal, log lines elsewhere."""

from __future__ import annotations

import sys
import time
from typing import IO, Any

from isthmus.deploy.launch.run_state import RunState

PLAIN_EVERY_S = 5.0


def _eta(state: RunState) -> str:
    """Seconds left at the slowest site's recent pace."""
    remaining = []
    for site in state.sites.values():
        if site.step and site.started and site.last_step_t:
            pace = (site.last_step_t - site.started) / site.step
            remaining.append((state.steps - site.step) * pace)
    if not remaining:
        return "--"
    left = max(remaining)
    return f"{int(left // 60)}m{int(left % 60):02d}s"


def _mb(value: float) -> str:
    return f"{value / 1e6:.1f} MB"


LINKS_SHOWN = 6
"""Links listed by name; with more sites (16 have 120 links) the busiest are, and
the rest in one line."""


def busiest(counts: dict[str, float]) -> tuple[list[str], int, float]:
    """The ``LINKS_SHOWN`` links with the most bytes (in the job's order when all are
    shown), how many more there are, and their bytes."""
    if len(counts) <= LINKS_SHOWN:
        return list(counts), 0, 0.0
    ranked = sorted(counts, key=lambda k: -counts[k])
    rest = ranked[LINKS_SHOWN:]
    return ranked[:LINKS_SHOWN], len(rest), sum(counts[k] for k in rest)


class PlainProgress:
    """A line per site every few seconds, and one when a site's status settles."""

    def __init__(self, out: IO[str] | None = None, every_s: float = PLAIN_EVERY_S) -> None:
        self.out = out or sys.stdout
        self.every_s = every_s
        self._last = 0.0
        self._settled: set[str] = set()

    def __enter__(self) -> PlainProgress:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def update(self, state: RunState) -> None:
        now = time.monotonic()
        for site in state.sites.values():
            if site.status in ("finished", "failed", "lost") and site.name not in self._settled:
                self._settled.add(site.name)
                # Why a site failed is printed once, at the end of the run.
                print(f"site {site.name} {site.status}", file=self.out, flush=True)
        if now - self._last < self.every_s and state.status == "running":
            return
        self._last = now
        elapsed = time.time() - state.started
        if state.status == "running":
            print(f"[{elapsed:6.1f}s] ETA {_eta(state)}", file=self.out, flush=True)
        for site in state.sites.values():
            loss = f"{site.loss:.3f}" if site.loss is not None else "-"
            print(
                f"[{elapsed:6.1f}s] {site.name}: step {site.step}/{state.steps} loss {loss} "
                f"{site.tokens_per_s:,.0f} tok/s outer {site.outer_steps} {site.status}",
                file=self.out,
                flush=True,
            )
        shown, more, rest = busiest({k: link["bytes"] for k, link in state.links.items()})
        for key in shown:
            link = state.links[key]
            print(
                f"[{elapsed:6.1f}s] link {key}: {_mb(link['bytes'])} {link['mbit_s']:.1f} Mbit/s",
                file=self.out,
                flush=True,
            )
        if more:
            print(f"[{elapsed:6.1f}s] {more} more links: {_mb(rest)}", file=self.out, flush=True)


class LiveProgress:
    """A table redrawn in place (rich): sites, links, ETA."""

    def __init__(self) -> None:
        from rich.console import Console
        from rich.live import Live

        self.console = Console()
        self._live = Live(console=self.console, refresh_per_second=4, transient=False)

    def __enter__(self) -> LiveProgress:
        self._live.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._live.__exit__(*exc)

    def update(self, state: RunState) -> None:
        self._live.update(self.render(state))

    def render(self, state: RunState) -> Any:
        from rich.console import Group
        from rich.progress_bar import ProgressBar
        from rich.table import Table

        sites = Table(
            title=f"{state.job.name}: {state.job.train.strategy}, "
            f"{time.time() - state.started:.0f} s, ETA {_eta(state)}",
            title_justify="left",
        )
        # A progress bar only where there is room for every figure beside it.
        bar = self.console.width >= 100
        columns = ["site", *(["progress"] if bar else []), "step", "loss", "eval", "tok/s"]
        columns += ["outer", "WAN MB", "state"]
        for column in columns:
            # Which site and its state are what a person looks for: never cut short.
            widths = {"site": max(len(n) for n in state.sites), "state": 9}
            sites.add_column(
                column,
                justify="left" if column in ("site", "state") else "right",
                min_width=widths.get(column),
                no_wrap=column in widths,
            )
        colours = {"computing": "green", "syncing": "cyan", "waiting": "yellow", "finished": "bold"}
        for site in state.sites.values():
            colour = colours.get(site.status, "red" if site.status in ("failed", "lost") else "")
            progress = (
                [ProgressBar(total=state.steps, completed=site.step, width=16)] if bar else []
            )
            sites.add_row(
                site.name,
                *progress,
                f"{site.step}/{state.steps}",
                f"{site.loss:.3f}" if site.loss is not None else "-",
                f"{site.eval_loss:.3f}" if site.eval_loss is not None else "-",
                f"{site.tokens_per_s:,.0f}",
                str(site.outer_steps),
                f"{site.wan_bytes_sent / 1e6:.1f}",
                f"[{colour}]{site.status}[/]" if colour else site.status,
            )
        parts: list[Any] = [sites]
        links = Table(title="links", title_justify="left")
        links.add_column("link")
        links.add_column("sent (Isthmus)", justify="right")
        if state.links:
            links.add_column("wire (emulator)", justify="right")
            links.add_column("now", justify="right")
        counts = state.isthmus_link_bytes()
        shown, more, rest = busiest(counts)
        for key in shown:
            wire = state.links.get(key)
            emulated = [_mb(wire["bytes"]), f"{wire['mbit_s']:.1f} Mbit/s"] if wire else []
            links.add_row(key, _mb(counts[key]), *emulated)
        if more:
            links.add_row(f"{more} more links", _mb(rest))
        parts.append(links)
        return Group(*parts)


def progress_for(out: IO[str]) -> PlainProgress | LiveProgress:
    """The live table when ``out`` is a terminal, plain lines otherwise."""
    return LiveProgress() if out.isatty() else PlainProgress(out)
