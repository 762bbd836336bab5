"""The architecture, checked: the import graph of kvlookup has no cycle (imports inside
functions count too), nothing in kvlookup/ imports the app, sidecar or bench wings at module
level, no service imports devtools, and nothing imports the old top-level names."""

from __future__ import annotations

import ast
import os
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[2] / "kvlookup"
WINGS_ABOVE_CORE = ("kvlookup.app", "kvlookup.sidecar", "kvlookup.bench", "kvlookup.cli", "kvlookup.__main__")
SERVICES = ("kvlookup.app", "kvlookup.sidecar", "kvlookup.index", "kvlookup.wire", "kvlookup.hashing",
            "kvlookup.proc", "kvlookup.config", "kvlookup.client", "kvlookup.metrics",
            "kvlookup.netpolicy", "kvlookup.kinds")


def _modules() -> dict[str, Path]:
    out = {}
    paths = [Path(d) / f for d, _, files in os.walk(PKG, followlinks=True) for f in files if f.endswith(".py")]
    for path in paths:  # the links kvlookup/app -> ../app etc. followed
        parts = ("kvlookup", *path.relative_to(PKG).with_suffix("").parts)
        if "__pycache__" in parts or "results" in parts:
            continue
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


MODULES = _modules()


def _within(name: str, wings: tuple[str, ...]) -> bool:
    return any(name == w or name.startswith(w + ".") for w in wings)


def _imports(name: str) -> list[tuple[str, bool]]:
    """(imported module, at module level) for every import statement of ``name``."""
    tree = ast.parse(MODULES[name].read_text())
    top = {id(n) for n in tree.body}
    top |= {id(n) for stmt in tree.body if isinstance(stmt, (ast.If, ast.Try)) for n in ast.walk(stmt)}
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, id(node) in top) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            for a in node.names:
                full = f"{node.module}.{a.name}"
                out.append((full if full in MODULES else node.module, id(node) in top))
    return out


def _graph() -> dict[str, set[str]]:
    return {m: {d for d, _ in _imports(m) if d in MODULES and d != m} for m in MODULES}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for d in sorted(graph[m]):
            if state.get(d) == 1:
                return stack[stack.index(d):] + [d]
            if d not in state and (found := visit(d)):
                return found
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (found := visit(m)):
            return found
    return None


def test_modules_are_found():
    assert {"kvlookup.index.store", "kvlookup.app.lookup", "kvlookup.sidecar.service", "kvlookup.cli"} <= set(MODULES)


def test_no_import_cycle_hidden_or_not():
    assert _cycle(_graph()) is None


@pytest.mark.parametrize("name", sorted(m for m in MODULES if not _within(m, WINGS_ABOVE_CORE)))
def test_core_never_imports_app_sidecar_or_bench_at_module_level(name):
    bad = [d for d, top in _imports(name) if top and _within(d, WINGS_ABOVE_CORE)]
    assert not bad, f"{name} imports {bad} at module level"


@pytest.mark.parametrize("name", sorted(m for m in MODULES if _within(m, SERVICES)))
def test_services_never_import_devtools(name):
    assert not [d for d, _ in _imports(name) if _within(d, ("kvlookup.devtools",))]


def test_nothing_imports_top_level_app_sidecar_or_bench():
    bad = [(m, d) for m in MODULES for d, _ in _imports(m) if d.split(".")[0] in ("app", "sidecar", "bench")]
    assert not bad


def test_top_level_stays_small():
    top = sorted(p.name for p in PKG.glob("*.py"))
    assert len(top) <= 12, top
