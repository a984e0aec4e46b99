"""Reading a job file: YAML as people write it, and the line of every field.

:func:`load_job` reads and validates (:mod:`isthmus.job.file.validate`);
:func:`load_yaml` parses a value the same way (``isthmus config set key=value``).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from isthmus.job.file.validate import JobFileError, Validator
from isthmus.job.model import Job


class _Loader(getattr(yaml, "CSafeLoader", yaml.SafeLoader)):  # type: ignore[misc]
    """YAML as people write numbers: PyYAML follows YAML 1.1, which reads ``1e-5``
    (no dot) as a string; YAML 1.2 and everyone else read a float.

    libyaml's parser where PyYAML was built with it (the wheels are): the
    pure-Python one took ~10 ms for a small job file, read by every process of a
    run and by each ``isthmus`` command."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def load_yaml(text: str) -> Any:
    """Parse YAML text (a job file, a ``key=value`` setting) as Isthmus reads it."""
    return yaml.load(text, Loader=_Loader)


def load_job(path: str | Path, *, check_files: bool = True, require_tls: bool = False) -> Job:
    """Read and validate a job file; raise :class:`JobFileError` listing every problem.
    ``check_files=False``: the files it names need not exist yet (``isthmus certs``
    makes the certificates the job file already names). ``require_tls``: also refuse
    a job that would run without TLS across a network (what ``check``, ``site`` and
    ``run`` ask; see :mod:`isthmus.job.exposure`)."""
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise JobFileError(str(path), [("", None, "file not found; check the path")]) from None
    except OSError as exc:
        raise JobFileError(str(path), [("", None, f"cannot read: {exc.strerror}")]) from None
    return parse_job(text, source=str(path), check_files=check_files, require_tls=require_tls)


def parse_job(
    text: str, *, source: str = "<job>", check_files: bool = True, require_tls: bool = False
) -> Job:
    try:
        # Parsed once: the values are constructed from the nodes that hold the lines.
        loader = _Loader(text)
        try:
            node = loader.get_single_node()
            data = loader.construct_document(node) if node is not None else None
        finally:
            loader.dispose()
        lines = _line_map(node)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = mark.line + 1 if mark is not None else None
        problem = getattr(exc, "problem", None) or str(exc)
        raise JobFileError(source, [("", line, f"not valid YAML: {problem}")]) from None
    return Validator(source, lines, check_files, require_tls).job(data)


def _line_map(node: yaml.Node | None, path: str = "") -> dict[str, int]:
    """Map every field path (``sites[1].ranks``) to the 1-based line where it appears."""
    out: dict[str, int] = {}
    if node is None:
        return out
    out[path] = node.start_mark.line + 1
    if isinstance(node, yaml.MappingNode):
        for key, value in node.value:
            child = f"{path}.{key.value}" if path else str(key.value)
            out.update(_line_map(value, child))
            out[child] = key.start_mark.line + 1
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            out.update(_line_map(item, f"{path}[{i}]"))
    return out
