"""No import cycles between nlq's modules, counting imports inside functions too.

An edge A -> B means module A imports nlq module B anywhere in its source (module level or
inside a function); `from nlq.x import y` is an edge to nlq.x.y when y is a submodule, else
to nlq.x; importing a package is an edge to its __init__. Imports under
`if TYPE_CHECKING:` never run and are not edges. A cycle makes import order matter (a
half-initialised module) and ties two rooms of the package together, so the graph must be
acyclic. Collapsed to floors (subpackages and base files, docs/architecture.md) it must be
acyclic too, and the model, the ground floor, imports base files only: not even for type
hints does it name a floor above it.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "nlq"


def module_names(root: Path = PKG) -> dict[str, Path]:
    """{dotted name: file} for every module of the package (a package is its __init__)."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def imported(source: str, name: str, is_package: bool, modules) -> set[str]:
    """The nlq modules (names in `modules`) that module `name` imports anywhere."""
    out: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.orelse:  # only the else branch runs
                visit(child)
            return
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name in modules)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the module's own package upwards
                pkg = name.split(".") if is_package else name.split(".")[:-1]
                pkg = pkg[: len(pkg) - (node.level - 1)]
                base = ".".join(pkg + ([base] if base else []))
            for a in node.names:
                sub = f"{base}.{a.name}"
                if sub in modules:
                    out.add(sub)
                elif base in modules:
                    out.add(base)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(source))
    out.discard(name)
    return out


