"""The key seam, checked: ``kvlookup/index/`` is the only place that names a Redis key or holds
Lua. No module of kvlookup/, app/ or sidecar/ outside the index imports ``kvlookup.index.keys``
or a script module (``kvlookup.index.scripts``, ``kvlookup.index.mp_scripts``) at all (inside
functions too); what they need from Redis they ask an index module for."""

from __future__ import annotations

import ast

from tests.architecture.test_imports import MODULES

#: The modules that name keys or hold Lua.
SEAM = ("kvlookup.index.keys", "kvlookup.index.scripts", "kvlookup.index.mp_scripts")
#: Wings outside the rule: benchmarks measure the index's own storage (MEMORY USAGE and
#: encodings of named keys, a registry key's slot), as its tests do.
OUTSIDE = ("kvlookup.bench",)
#: (module, seam module) pairs that use it for something other than a key, with the reason.
ALLOWED = {
    ("kvlookup.wire.vllm", "kvlookup.index.keys"):
        "keys.printable_name: the charset of engine-controlled names the index stores, checked at the wire's edge",
}


def _seam_imports(name: str) -> set[str]:
    """The seam modules ``name`` imports (``import kvlookup.index.keys``, ``from kvlookup.index
    import keys``, ``from kvlookup.index.keys import X``), anywhere in the module."""
    tree = ast.parse(MODULES[name].read_text())
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name in SEAM}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module in SEAM:
                out.add(node.module)
            out |= {f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in SEAM}
    return out


def _outside_index() -> list[str]:
    return sorted(m for m in MODULES if not m.startswith("kvlookup.index")
                  and not any(m == w or m.startswith(w + ".") for w in OUTSIDE))


def test_only_the_index_names_keys():
    found = {(m, s) for m in _outside_index() for s in _seam_imports(m)}
    assert found - set(ALLOWED) == set(), "name the key in kvlookup/index and call it from there"


def test_allow_list_is_current():
    """Each allowed pair is still used (a stale entry would hide a new use)."""
    assert all(s in _seam_imports(m) for m, s in ALLOWED)


def test_the_scan_sees_the_wings():
    """The scan covers app/, sidecar/ and the core (the links are followed), and sees imports."""
    names = _outside_index()
    assert {"kvlookup.app.overview", "kvlookup.sidecar.vllm_apply", "kvlookup.client"} <= set(names)
    assert _seam_imports("kvlookup.index.mp") == {"kvlookup.index.keys"}
    assert _seam_imports("kvlookup.index.mp_registry") == {"kvlookup.index.keys", "kvlookup.index.mp_scripts",
                                                            "kvlookup.index.scripts"}
