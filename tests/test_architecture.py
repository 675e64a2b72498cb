"""The package's shape: short simple functions and no import cycle between its modules.

Run as a script (`python tests/test_architecture.py`) to print the figures.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

PACKAGE_ROOT = Path(__file__).resolve().parent.parent / "syncsgd"
MAX_FUNCTION_LINES = 60
MAX_DECISIONS = 20

# The branching constructs counted as decision points (a comprehension counts once per `for`).
DECISION_NODES = (
    ast.If,
    ast.For,
    ast.AsyncFor,
    ast.While,
    ast.Try,
    ast.With,
    ast.AsyncWith,
    ast.IfExp,
    ast.BoolOp,
    ast.comprehension,
    ast.ExceptHandler,
)
FUNCTION_NODES = (ast.FunctionDef, ast.AsyncFunctionDef)


@dataclass(frozen=True)
class FunctionFigures:
    """One function's place, length in lines and decision points."""

    where: str
    lines: int
    decisions: int


def module_files() -> dict[str, Path]:
    """Every module of the package by dotted name; a package's `__init__` is the package itself."""
    modules = {}
    for path in sorted(PACKAGE_ROOT.rglob("*.py")):
        parts = path.relative_to(PACKAGE_ROOT.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


def parse(path: Path) -> ast.Module:
    """The syntax tree of one source file."""
    return ast.parse(path.read_text(encoding="utf-8"), filename=str(path))


def decision_points(function: ast.AST) -> int:
    """1 plus the branching nodes anywhere inside `function`, nested functions included."""
    return 1 + sum(isinstance(node, DECISION_NODES) for node in ast.walk(function))


def function_figures() -> list[FunctionFigures]:
    """Length and decision points of every function and method in the package."""
    figures = []
    for module, path in module_files().items():
        for node in ast.walk(parse(path)):
            if isinstance(node, FUNCTION_NODES):
                lines = (node.end_lineno or node.lineno) - node.lineno + 1
                where = f"{module}.{node.name} (line {node.lineno})"
                figures.append(FunctionFigures(where, lines, decision_points(node)))
    return figures


def imported_modules(module: str, path: Path, known: set[str]) -> Iterator[str]:
    """The package modules `module` imports anywhere in its body, functions included."""
    is_package = path.name == "__init__.py"
    package_parts = module.split(".") if is_package else module.split(".")[:-1]
    tree = parse(path)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield from closest_known(alias.name, known)
        elif isinstance(node, ast.ImportFrom):
            base = absolute_base(node, package_parts)
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                # `from syncsgd.x import y` depends on module syncsgd.x.y when y is one.
                yield from closest_known(submodule if submodule in known else base, known)


def absolute_base(node: ast.ImportFrom, package_parts: list[str]) -> str:
    """The absolute module a `from ... import` statement reads from."""
    if node.level == 0:
        return node.module or ""
    anchor = package_parts[: len(package_parts) - (node.level - 1)]
    return ".".join([*anchor, *([node.module] if node.module else [])])


def closest_known(name: str, known: set[str]) -> Iterator[str]:
    """`name`, or the nearest enclosing package module of it, when it belongs to the package."""
    parts = name.split(".")
    while parts:
        candidate = ".".join(parts)
        if candidate in known:
            yield candidate
            return
        parts.pop()


def import_graph() -> dict[str, set[str]]:
    """Each package module to the package modules it imports (itself excluded)."""
    files = module_files()
    known = set(files)
    return {
        module: set(imported_modules(module, path, known)) - {module}
        for module, path in files.items()
    }


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a closed path of module names, or None when the graph has none."""
    state: dict[str, str] = {}  # "open" while on the current path, "done" once fully explored
    for start in sorted(graph):
        if start in state:
            continue
        path = [start]
        branches = [iter(sorted(graph[start]))]
        state[start] = "open"
        while branches:
            following = next(branches[-1], None)
            if following is None:
                state[path.pop()] = "done"
                branches.pop()
            elif state.get(following) == "open":
                return [*path[path.index(following) :], following]
            elif following not in state:
                state[following] = "open"
                path.append(following)
                branches.append(iter(sorted(graph[following])))
    return None


def describe(figures: list[FunctionFigures], key: str) -> str:
    """One line per function, largest `key` first."""
    ranked = sorted(figures, key=lambda figure: -getattr(figure, key))
    return "\n".join(f"  {f.where}: {f.lines} lines, {f.decisions} decisions" for f in ranked)


def test_functions_are_short() -> None:
    too_long = [f for f in function_figures() if f.lines > MAX_FUNCTION_LINES]
    assert not too_long, f"functions over {MAX_FUNCTION_LINES} lines:\n" + describe(
        too_long, "lines"
    )


def test_functions_have_few_decisions() -> None:
    too_branchy = [f for f in function_figures() if f.decisions > MAX_DECISIONS]
    assert not too_branchy, f"functions over {MAX_DECISIONS} decision points:\n" + describe(
        too_branchy, "decisions"
    )


def test_no_import_cycle() -> None:
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_util_imports_no_other_subpackage() -> None:
    # syncsgd.util is the bottom layer: nn, training, apps, collectives and comm build on it.
    graph = import_graph()
    upward = sorted(f"{module} -> {imported}" for module, imports in graph.items()
                    if module.startswith("syncsgd.util") for imported in imports
                    if not imported.startswith("syncsgd.util"))  # fmt: skip
    assert not upward, "syncsgd.util imports from above it:\n  " + "\n  ".join(upward)


def test_the_util_check_sees_an_import_from_above(tmp_path: Path) -> None:
    module = tmp_path / "validate.py"
    module.write_text("from syncsgd.nn.arrays import shape_size\nfrom . import files\n")
    known = {"syncsgd.nn.arrays", "syncsgd.util.files", "syncsgd.util.validate"}
    assert set(imported_modules("syncsgd.util.validate", module, known)) == {
        "syncsgd.nn.arrays", "syncsgd.util.files"}


def test_cycle_finder_sees_a_cycle() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_decision_points_count_each_construct() -> None:
    source = (
        "def f(x):\n    if x and x:\n        return [y for y in x if y]\n    return 1 if x else 2"
    )
    # if, and, comprehension, ternary: 4 constructs plus 1.
    assert decision_points(ast.parse(source).body[0]) == 5


def main() -> int:
    """Print the longest function, the most decision points and any import cycle."""
    figures = function_figures()
    longest = max(figures, key=lambda figure: figure.lines)
    branchiest = max(figures, key=lambda figure: figure.decisions)
    cycle = find_cycle(import_graph())
    print(f"functions measured: {len(figures)} in {len(module_files())} modules")
    print(f"longest function: {longest.where}, {longest.lines} lines (limit {MAX_FUNCTION_LINES})")
    print(
        f"most decision points: {branchiest.where}, {branchiest.decisions} (limit {MAX_DECISIONS})"
    )
    print("import cycle: " + (" -> ".join(cycle) if cycle else "none"))
    offenders = [f for f in figures if f.lines > MAX_FUNCTION_LINES or f.decisions > MAX_DECISIONS]
    if offenders:
        print("over a limit:\n" + describe(offenders, "lines"))
    return 1 if offenders or cycle else 0


if __name__ == "__main__":
    sys.exit(main())
