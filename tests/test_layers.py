"""The layers import only downwards (docs/ARCHITECTURE.md, "The layers").

Read from the source with ``ast``, the way ruff or an import-linter contract
would: every module of every package, imports inside functions included (a
lazy import is still a dependency), ``if TYPE_CHECKING:`` ones too. Bottom to
top:

    job            the job model and shared basics: imports no other layer
    intra, sim     one site (torch) / the WAN emulator and performance model
    proto          the wire schema
    inter          across sites: intra, proto, job and sim's cost model only
    deploy         the face and the glue: anything

Nothing outside deploy imports deploy (``isthmus/__init__``'s lazy table names
it in strings, not imports), and no two packages import each other, directly
or round a longer loop.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("job", "intra", "inter", "proto", "sim", "deploy")
"""Each folder is the package isthmus.<folder> (pyproject.toml's package-dir)."""

ALLOWED: dict[str, set[str]] = {
    "job": set(),
    "intra": {"job"},
    "sim": {"job"},
    "proto": set(),
    "inter": {"job", "intra", "proto", "sim.cost"},
}
"""What each library may import of the other packages (a package, or one module
of it); deploy may import all of them and is imported by none."""


def imports(root: Path, package: str) -> Iterator[tuple[str, str]]:
    """(``file:line``, imported module) for every isthmus import in ``package``."""
    folder = root / package
    for path in sorted(folder.rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        module = ".".join(("isthmus", package, *path.relative_to(folder).with_suffix("").parts))
        for node in ast.walk(tree):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from the module's own package upwards
                    parts = module.split(".")
                    if path.name != "__init__.py":
                        parts = parts[:-1]
                    parts = parts[: len(parts) - node.level + 1]
                    base = ".".join([*parts, *([base] if base else [])])
                # ``from isthmus.sim import cost`` imports the module isthmus.sim.cost
                names = [f"{base}.{alias.name}" for alias in node.names] if base else []
                names = names or [base]
            for name in names:
                if name == "isthmus" or name.startswith("isthmus."):
                    yield f"{path.relative_to(root)}:{node.lineno}", name


def layer_of(name: str) -> str | None:
    """The package an ``isthmus.*`` name belongs to (None: the top-level face)."""
    parts = name.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in PACKAGES else None


def violations(root: Path) -> list[str]:
    """Every import that breaks a rule, as ``file:line: imports X (why)``."""
    found = []
    for package in PACKAGES:
        for where, name in imports(root, package):
            target = layer_of(name)
            if target is None or target == package:
                continue
            if target == "deploy":
                found.append(f"{where}: imports {name} (nothing outside deploy imports deploy)")
            elif package in ALLOWED:
                rest = name.split(".", 1)[1]
                allowed = ALLOWED[package]
                if not any(rest == a or rest.startswith(a + ".") for a in allowed):
                    found.append(
                        f"{where}: imports {name} ({package} may import only "
                        f"{', '.join(sorted(allowed)) or 'no other package'})"
                    )
    # The top-level face re-exports by name only; its __main__ runs the command line.
    for path in sorted((root / "isthmus").glob("*.py")):
        if path.name == "__main__.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            module = node.module if isinstance(node, ast.ImportFrom) else None
            if module and module.startswith("isthmus.deploy"):
                found.append(f"isthmus/{path.name}:{node.lineno}: imports {module}")
    return found


def cycles(root: Path) -> list[list[str]]:
    """Loops in the package graph (package A imports B ... imports A)."""
    graph: dict[str, set[str]] = {p: set() for p in PACKAGES}
    for package in PACKAGES:
        for _, name in imports(root, package):
            target = layer_of(name)
            if target is not None and target != package:
                graph[package].add(target)
    loops: list[list[str]] = []

    def visit(node: str, path: list[str]) -> None:
        for nxt in sorted(graph[node]):
            if nxt == path[0]:
                loops.append([*path, nxt])
            elif nxt not in path and nxt > path[0]:  # each loop once, from its least package
                visit(nxt, [*path, nxt])

    for start in sorted(graph):
        visit(start, [start])
    return loops


def test_every_package_imports_only_the_layers_below_it() -> None:
    problems = violations(ROOT)
    assert not problems, "imports against the layers:\n" + "\n".join(problems)


def test_no_package_level_cycles() -> None:
    loops = cycles(ROOT)
    assert not loops, "package cycles: " + "; ".join(" -> ".join(loop) for loop in loops)


def test_the_checks_see_function_level_and_relative_imports(tmp_path: Path) -> None:
    """The rules catch an import hidden in a function, and a relative one."""
    for package in PACKAGES:
        (tmp_path / package).mkdir()
        (tmp_path / package / "__init__.py").write_text("")
    (tmp_path / "isthmus").mkdir()
    (tmp_path / "sim" / "a.py").write_text("def f():\n    from isthmus.inter import peer\n")
    (tmp_path / "intra" / "b.py").write_text("from ..deploy import cli\n")
    (tmp_path / "inter" / "c.py").write_text("from isthmus.sim import cost, proxy\n")
    (tmp_path / "deploy" / "d.py").write_text("import isthmus.intra.model\n")
    problems = violations(tmp_path)
    assert [p.split(":")[0] for p in problems] == ["intra/b.py", "inter/c.py", "sim/a.py"]
    assert "isthmus.sim.proxy" in problems[1] and "isthmus.sim.cost" not in problems[1]
    assert cycles(tmp_path) == [["deploy", "intra", "deploy"], ["inter", "sim", "inter"]]


def test_the_job_model_loads_without_torch_grpc_or_yaml() -> None:
    """Every layer may read a job: importing the model costs no heavy dependency."""
    code = (
        "import sys, isthmus.job.model, isthmus.job.addressing, isthmus.job.ports\n"
        "print(sorted(m for m in ('torch', 'grpc', 'yaml') if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert out.stdout.strip() == "[]"


def test_every_package_folder_is_in_the_wheel() -> None:
    """pyproject.toml lists the packages one by one (the folders map onto isthmus.*):
    a sub-package left out is missing from a built wheel, and `pip install isthmus`
    would fail at its first import (deploy/session was, until this test)."""
    import tomllib

    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    folders = {
        "isthmus." + ".".join(init.parent.relative_to(ROOT).parts)
        for package in PACKAGES
        for init in (ROOT / package).rglob("__init__.py")
        if "__pycache__" not in init.parts
    }
    listed = set(setuptools["packages"]) - {"isthmus"}
    assert folders == listed, f"not in pyproject's packages: {sorted(folders - listed)}"
