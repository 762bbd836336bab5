"""What ``pip install .`` alone (the Dockerfile) gives must run: every runtime import is declared,
and the built wheel, installed without extras into a fresh venv, serves /health and /lookup."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from importlib.metadata import packages_distributions, requires

import pytest

from tests.support.procs import ROOT

RUNTIME_PACKAGES = ("kvlookup", "app", "sidecar")


def _optional(tree: ast.AST) -> set[int]:
    """ids of import nodes inside ``try: ... except ImportError`` (optional features)."""
    out: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Try) and any(
            isinstance(h.type, ast.Name) and h.type.id in ("ImportError", "ModuleNotFoundError")
            for h in node.handlers
        ):
            out |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
    return out


def _third_party_imports() -> dict[str, str]:
    """Top-level module -> a file importing it unconditionally, for the runtime packages."""
    found: dict[str, str] = {}
    for package in RUNTIME_PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            tree = ast.parse(path.read_text())
            optional = _optional(tree)
            for node in ast.walk(tree):
                if id(node) in optional:
                    continue
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                else:
                    continue
                for name in names:
                    top = name.split(".")[0]
                    if top not in sys.stdlib_module_names and top not in (*RUNTIME_PACKAGES, "bench", "__future__"):
                        found.setdefault(top, str(path.relative_to(ROOT)))
    return found


def test_every_runtime_import_is_a_declared_dependency():
    declared = {re.split(r"[<>=!~;\[ ]", r, maxsplit=1)[0].lower().replace("_", "-")
                for r in requires("kvlookup") or [] if "extra ==" not in r}
    providers = packages_distributions()
    missing = {}
    for module, where in _third_party_imports().items():
        dists = {d.lower().replace("_", "-") for d in providers.get(module, [module])}
        if not dists & declared:
            missing[module] = where
    assert missing == {}, f"imported at runtime but not in [project].dependencies: {missing}"
    assert "packaging" in declared  # gunicorn's gevent worker imports it without declaring it


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("KVLOOKUP_SMOKE_INSTALL_DONE") == "1",
                    reason=".ci/run already ran scripts/smoke-install.sh before the suite")
def test_the_wheel_installed_without_extras_serves_lookups():
    done = subprocess.run(["bash", str(ROOT / "scripts" / "smoke-install.sh")], capture_output=True, text=True,
                          timeout=600, env={**os.environ, "PYTHON": sys.executable})
    print(done.stdout)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert "smoke: /lookup" in done.stdout and '"lmcache_default_instance": ["LocalCPUBackend", 12]' in done.stdout
