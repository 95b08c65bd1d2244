"""A phase's state changes only through its own methods (``fl_server/phase.py``): no other
module of the server assigns, augments, deletes or mutates in place a field of a
``Phase`` or of one of its ``Task``s. Then "who closes a phase, who may drop a task" is
answered by the callers of ``Phase.close`` and ``Phase.drop`` alone.

The scan is of the source, by AST: an expression is a phase when it is a name or
attribute called ``phase`` / ``*_phase``, one annotated ``Phase`` (an argument, or an
attribute declared ``self.x: Phase | None``); a task likewise with ``task`` / ``Task``.
A write is ``x.field = ...``, ``x.field += ...``, ``x.field[k] = ...``, ``del x.field``,
``del x.field[k]``, ``setattr(x, ...)`` or ``x.field.<mutating method>(...)``.
"""

from __future__ import annotations

import ast
import dataclasses
import re
from pathlib import Path

from fl_server.phase import Phase, Task

SERVER = Path(__file__).resolve().parent.parent / "fl_server"
OWNER = SERVER / "phase.py"
MUTATORS = {"pop", "popitem", "clear", "update", "setdefault", "append", "extend", "insert",
            "remove", "discard", "add", "set", "sort", "reverse", "__setitem__",
            "__delitem__"}
KINDS = {  # what a name looks like, its class name, the fields nobody else may write
    "phase": (re.compile(r"(^|_)phase$"), "Phase", {f.name for f in dataclasses.fields(Phase)}),
    "task": (re.compile(r"(^|_)task$"), "Task", {f.name for f in dataclasses.fields(Task)}),
}


def _names(node: ast.AST) -> str:
    return node.id if isinstance(node, ast.Name) else (
        node.attr if isinstance(node, ast.Attribute) else "")


def _typed(annotation: ast.AST | None, cls: str) -> bool:
    return annotation is not None and re.search(rf"\b{cls}\b", ast.unparse(annotation)) is not None


class Writes(ast.NodeVisitor):
    """Every write of a Phase or Task field in one module, as (line, text)."""

    def __init__(self, tree: ast.Module):
        self.found: list[tuple[int, str]] = []
        # Names and attributes declared as a Phase or Task anywhere in the module.
        self.declared: dict[str, set[str]] = {kind: set() for kind in KINDS}
        for node in ast.walk(tree):
            pairs = []
            if isinstance(node, ast.arg):
                pairs = [(node.arg, node.annotation)]
            elif isinstance(node, ast.AnnAssign):
                pairs = [(_names(node.target), node.annotation)]
            for name, annotation in pairs:
                for kind, (_, cls, _) in KINDS.items():
                    if name and _typed(annotation, cls):
                        self.declared[kind].add(name)

    def kind_of(self, node: ast.AST) -> str | None:
        name = _names(node)
        for kind, (pattern, _, _) in KINDS.items():
            if name and (pattern.search(name) or name in self.declared[kind]):
                return kind
        return None

    def field_write(self, target: ast.AST, node: ast.AST) -> None:
        """``target`` is written: report it when it is a field of a phase or task, or an
        item of one (``x.field[k]``)."""
        while isinstance(target, ast.Subscript):
            target = target.value
        if isinstance(target, ast.Attribute):
            kind = self.kind_of(target.value)
            if kind is not None and target.attr in KINDS[kind][2]:
                self.found.append((node.lineno, ast.unparse(node).splitlines()[0]))

    def visit_Assign(self, node: ast.Assign) -> None:
        for target in node.targets:
            for part in (target.elts if isinstance(target, ast.Tuple) else [target]):
                self.field_write(part, node)
        self.generic_visit(node)

    def visit_AugAssign(self, node: ast.AugAssign) -> None:
        self.field_write(node.target, node)
        self.generic_visit(node)

    def visit_AnnAssign(self, node: ast.AnnAssign) -> None:
        if node.value is not None:
            self.field_write(node.target, node)
        self.generic_visit(node)

    def visit_Delete(self, node: ast.Delete) -> None:
        for target in node.targets:
            self.field_write(target, node)
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        func = node.func
        if isinstance(func, ast.Name) and func.id in ("setattr", "delattr") and node.args:
            if self.kind_of(node.args[0]) is not None:
                self.found.append((node.lineno, ast.unparse(node)))
        elif isinstance(func, ast.Attribute) and func.attr in MUTATORS:
            self.field_write(func.value, node)
        self.generic_visit(node)


def writes(source: str) -> list[tuple[int, str]]:
    tree = ast.parse(source)
    visitor = Writes(tree)
    visitor.visit(tree)
    return visitor.found


def test_no_module_outside_phase_py_writes_a_phase_field():
    found = []
    for path in sorted(SERVER.rglob("*.py")):
        if path != OWNER:
            found += [f"{path.relative_to(SERVER.parent)}:{line}: {text}"
                      for line, text in writes(path.read_text())]
    assert not found, "Phase/Task fields written outside fl_server/phase.py:\n" + "\n".join(found)


def test_the_scan_sees_every_kind_of_write():
    """The scan is not blind: each form of write of a phase or task field is found, and
    a read, a method call and a write of another object's ``phase`` attribute are not."""
    source = '''
def f(phase, admission, p: Phase, t: Task, err, task):
    phase.closed = True
    phase.dropped[edge] = "why"
    admission.phase.received.pop(edge, None)
    p.tainted += "x"
    phase.closed, phase.closed_why = True, "why"
    phase.closing.set()
    del phase.personal[edge]
    setattr(phase, "closed", True)
    t.delivered = True
    task.delivered = True
    self.current: Phase | None = None
    self.current.growing = True
    # not writes of a field:
    phase.drop(edge, "why")
    phase.maybe_close()
    err.phase = phase
    x = phase.dropped.get(edge)
    phase.closing.wait()
'''
    # Line 13 declares an attribute of ``self`` as a phase: that is no write of a field.
    assert sorted({line for line, _ in writes(source)}) == [*range(3, 13), 14]
