"""The package layout: imports flow down, `cli` > `commands` > `bench` > the top-level modules (target and draft
loading) > `generation` / `training` > `modeling` > `utils`, never back.

Every module under `eagle3_hf/` is read with `ast` (imports inside functions and relative imports included), so a
lazy import that reaches up counts as much as one at the top of a file.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = "eagle3_hf"
ROOT = Path(__file__).resolve().parent.parent / PACKAGE
LAYERS = ("utils", "modeling", "generation", "training", "bench", "commands")
MAX_LINES = 500
# Modules allowed past MAX_LINES: name -> (their own cap, why the module is one concept that long). None today.
LONGER: dict[str, tuple[int, str]] = {}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> dict[str, Path]:
    return {module_name(path): path for path in sorted(ROOT.rglob("*.py"))}


def resolve(name: str, known: dict[str, Path]) -> str | None:
    """The module of ours that `name` (a module or a name inside one) refers to, or None if it is not ours."""
    while name:
        if name in known:
            return name
        name = name.rpartition(".")[0]
    return None


def type_checking_imports(tree: ast.AST) -> set[ast.AST]:
    """The import statements under `if TYPE_CHECKING:`: read by type checkers only, never run."""
    found: set[ast.AST] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", getattr(node.test, "attr", None)) == "TYPE_CHECKING":
            found |= {n for statement in node.body for n in ast.walk(statement)}
    return found


def imports_of(module: str, path: Path, known: dict[str, Path], runtime_only: bool = False) -> set[str]:
    """Modules of ours that `module` imports, anywhere in its file (`runtime_only`: not those it imports for type
    checkers only, which cannot form an import cycle)."""
    is_package = path.name == "__init__.py"
    found: set[str] = set()
    tree = ast.parse(path.read_text(), str(path))
    skipped = type_checking_imports(tree) if runtime_only else set()
    for node in ast.walk(tree):
        if node in skipped:
            continue
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")
                base = base[: len(base) - node.level + (1 if is_package else 0)]
                prefix = ".".join(base + ([node.module] if node.module else []))
            else:
                prefix = node.module or ""
            # `from pkg import sub` imports the submodule `pkg.sub` when there is one, else a name of `pkg`.
            names = [f"{prefix}.{alias.name}" if f"{prefix}.{alias.name}" in known else prefix for alias in node.names]
        else:
            continue
        for name in names:
            target = resolve(name, known)
            # A module's own parent packages are not dependencies, except the package root (which imports the rest).
            if target is not None and target != module and (target == PACKAGE or not module.startswith(target + ".")):
                found.add(target)
    return found


def import_graph(runtime_only: bool = False) -> dict[str, set[str]]:
    known = modules()
    return {module: imports_of(module, path, known, runtime_only) for module, path in known.items()}


def layer(module: str) -> str:
    """A subpackage of `LAYERS`, `cli`, the package root `__init__` (`root`), or `top` for the other top-level
    modules (target loading, draft names)."""
    parts = module.split(".")
    if len(parts) == 1:
        return "root"
    if parts[1] == "cli":
        return "cli"
    return parts[1] if parts[1] in LAYERS else "top"


# Which layers each layer may import (besides itself): `utils` < `modeling` < `generation`, `training` (beside each
# other) < the top-level modules < `bench` < `commands` < `cli`. The package root (`eagle3_hf/__init__.py`) re-exports
# the model and imports generation so that `bind` is registered; so only the layers above it may import the root.
_BELOW_TOP = {"utils", "modeling", "generation", "training"}
ALLOWED = {
    "utils": set(),
    "modeling": {"utils"},
    "generation": {"utils", "modeling"},
    "training": {"utils", "modeling"},
    "root": {"utils", "modeling", "generation"},
    "top": _BELOW_TOP | {"root"},
    "bench": _BELOW_TOP | {"root", "top"},
    "commands": _BELOW_TOP | {"root", "top", "bench"},
    "cli": _BELOW_TOP | {"root", "top", "bench", "commands"},
}


def upward_edges(graph: dict[str, set[str]]) -> list[str]:
    bad = []
    for module, targets in graph.items():
        for target in targets:
            src, dst = layer(module), layer(target)
            if src != dst and dst not in ALLOWED[src]:
                bad.append(f"{module} -> {target} ({src} may import only {sorted(ALLOWED[src]) or 'itself'})")
    return sorted(bad)


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_graph_sees_every_module_and_lazy_imports():
    graph = import_graph()
    assert {f"{PACKAGE}.{name}" for name in LAYERS} <= set(graph)
    assert {layer(module) for module in graph} == {*LAYERS, "top", "root", "cli"}
    assert "eagle3_hf.modeling.modeling_eagle3" in graph["eagle3_hf.generation.decoding"]
    # Imports inside functions count (the bench command loads targets and drafts lazily).
    assert "eagle3_hf.targets" in graph["eagle3_hf.commands.bench"]


def test_no_import_flows_up():
    bad = upward_edges(import_graph())
    assert not bad, "imports that flow up:\n  " + "\n  ".join(bad)


def test_no_import_cycles():
    """No cycle among the imports that run (the layers above count type-only imports too)."""
    found = cycles(import_graph(runtime_only=True))
    assert not found, "import cycles:\n  " + "\n  ".join(" <-> ".join(c) for c in found)


@pytest.mark.parametrize(
    "edge",
    [
        ("eagle3_hf.modeling.modeling_eagle3", "eagle3_hf.generation.decoding"),
        ("eagle3_hf.modeling.checkpoints", "eagle3_hf.targets"),
        ("eagle3_hf.utils.atomic", "eagle3_hf.modeling.checkpoints"),
        ("eagle3_hf.utils.precision", "eagle3_hf.generation.decoding"),
        ("eagle3_hf.targets", "eagle3_hf.commands.generate"),
        ("eagle3_hf.commands.generate", "eagle3_hf.cli"),
        ("eagle3_hf.bench.runner", "eagle3_hf.commands.bench"),
        ("eagle3_hf.targets", "eagle3_hf.bench.cards"),
        ("eagle3_hf.generation.verify_choice", "eagle3_hf.bench.report"),
        ("eagle3_hf.generation.decoding", "eagle3_hf.training.trainer"),
        ("eagle3_hf.training.features", "eagle3_hf.generation.tree"),
        ("eagle3_hf.training.features", "eagle3_hf.targets"),
        ("eagle3_hf.generation.drafting", "eagle3_hf.draft_names"),
    ],
)
def test_an_upward_edge_is_reported_by_name(edge):
    graph = import_graph()
    graph[edge[0]] = graph[edge[0]] | {edge[1]}
    assert any(line.startswith(f"{edge[0]} -> {edge[1]} ") for line in upward_edges(graph))


@pytest.mark.parametrize(
    "edge",
    [
        ("eagle3_hf.modeling.checkpoints", "eagle3_hf.utils.atomic"),
        ("eagle3_hf.training.features", "eagle3_hf.utils.precision"),
        ("eagle3_hf.commands.generate", "eagle3_hf.targets"),
        ("eagle3_hf.cli", "eagle3_hf.commands.generate"),
        ("eagle3_hf.commands.bench", "eagle3_hf.bench.runner"),
        ("eagle3_hf.bench.runner", "eagle3_hf.targets"),
    ],
)
def test_a_downward_edge_is_allowed(edge):
    graph = import_graph()
    graph[edge[0]] = graph[edge[0]] | {edge[1]}
    assert not [line for line in upward_edges(graph) if line.startswith(f"{edge[0]} -> {edge[1]} ")]


def generation_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The imports among `generation/`'s modules."""
    inside = f"{PACKAGE}.generation."
    return {m: {d for d in deps if d.startswith(inside)} for m, deps in graph.items() if m.startswith(inside)}


