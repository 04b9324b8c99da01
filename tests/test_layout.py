"""The library's shape: no import cycle, a JAX-free host core, small files, docs that name real paths, ruff clean."""

from __future__ import annotations

import ast
import os
import re
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("model", "pallas_kernels", "sharding", "serving", "checkpoints")
MAX_LINES = 520  # "about 500": a file past this is split by what it holds


def _modules() -> dict[str, str]:
    """module name -> file path, for every library module."""
    out = {}
    for pkg in PACKAGES:
        for dirpath, _, files in os.walk(os.path.join(ROOT, pkg)):
            for f in files:
                if f.endswith(".py"):
                    rel = os.path.relpath(os.path.join(dirpath, f), ROOT)[:-3].replace(os.sep, ".")
                    out[rel.removesuffix(".__init__")] = os.path.join(dirpath, f)
    return out


def _imports(path: str, modules: dict[str, str]) -> set[str]:
    """Library modules that `path` imports, at any depth of the file (lazy imports count: they are edges too)."""
    tree = ast.parse(open(path, encoding="utf-8").read())
    found = set()
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        for n in names:
            while n and n not in modules:
                n = n.rpartition(".")[0]
            if n:
                found.add(n)
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    graph = {}
    for name, path in modules.items():
        deps = _imports(path, modules) - {name}
        # A package __init__ is imported by its submodules implicitly; it must not import them back (cycle).
        graph[name] = {d for d in deps if not name.startswith(d + ".")}
    return graph


def test_no_import_cycle():
    graph = _graph()
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n):
        state[n] = 1
        stack.append(n)
        for d in sorted(graph.get(n, ())):
            if state.get(d) == 1:
                cycle = stack[stack.index(d) :] + [d]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if d not in state:
                visit(d)
        stack.pop()
        state[n] = 2

    for n in sorted(graph):
        if n not in state:
            visit(n)


def test_cycle_detector_finds_a_cycle(monkeypatch):
    """The detector itself can fail (a test that cannot fail proves nothing)."""
    fake = {"a": {"b"}, "b": {"c"}, "c": {"a"}}
    monkeypatch.setattr(sys.modules[__name__], "_graph", lambda: fake)
    with pytest.raises(pytest.fail.Exception, match="a -> b -> c -> a"):
        test_no_import_cycle()


def test_host_core_imports_no_jax():
    """serving/core is pure Python: importing all of it in a fresh interpreter loads neither jax nor numpy-heavy
    device code."""
    mods = [m for m in _modules() if m.startswith("serving.core")]
    code = "import sys\n" + "".join(f"import {m}\n" for m in mods)
    code += "bad = [m for m in ('jax', 'jaxlib', 'flax') if m in sys.modules]\nassert not bad, bad\n"
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_library_files_are_small():
    big = []
    for path in _modules().values():
        n = sum(1 for _ in open(path, encoding="utf-8"))
        if n > MAX_LINES:
            big.append(f"{os.path.relpath(path, ROOT)}: {n} lines")
    assert not big, "split these files by what they hold: " + ", ".join(big)


_PATH_RE = re.compile(r"(?<![\w./-])((?:[\w-]+/)+[\w.-]+\.(?:py|md|toml|txt|json|sh)|(?:[\w-]+/)+)(?![\w/-])")
_TOP = (
    "model/",
    "pallas_kernels/",
    "sharding/",
    "serving/",
    "checkpoints/",
    "benchmarks/",
    "tests/",
    "tools/",
    "docs/",
    "scripts/",
    "examples/",
)


def _named_paths(text: str) -> set[str]:
    return {m for m in _PATH_RE.findall(text) if m.startswith(_TOP)}


@pytest.mark.parametrize("doc", ["README.md", "docs/ARCHITECTURE.md"])
def test_docs_name_existing_paths(doc):
    text = open(os.path.join(ROOT, doc), encoding="utf-8").read()
    missing = sorted(p for p in _named_paths(text) if not os.path.exists(os.path.join(ROOT, p)))
    assert not missing, f"{doc} names paths that do not exist: {missing}"


def test_path_scanner_sees_paths():
    assert _named_paths("see serving/core/scheduler.py and model/ but not http://x/y.py") >= {
        "serving/core/scheduler.py",
        "model/",
    }


@pytest.mark.skipif(
    shutil.which("ruff") is None and not os.path.exists(os.path.join(ROOT, ".venv/bin/ruff")),
    reason="ruff is installed by the dev extra",
)
@pytest.mark.parametrize("args", [["check", "."], ["format", "--check", "."]])
def test_ruff_clean(args):
    ruff = shutil.which("ruff") or os.path.join(ROOT, ".venv/bin/ruff")
    proc = subprocess.run([ruff, *args], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
