"""Edit a user's job file in place, changing nothing but the values set.
``isthmus tune --apply`` writes its choice this way.

A load/dump round trip (pyyaml, and even ruamel.yaml for long flow mappings)
rewrites lines the edit never meant to touch. Instead, ruamel.yaml's parser
says where each ``train:`` value is, and the edit replaces exactly that text,
or adds a key next to its siblings in the section's own style (block or
flow). The result is parsed again: every key must read back as set, and the
file must be a valid job, before it replaces the original atomically.
"""

from __future__ import annotations

import os
import re
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml as pyyaml

from isthmus.job.file import load_yaml, parse_job

PLAIN_SCALAR = re.compile(r"[^\s,\]}#]+(?: +[^\s,\]}#]+)*")
"""A plain scalar's text in a flow or block context (no comment, no separator)."""


class JobEditError(ValueError):
    """The job file cannot be edited as asked; the file is unchanged."""


def set_train_keys(path: Path, settings: dict[str, Any]) -> str:
    """Set ``train:`` keys in the job file at ``path``; returns the new text."""
    text = path.read_text()
    new_text = edit_train_keys(text, settings)
    parse_job(new_text, source=str(path))  # raises JobFileError: the original stays
    _replace(path, new_text)
    return new_text


def edit_train_keys(text: str, settings: dict[str, Any]) -> str:
    for key, value in settings.items():
        text = _set_one(text, key, _scalar(value))
        train = (load_yaml(text) or {}).get("train") or {}
        if train.get(key) != value:
            raise JobEditError(f"train.{key}: could not be set to {value!r} in place")
    return text


def _set_one(text: str, key: str, value: str) -> str:
    from ruamel.yaml import YAML

    data = YAML().load(text)
    lines = text.splitlines(keepends=True)
    if data is None or "train" not in data or data["train"] is None:
        ending = "" if not text or text.endswith("\n") else "\n"
        return f"{text}{ending}train:\n  {key}: {value}\n"
    train = data["train"]
    if not (isinstance(train, Mapping) and hasattr(train, "lc")):
        raise JobEditError("train: must be a mapping of settings")
    if key in train:
        line, column = train.lc.value(key)
        found = PLAIN_SCALAR.match(lines[line], column)
        if found is None:
            raise JobEditError(f"train.{key}: its value is not a plain scalar; edit it by hand")
        lines[line] = lines[line][: found.start()] + value + lines[line][found.end() :]
        return "".join(lines)
    if not train:
        raise JobEditError("train: is empty; give it one key by hand first")
    last = list(train)[-1]
    if train.fa.flow_style():
        line, column = train.lc.value(last)
        offset = sum(len(x) for x in lines[:line]) + column
        end = _flow_end(text, offset)
        return f"{text[:end]}, {key}: {value}{text[end:]}"
    line, column = train.lc.key(last)
    value_line, _ = train.lc.value(last)
    # After the last key's value (a nested block value runs on; train: keys are scalars).
    at = max(line, value_line) + 1
    lines.insert(at, f"{' ' * column}{key}: {value}\n")
    if at > 0 and not lines[at - 1].endswith("\n"):
        lines[at - 1] += "\n"
    return "".join(lines)


def _flow_end(text: str, start: int) -> int:
    """Index of the ``}`` that closes the flow mapping holding position ``start``."""
    depth, quote = 0, ""
    for index in range(start, len(text)):
        char = text[index]
        if quote:
            if char == quote:
                quote = ""
        elif char in "'\"":
            quote = char
        elif char in "{[":
            depth += 1
        elif char in "]}":
            if depth == 0:
                return index
            depth -= 1
        elif char == "#" and text[index - 1] in " \t":
            newline = text.find("\n", index)
            return _flow_end(text, newline) if newline >= 0 else len(text)
    raise JobEditError("train: its flow mapping has no closing '}'")


def _scalar(value: Any) -> str:
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise JobEditError(f"cannot write {value!r} as a train: value")
    text = pyyaml.safe_dump(value, default_flow_style=True).strip()
    return text.removesuffix("\n...").strip()


def _replace(path: Path, text: str) -> None:
    handle, temporary = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(handle, "w") as f:
            f.write(text)
        os.chmod(temporary, path.stat().st_mode & 0o7777)
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
