"""The layers import only downwards (docs/ARCHITECTURE.md, "The layers").

Read from the source with ``ast``, the way ruff or an import-linter contract
would: every module of every package, imports inside functions included (a
lazy import is still a dependency), ``if TYPE_CHECKING:`` ones too. Bottom to
top:

    job            the job model, its YAML file and shared basics: no other layer
    intra, sim     one site (torch) / the WAN emulator and performance model
    proto          the wire schema
    inter          across sites: intra, proto, job and sim's cost model only
    training       inside a rank: the API a script imports, the built-in loop
    deploy         launching, the command line, rendering, tools: anything

Nothing outside deploy imports deploy (``isthmus/__init__``'s lazy table names
modules in strings, not imports), no two packages import each other, directly or
round a longer loop, and neither do any two sub-packages of deploy.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = {
    "job": "job",
    "intra": "intra",
    "sim": "sim",
    "proto": "proto",
    "inter": "inter",
    "training": "isthmus/training",
    "deploy": "deploy",
}
"""Each package isthmus.<name> and its folder (pyproject.toml's package-dir)."""
PACKAGES = tuple(FOLDERS)

ALLOWED: dict[str, set[str]] = {
    "job": set(),
    "intra": {"job"},
    "sim": {"job"},
    "proto": set(),
    "inter": {"job", "intra", "proto", "sim.cost"},
    "training": {"job", "intra", "proto", "inter", "sim.cost"},
}
"""What each library may import of the other packages (a package, or one module
of it); deploy may import all of them and is imported by none."""


def module_of(root: Path, package: str, path: Path) -> str:
    parts = path.relative_to(root / FOLDERS[package]).with_suffix("").parts
    if parts and parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(("isthmus", package, *parts))


def imports(root: Path, package: str) -> Iterator[tuple[str, str, str]]:
    """(``file:line``, importing module, imported module) for every isthmus import
    in ``package``."""
    folder = root / FOLDERS[package]
    for path in sorted(folder.rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        module = module_of(root, package, path)
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
                    yield f"{path.relative_to(root)}:{node.lineno}", module, name


def layer_of(name: str) -> str | None:
    """The package an ``isthmus.*`` name belongs to (None: the top-level face)."""
    parts = name.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in PACKAGES else None


def violations(root: Path) -> list[str]:
    """Every import that breaks a rule, as ``file:line: imports X (why)``."""
    found = []
    for package in PACKAGES:
        for where, _, name in imports(root, package):
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
            if module and layer_of(module) in ("deploy", "training"):
                found.append(f"isthmus/{path.name}:{node.lineno}: imports {module}")
    return found


def loops(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every loop in ``graph`` (A imports B ... imports A), each once."""
    found: list[list[str]] = []

    def visit(node: str, path: list[str]) -> None:
        for nxt in sorted(graph.get(node, ())):
            if nxt == path[0]:
                found.append([*path, nxt])
            elif nxt not in path and nxt > path[0]:  # each loop once, from its least node
                visit(nxt, [*path, nxt])

    for start in sorted(graph):
        visit(start, [start])
    return found


def cycles(root: Path) -> list[list[str]]:
    """Loops in the package graph (package A imports B ... imports A)."""
    graph: dict[str, set[str]] = {p: set() for p in PACKAGES}
    for package in PACKAGES:
        for _, _, name in imports(root, package):
            target = layer_of(name)
            if target is not None and target != package:
                graph[package].add(target)
    return loops(graph)


def room(name: str) -> str:
    """The sub-package of deploy a module belongs to (``deploy`` for its own modules)."""
    parts = name.split(".")
    if len(parts) > 2 and (ROOT / "deploy" / parts[2]).is_dir():
        return f"deploy.{parts[2]}"
    return "deploy"


def deploy_cycles(root: Path) -> list[list[str]]:
    """Loops between deploy's sub-packages (launch, cli, render, bench, tune, ...)."""
    graph: dict[str, set[str]] = {}
    for _, module, name in imports(root, "deploy"):
        if layer_of(name) == "deploy" and room(module) != room(name):
            graph.setdefault(room(module), set()).add(room(name))
    return loops(graph)


def test_every_package_imports_only_the_layers_below_it() -> None:
    problems = violations(ROOT)
    assert not problems, "imports against the layers:\n" + "\n".join(problems)


def test_no_package_level_cycles() -> None:
    found = cycles(ROOT)
    assert not found, "package cycles: " + "; ".join(" -> ".join(loop) for loop in found)


def test_no_cycles_between_deploys_rooms() -> None:
    found = deploy_cycles(ROOT)
    assert not found, "cycles in deploy: " + "; ".join(" -> ".join(loop) for loop in found)


def test_the_checks_see_function_level_and_relative_imports(tmp_path: Path) -> None:
    """The rules catch an import hidden in a function, and a relative one."""
    for folder in FOLDERS.values():
        (tmp_path / folder).mkdir(parents=True)
        (tmp_path / folder / "__init__.py").write_text("")
    (tmp_path / "sim" / "a.py").write_text("def f():\n    from isthmus.inter import peer\n")
    (tmp_path / "intra" / "b.py").write_text("from ..deploy import cli\n")
    (tmp_path / "inter" / "c.py").write_text("from isthmus.sim import cost, proxy\n")
    (tmp_path / "deploy" / "d.py").write_text("import isthmus.intra.model\n")
    (tmp_path / "isthmus" / "training" / "e.py").write_text("from isthmus.deploy import cli\n")
    problems = violations(tmp_path)
    problems.sort()
    assert [p.split(":")[0] for p in problems] == [
        "inter/c.py", "intra/b.py", "isthmus/training/e.py", "sim/a.py",
    ]  # fmt: skip
    assert "isthmus.sim.proxy" in problems[0] and "isthmus.sim.cost" not in problems[0]
    assert cycles(tmp_path) == [["deploy", "intra", "deploy"], ["inter", "sim", "inter"]]


def test_a_rank_loads_no_launcher_module() -> None:
    """Starting one rank (``python -m isthmus.training.worker``, what every rank of
    the built-in loop runs) and a user's script (``isthmus.join``) load the training
    layer and those below it, never deploy: read from ``-X importtime``."""
    for code in ("import isthmus.training.worker", "import isthmus; isthmus.join"):
        out = subprocess.run(
            [sys.executable, "-X", "importtime", "-c", code],
            capture_output=True, text=True, check=True, timeout=120,
        )  # fmt: skip
        loaded = {
            line.rsplit("|", 1)[-1].strip()
            for line in out.stderr.splitlines()
            if line.startswith("import time:")
        }
        assert "isthmus.training.builtin_loop" in loaded
        assert not sorted(m for m in loaded if m.startswith("isthmus.deploy")), code


def test_a_ranks_start_crosses_each_boundary_once() -> None:
    """Following the imports from the rank's entry point, every step goes down
    the layers or stays in one: never back up (run → session → run was the path)."""
    order = {p: i for i, p in enumerate(reversed(PACKAGES))}  # deploy 0 ... job last
    edges: dict[str, set[str]] = {}
    for package in PACKAGES:
        for _, module, name in imports(ROOT, package):
            edges.setdefault(module, set()).add(name)

    def as_module(name: str) -> str:  # ``from m import f`` names m.f: the module is m
        while name not in edges and name.count(".") > 1:
            name = name.rsplit(".", 1)[0]
        return name

    seen, stack, upward = set(), ["isthmus.training.worker"], []
    while stack:
        module = stack.pop()
        if module in seen:
            continue
        seen.add(module)
        for name in map(as_module, edges.get(module, ())):
            a, b = layer_of(module), layer_of(name)
            if a and b and order[b] < order[a]:
                upward.append(f"{module} -> {name}")
            stack.append(name)
    assert len(seen) > 50 and not upward, upward


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
        module_of(ROOT, package, init)
        for package in PACKAGES
        for init in (ROOT / FOLDERS[package]).rglob("__init__.py")
        if "__pycache__" not in init.parts
    }
    listed = set(setuptools["packages"]) - {"isthmus"}
    assert folders == listed, f"not in pyproject's packages: {sorted(folders - listed)}"


PICTURE_START = "<!-- layers: generated by python tests/test_layers.py --write -->"
PICTURE_END = "<!-- /layers -->"


def picture(root: Path) -> str:
    """The layers as the code's imports draw them: top to bottom, each with the
    packages (or single modules) it imports."""
    uses: dict[str, set[str]] = {p: set() for p in PACKAGES}
    for package in PACKAGES:
        for _, _, name in imports(root, package):
            target = layer_of(name)
            if target is None or target == package:
                continue
            rest = name.split(".", 1)[1]
            limited = {a for a in ALLOWED.get(package, ()) if "." in a}
            part = next((a for a in limited if rest == a or rest.startswith(a + ".")), target)
            uses[package].add(part)
    lines = []
    for package in reversed(PACKAGES):
        below = ", ".join(sorted(uses[package])) or "(nothing of Isthmus)"
        lines.append(f"{package:<9} {FOLDERS[package] + '/':<18} -> {below}")
    return "\n".join(["```", *lines, "```"])


def _doc_picture(text: str) -> str:
    start, end = text.index(PICTURE_START), text.index(PICTURE_END)
    return text[start + len(PICTURE_START) : end].strip()


def test_the_architecture_map_draws_the_layers_the_imports_draw() -> None:
    text = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    assert _doc_picture(text) == picture(ROOT), "run: python tests/test_layers.py --write"


if __name__ == "__main__":  # python tests/test_layers.py --write: redraw the map's picture
    doc = ROOT / "docs" / "ARCHITECTURE.md"
    text = doc.read_text()
    if "--write" in sys.argv:
        start = text.index(PICTURE_START) + len(PICTURE_START)
        end = text.index(PICTURE_END)
        doc.write_text(f"{text[:start]}\n{picture(ROOT)}\n{text[end:]}")
    print(picture(ROOT))