def import_graph(root: Path = PKG) -> dict[str, set[str]]:
    mods = module_names(root)
    return {name: imported(path.read_text(), name, path.name == "__init__.py", mods)
            for name, path in mods.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as [a, b, ..., a], or None (depth-first search, iterative)."""
    state: dict[str, int] = {}  # 1 on the current path, 2 done
    for start in sorted(graph):
        if state.get(start):
            continue
        path, stack = [start], [iter(sorted(graph[start]))]
        state[start] = 1
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                stack.pop()
            elif state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            elif not state.get(nxt):
                state[nxt] = 1
                path.append(nxt)
                stack.append(iter(sorted(graph.get(nxt, ()))))
    return None


def test_nlq_import_graph_is_acyclic():
    graph = import_graph()
    assert "nlq.model.transformer" in graph["nlq.model.params"]  # the graph sees edges
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_edges_count_function_level_and_submodule_imports_but_not_type_checking():
    mods = {"nlq", "nlq.a", "nlq.b", "nlq.c", "nlq.pkg", "nlq.pkg.sub", "nlq.d"}
    src = (
        "from typing import TYPE_CHECKING\n"
        "import torch\n"
        "from nlq.a import thing\n"
        "from nlq.pkg import sub\n"
        "if TYPE_CHECKING:\n"
        "    from nlq.d import Hint\n"
        "def f():\n"
        "    import nlq.b as b\n"
        "    from . import c\n"
    )
    assert imported(src, "nlq.x", False, mods) == {"nlq.a", "nlq.pkg.sub", "nlq.b", "nlq.c"}


def test_find_cycle_reports_the_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"a2"}, "a2": {"x"}, "x": {"a2"}}) == ["a2", "x", "a2"]


# The floors (docs/architecture.md): the model is the ground floor, on base files only; the
# run's config is built on top of it. BASE: files every floor may import, which import
# nothing of nlq but each other.
BASE = {"nlq", "nlq.errors", "nlq.checks", "nlq.extras", "nlq.fsutil", "nlq.sysinfo",
        "nlq.runfiles", "nlq.progress"}
# Each subpackage, bottom to top, with the floors it may import besides base files (the
# table of docs/architecture.md). nlq/run/ holds what a run's training and its later use
# share, so that nlq/train/ and nlq/infer/ stand side by side and neither imports the other.
FLOORS = {
    "nlq.model": set(),
    "nlq.config": {"nlq.model"},
    "nlq.data": set(),
    "nlq.hf": {"nlq.model", "nlq.config", "nlq.data"},
    "nlq.report": {"nlq.config", "nlq.data"},
    "nlq.run": {"nlq.model", "nlq.config", "nlq.data"},
    "nlq.train": {"nlq.model", "nlq.config", "nlq.data", "nlq.hf", "nlq.run"},
    "nlq.infer": {"nlq.model", "nlq.config", "nlq.data", "nlq.hf", "nlq.run"},
    "nlq.experiments": {"nlq.model", "nlq.config", "nlq.data", "nlq.report", "nlq.run",
                        "nlq.train"},
}
NOT_UNDER_THE_MODEL = (*(f.split(".")[1] for f in FLOORS if f != "nlq.model"), "cli")


def floor(module: str) -> str:
    """The node of the floor graph: a subpackage (nlq.train for nlq.train.loop), else the
    module itself (a base file, nlq.cli)."""
    parts = module.split(".")
    if len(parts) > 1 and (PKG / parts[1] / "__init__.py").exists():
        return "nlq." + parts[1]
    return module


def test_the_model_imports_only_base_files():
    graph = import_graph()
    for name, deps in graph.items():
        if floor(name) != "nlq.model":
            continue
        above = sorted(d for d in deps if d.split(".")[1:2] and d.split(".")[1]
                       in NOT_UNDER_THE_MODEL)
        assert not above, f"{name} imports {above}: nlq/model is the ground floor"
        assert all(floor(d) in ("nlq.model", *BASE) for d in deps), (name, deps)
    for path in (PKG / "model").rglob("*.py"):  # imports for type hints count here too
        named = {a.name for n in ast.walk(ast.parse(path.read_text()))
                 if isinstance(n, ast.Import) for a in n.names}
        named |= {n.module or "" for n in ast.walk(ast.parse(path.read_text()))
                  if isinstance(n, ast.ImportFrom)}
        assert not {m for m in named if m.split(".")[:1] == ["nlq"]
                    and m.split(".")[1:2] and m.split(".")[1] in NOT_UNDER_THE_MODEL}, path


def test_base_files_import_only_base_files():
    graph = import_graph()
    for name in BASE:
        assert graph[name] <= BASE, (name, graph[name] - BASE)


def test_no_import_cycle_between_subpackages():
    """Collapsed to floors (every module of nlq/train is nlq.train), the graph is acyclic:
    no two subpackages import each other, even through a third."""
    graph: dict[str, set[str]] = {}
    for name, deps in import_graph().items():
        graph.setdefault(floor(name), set()).update(floor(d) for d in deps)
    for node, deps in graph.items():
        deps.discard(node)
    assert "nlq.model" in graph["nlq.config"]  # the config is built on the model
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle between floors: " + " -> ".join(cycle)


def test_each_floor_imports_only_the_floors_below_it():
    """Every subpackage has its place in FLOORS, and imports only the floors listed there
    (and base files): e.g. nlq/infer/ reads a run through nlq/run/, never nlq/train/."""
    packages = {"nlq." + p.parent.name for p in PKG.glob("*/__init__.py")}
    assert packages == set(FLOORS), "place the new subpackage in FLOORS and the docs' table"
    order = list(FLOORS)
    for name, deps in import_graph().items():
        here = floor(name)
        if here not in FLOORS:
            continue
        for d in deps:
            there = floor(d)
            if there == here or there in BASE:
                continue
            assert there in FLOORS[here], f"{name} imports {d}: {there} is not under {here}"
            assert order.index(there) < order.index(here), (name, d)


def test_floor_cycles_are_seen():
    assert floor("nlq.train.loop") == "nlq.train" and floor("nlq.errors") == "nlq.errors"
    assert find_cycle({"nlq.model": {"nlq.config"}, "nlq.config": {"nlq.model"}})


def test_light_imports_stay_light():
    """The command line and the base files load without torch (`nlq --help` at once); the
    model and everything built on it (nlq.config too: [model] is the model's ModelConfig)
    load it."""
    code = ("import sys, nlq, nlq.cli, nlq.errors, nlq.checks; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=PKG.parent).stdout
    assert out.strip() == "False"
