"""The package layers, read from the source: the shared package imports no daemon or
tool, the two daemon packages never import each other (or a tool), and no module imports
itself through a chain of others (an import cycle). Every import statement is an edge:
top-level ones, ones inside functions, and ones under ``if TYPE_CHECKING:`` (they never
run, but a type named across a cycle is still a dependency that runs both ways: the two
modules cannot be understood, tested or moved apart)."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PACKAGES = {"fedattn_shared": REPO / "shared", "fl_server": REPO / "fl_server",
            "fl_edge": REPO / "fl_edge", "fl_tools": REPO / "tools"}
GENERATED = {"fedattn_shared.wire.fedattn_pb2", "fedattn_shared.wire.fedattn_pb2_grpc"}
# What each package may import of the others.
ALLOWED = {
    "fedattn_shared": set(),
    "fl_server": {"fedattn_shared"},
    "fl_edge": {"fedattn_shared"},
    "fl_tools": {"fedattn_shared", "fl_server", "fl_edge"},
}


def modules() -> dict[str, Path]:
    found = {}
    for package, root in PACKAGES.items():
        for path in root.rglob("*.py"):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join([package, *parts])] = path
    return found


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """The project modules ``name`` imports (a ``from package import module`` counts as
    the module)."""
    is_package = path.name == "__init__.py"
    out: set[str] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Import):
                out.update(alias.name for alias in child.names)
            elif isinstance(child, ast.ImportFrom):
                if child.level:
                    base = name.split(".")
                    base = base if is_package else base[:-1]
                    base = base[: len(base) - (child.level - 1)]
                    target = ".".join(base + ([child.module] if child.module else []))
                else:
                    target = child.module or ""
                submodules = {f"{target}.{alias.name}" for alias in child.names}
                out.update(submodules & known)
                if not submodules <= known:  # names defined in ``target`` itself
                    out.add(target)
            visit(child)

    visit(ast.parse(path.read_text()))
    return {m for m in out if m in known and m != name}


def graph() -> dict[str, set[str]]:
    found = modules()
    known = set(found)
    return {name: imports_of(name, path, known) - GENERATED for name, path in found.items()}


def test_packages_import_only_the_layers_below():
    wrong = []
    for module, targets in graph().items():
        package = module.split(".")[0]
        for target in targets:
            other = target.split(".")[0]
            if other != package and other not in ALLOWED[package]:
                wrong.append(f"{module} imports {target}")
    assert not wrong, wrong


# Inside the shared package: the contract's values (schema.py) sit below everything, and
# the codecs and the privacy layers take those values, never the method contract or a
# model module (the methods use them, not the other way round).
VALUES_ONLY = ("fedattn_shared.compress", "fedattn_shared.privacy")
ABOVE_THEM = ("fedattn_shared.methods", "fedattn_shared.models")


def _under(module: str, packages: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


def test_schema_imports_nothing_of_the_project():
    assert graph()["fedattn_shared.schema"] == set()


def test_codecs_and_privacy_take_values_not_the_method():
    wrong = [f"{module} imports {target}" for module, targets in graph().items()
             if _under(module, VALUES_ONLY) for target in targets if _under(target, ABOVE_THEM)]
    assert not wrong, wrong


def tangles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan): every module
    of one can reach every other, so each is one or more import cycles."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(edges.get(node, ())):
            if target not in index:
                connect(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            connect(node)
    return found


def test_tangles_finds_a_cycle_through_any_edge():
    """The checker itself: a three-module ring is one tangle, a chain is none."""
    assert tangles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert tangles({"a": {"b"}, "b": {"c"}, "c": set()}) == []


def test_no_import_cycle():
    """No tangle anywhere, TYPE_CHECKING imports counted."""
    found = tangles(graph())
    assert not found, "\n".join(" <-> ".join(c) for c in found)


DAEMONS = ("fl_server", "fl_edge")
MAX_FUNCTION_LINES = 60


def daemon_definitions():
    """(module, node, nested) for every class and function of the two daemon packages."""
    for name, path in modules().items():
        if name.split(".")[0] not in DAEMONS:
            continue
        tree = ast.parse(path.read_text())
        stack = [(child, False) for child in tree.body]
        while stack:
            node, nested = stack.pop()
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                yield name, node, nested
                inner = isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
                stack.extend((child, nested or inner) for child in node.body)


def test_daemon_functions_fit_on_a_screen():
    """The daemons are read more than written: no function over ~60 lines."""
    long = [f"{module}.{node.name}: {node.end_lineno - node.lineno + 1} lines"
            for module, node, _ in daemon_definitions()
            if not isinstance(node, ast.ClassDef)
            and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES]
    assert not long, long


def test_daemon_classes_and_functions_say_why():
    """Every public class and function of the daemons (not helpers nested inside one)
    has a docstring."""
    bare = [f"{module}.{node.name} (line {node.lineno})"
            for module, node, nested in daemon_definitions()
            if not nested and not node.name.startswith("_") and not ast.get_docstring(node)]
    assert not bare, bare