def test_no_import_cycle_in_generation_even_for_types():
    """Inside generation/ not even type-only imports go round: the loop's contracts live in cycle.py, which the
    engine, emission and the proposers import, and nothing there imports them back."""
    found = cycles(generation_graph(import_graph()))
    assert not found, "import cycles in generation/ (type-only imports count):\n  " + "\n  ".join(
        " <-> ".join(c) for c in found
    )


def test_a_type_only_cycle_in_generation_is_reported(tmp_path):
    """A module importing another for its types alone, under `if TYPE_CHECKING:`, makes an edge of the full graph
    (not of the runtime one), so a type-only cycle in generation/ is caught."""
    path = tmp_path / "proposers.py"
    path.write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from eagle3_hf.generation.engine import decode\n"
    )
    known = modules()
    name = f"{PACKAGE}.generation.proposers"
    assert f"{PACKAGE}.generation.engine" in imports_of(name, path, known)
    assert f"{PACKAGE}.generation.engine" not in imports_of(name, path, known, runtime_only=True)
    graph = import_graph()
    graph[name] = graph[name] | imports_of(name, path, known)
    assert any(name in c and f"{PACKAGE}.generation.engine" in c for c in cycles(generation_graph(graph)))


def test_a_cycle_is_reported():
    graph = import_graph()
    graph["eagle3_hf.generation.tree"] = graph["eagle3_hf.generation.tree"] | {"eagle3_hf.generation.decoding"}
    assert any("eagle3_hf.generation.tree" in c and "eagle3_hf.generation.decoding" in c for c in cycles(graph))


