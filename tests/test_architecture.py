"""The layering rules of docs/architecture.md, made executable.

- dependencies point one way: service -> workers -> training;
- no import cycle inside the three packages, counting imports inside functions
  (imports under `if TYPE_CHECKING:` never run and are not counted);
- training never imports Ray, FastAPI or the web stack; workers never imports FastAPI;
  service never imports Ray (it talks to controllers through `workers.client`);
- the planner and `training.config` import neither torch nor Ray;
- files and functions stay short enough to read in one sitting;
- `training/` keeps at most four modules at its top; the rest lives in packages by concern.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("service", "workers", "training")
LAYER = {"service": 2, "workers": 1, "training": 0}
FORBIDDEN = {  # package -> third-party top-level modules it must never import
    "training": {"ray", "fastapi", "starlette", "uvicorn", "sqlalchemy", "service", "workers"},
    "workers": {"fastapi", "starlette", "uvicorn", "sqlalchemy", "service"},
    "service": {"ray"},
}
MAX_FILE_LINES = 450
MAX_FUNCTION_LINES = 80


def _modules() -> dict[str, Path]:
    found = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


MODULES = _modules()


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _import_nodes(tree: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import statement that can run, at any depth (functions included)."""
    stack: list[ast.AST] = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and _is_type_checking(node):
            stack.extend(node.orelse)
            continue
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node
        stack.extend(ast.iter_child_nodes(node))


def _imported(module: str, path: Path) -> set[str]:
    """Fully qualified names this module imports (`from a import b` gives `a.b` when that is a module)."""
    names: set[str] = set()
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in _import_nodes(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
            continue
        base = node.module or ""
        if node.level:
            anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
            base = ".".join(anchor + ([base] if base else []))
        for alias in node.names:
            candidate = f"{base}.{alias.name}"
            names.add(candidate if candidate in MODULES else base)
    return names


GRAPH = {m: {n for n in _imported(m, p) if n in MODULES and n != m} for m, p in MODULES.items()}
IMPORTS = {m: _imported(m, p) for m, p in MODULES.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
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

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_the_checker_sees_cycles_and_function_level_imports() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []
    tree = ast.parse("def f():\n    import ray\nif TYPE_CHECKING:\n    import fastapi\n")
    assert [a.name for n in _import_nodes(tree) for a in n.names] == ["ray"]


def test_no_import_cycles() -> None:
    assert _cycles(GRAPH) == []


def test_dependencies_point_one_way() -> None:
    upward = [f"{m} -> {n}" for m, deps in GRAPH.items() for n in deps
              if LAYER[n.split(".")[0]] > LAYER[m.split(".")[0]]]
    assert upward == []


@pytest.mark.parametrize("package", PACKAGES)
def test_forbidden_imports(package: str) -> None:
    bad = sorted(f"{m} imports {n}" for m, names in IMPORTS.items() if m.split(".")[0] == package
                 for n in names if n.split(".")[0] in FORBIDDEN[package])
    assert bad == []


def test_planner_and_training_config_are_pure_python() -> None:
    pure = [m for m in MODULES if m.startswith(("service.planner", "training.config"))]
    assert "training.config.layout" in pure and "service.planner.search" in pure
    code = ("import importlib, sys\n"
            f"for m in {pure!r}: importlib.import_module(m)\n"
            "print(sorted({'torch', 'ray', 'fastapi'} & set(sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def test_files_and_functions_are_short() -> None:
    long_files, long_functions = [], []
    for module, path in MODULES.items():
        source = path.read_text()
        if source.count("\n") > MAX_FILE_LINES:
            long_files.append(f"{module}: {source.count(chr(10))} lines")
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                length = (node.end_lineno or node.lineno) - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    long_functions.append(f"{module}.{node.name}: {length} lines")
    assert long_files == [] and long_functions == []


def test_training_keeps_few_top_level_modules() -> None:
    top = sorted(p.name for p in (ROOT / "training").glob("*.py") if p.name != "__init__.py")
    assert len(top) <= 4, top
