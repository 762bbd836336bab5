"""One copy of each test harness class: no class name is defined in more than one module
under tests/ (module level, inside classes, or local to a function: ast walk of every file).

A second ``Engine`` or ``SidecarProc`` is how the harness drifted before (issue 17): give the
one in tests/support/ a parameter instead, or name the new concept differently."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def class_homes() -> dict[str, set[str]]:
    """Class name -> the modules under tests/ (paths relative to it) that define it."""
    homes: dict[str, set[str]] = defaultdict(set)
    for path in sorted(TESTS.rglob("*.py")):
        if "__pycache__" in path.parts:
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ClassDef):
                homes[node.name].add(str(path.relative_to(TESTS)))
    return homes


def test_every_class_name_is_defined_in_one_module():
    twice = {name: sorted(mods) for name, mods in class_homes().items() if len(mods) > 1}
    assert twice == {}


def test_the_walk_sees_the_harness():
    homes = class_homes()
    assert homes["Engine"] == {"support/engines.py"}
    assert homes["SidecarProc"] == homes["ControllerProc"] == {"support/procs.py"}
    assert homes["Answer"] == homes["Lookups"] == {"support/lookups.py"}