def test_relative_and_in_function_imports_are_read(tmp_path):
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    for name in ("__init__.py", "a.py", "sub/__init__.py", "sub/b.py"):
        (package / name).write_text("")
    (package / "sub" / "b.py").write_text("def f():\n    from ..a import x\n    from . import c\n")
    known = {"pkg": package, "pkg.a": package / "a.py", "pkg.sub": package / "sub", "pkg.sub.b": package / "sub/b.py"}
    assert imports_of("pkg.sub.b", package / "sub" / "b.py", known) == {"pkg.a"}


def test_modules_stay_short():
    known = modules()
    long = {
        name: n
        for name, path in known.items()
        if (n := len(path.read_text().splitlines())) > LONGER.get(name, (MAX_LINES, ""))[0]
    }
    assert not long, f"modules over {MAX_LINES} lines (or their named cap in LONGER): {long}"
    assert [name for name in LONGER if name not in known] == [], "LONGER names a module that is gone"


def test_modules_say_what_they_are():
    undocumented = [name for name, path in modules().items() if not ast.get_docstring(ast.parse(path.read_text()))]
    assert not undocumented, f"modules without a docstring: {undocumented}"


def imported_test_modules(source: str) -> list[str]:
    """The test modules (`test_*`, `tests.test_*`) and conftest that `source` imports, lazily or not."""
    found = []
    for node in ast.walk(ast.parse(source)):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
        if isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module]
        for name in names:
            last = name.removeprefix("tests.").split(".")[0]
            if last.startswith("test_") or last == "conftest":
                found.append(name)
    return found


def test_no_test_module_imports_another():
    # What tests share lives in tests/helpers/: a test module imported by another runs its module-level code twice
    # and ties the two files' fixtures together.
    tests = Path(__file__).parent
    offenders = {
        str(path.relative_to(tests)): imported
        for path in sorted(tests.rglob("*.py"))
        if (imported := imported_test_modules(path.read_text(encoding="utf-8")))
    }
    assert not offenders, f"import from tests/helpers/ instead: {offenders}"


def test_a_lazy_import_of_a_test_module_is_found():
    source = "import os\n\ndef f():\n    from test_generation import make_pair\n    import tests.test_cli\n"
    assert imported_test_modules(source) == ["test_generation", "tests.test_cli"]
