"""No module in serving/ reaches into another module's private state (STYLE.md: give the owner a method).

An access `x._name` (x not `self` / `cls`) is private to the module that defines `_name`: it is allowed only where
the accessing module defines `_name` itself (a method, a `self._name` / `obj._name` assignment or a class-level
name), e.g. a classmethod setting up its own instance. `from m import _name` across modules is refused too.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent

# Known until their owners expose them: the model's parameter slots (model/transformer.py) read by the weight
# loaders, and RequestStream._put (serving/api/streams.py) called by the engine thread.
KNOWN = {
    ("serving/engine/quantize.py", "_storage_slots"),
    ("serving/engine/quantize.py", "_param_slots"),
    ("serving/api/async_engine.py", "_put"),
}
# Standard-library functions whose documented public name starts with an underscore.
STDLIB = {("os", "_exit")}
KNOWN_IMPORTS = {("serving/engine/weights.py", "model.transformer", "_param_slots"),
                 ("serving/engine/weights.py", "model.transformer", "_storage_slots")}  # fmt: skip


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _defined(tree: ast.AST) -> set[str]:
    """Private names this module defines: functions, classes, assignment targets (names and attributes)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
    return {n for n in names if _private(n)}


def violations(source: str, path: str) -> list[str]:
    tree = ast.parse(source)
    own = _defined(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            base = node.value
            if isinstance(base, ast.Name) and (base.id in ("self", "cls") or (base.id, node.attr) in STDLIB):
                continue
            if node.attr not in own and (path, node.attr) not in KNOWN:
                found.append(f"{path}:{node.lineno}: {ast.unparse(node)}")
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in ("serving", "model"):
            for alias in node.names:
                if _private(alias.name) and (path, node.module, alias.name) not in KNOWN_IMPORTS:
                    found.append(f"{path}:{node.lineno}: from {node.module} import {alias.name}")
    return found


def test_serving_touches_no_other_modules_private_attributes():
    found = []
    for p in sorted((ROOT / "serving").rglob("*.py")):
        rel = p.relative_to(ROOT).as_posix()
        found += violations(p.read_text(), rel)
    assert not found, "private state reached across modules (give the owner a public method):\n" + "\n".join(found)


@pytest.mark.parametrize(
    "source, bad",
    [
        ("def f(engine):\n    return engine._sample(1)\n", True),
        ("def f(r):\n    return r.runner._width\n", True),
        ("class A:\n    def f(self):\n        return self._x\n", False),
        ("class A:\n    def _x(self):\n        pass\n\n    @classmethod\n    def make(cls):\n        a = cls()\n"
         "        a._x()\n        return a\n", False),
        ("from serving.engine.runner import _chain_tokens\n", True),
        ("class B:\n    def f(self, other):\n        return other._y\n", True),
    ],
)  # fmt: skip
def test_the_rule_flags_cross_module_access(source, bad):
    assert bool(violations(source, "x.py")) == bad
