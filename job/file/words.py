"""How the job file's messages word things: field paths, what a value is, suggestions."""

from __future__ import annotations

import difflib
from typing import Any


def join_path(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def kind(value: Any) -> str:
    if value is None:
        return "nothing"
    return {dict: "a mapping", list: "a list", str: f"the text {value!r}"}.get(
        type(value), f"{value!r}"
    )


def suggest(word: str, choices: list[str] | tuple[str, ...]) -> str:
    close = difflib.get_close_matches(word, list(choices), n=1)
    return f"did you mean {close[0]!r}? " if close else ""


def unknown(key: str, allowed: tuple[str, ...]) -> str:
    return f"unknown key; {suggest(key, allowed)}allowed here: {', '.join(allowed)}"


def bad_name(value: Any) -> str:
    return (
        f"must be 1-63 letters, digits, '-', '_' or '.', starting with a letter or digit "
        f"(it names topics and files), got {value!r}"
    )


# The job's dataclasses are the job model's (isthmus.job.model) and ports are picked
# by isthmus.job.ports; the names stay importable from here.
