"""Which implementation of the hot path runs: the C extension ``kvlookup._native`` or pure Python.

The extension (kvlookup/_native.c, built by setup.py when a C compiler is there; optional) does
two things of a /lookup at C speed: the decode of a ``{"tokens": [ints]}`` body
(:func:`decode_tokens`) and the CPython tuple-hash chunk chains of LMCache's builtin profiles and
kvlookup's vLLM plain chain (:func:`chain`, used by kvlookup.hashing). Both give exactly what the
Python code gives; the Python code stays and runs whenever the extension is off.

Setting ``native`` (``KVLOOKUP_NATIVE``, docs/configuration.md): ``auto`` (default: the extension
when it is built and agrees with this interpreter's ``hash()``), ``on`` (the same, but a process
without it refuses to start), ``off`` (pure Python). ``1``/``0`` (true/false, yes/no) mean on/off.
At import the environment variable picks the mode (a bad value reads as ``auto`` until the
settings' validation rejects it); :func:`configure` applies a validated setting.
"""

from __future__ import annotations

import importlib
import os
from array import array
from types import ModuleType
from typing import Any

ENV = "KVLOOKUP_NATIVE"
MODES = ("auto", "on", "off")
_ALIASES = {"1": "on", "true": "on", "yes": "on", "0": "off", "false": "off", "no": "off", "": "auto"}


def _load() -> tuple[ModuleType | None, str]:
    """The extension if it is importable and bit-exact with this interpreter, else (None, why)."""
    try:  # by name: the package itself (kvlookup/__init__.py) imports the client, which imports this
        _native = importlib.import_module("kvlookup._native")
    except ImportError as exc:
        return None, f"kvlookup._native is not built ({exc})"
    if not _agrees(_native):
        return None, "kvlookup._native disagrees with this interpreter's hash() (another tuple hash?)"
    return _native, ""


def _agrees(mod: Any) -> bool:
    """Does ``mod.chain`` give the interpreter's own tuple hashes (signed, large, -1 links)?"""
    tokens = [0, 1, 2**32 - 1, 12345, 256, 7, 2**31]
    for prefix in (0, -1, -2, 2**61 - 1, -(2**63), 2**63 - 1, 2**70 + 3):
        h, want = prefix, []
        for start in range(0, len(tokens), 3):
            h = hash((h, tuple(tokens[start:start + 3]), ()))
            want.append(h)
        if mod.chain(prefix, tokens, 3, True, ()) != want or mod.chain(prefix, array("I", tokens), 3, True, ()) != want:
            return False
    return True


_MODULE, WHY_NOT = _load()
#: The extension in use, or None: pure Python. Read on every call (kvlookup.hashing).
ext: ModuleType | None = None


def normalize_mode(value: Any) -> str:
    """``value`` as one of :data:`MODES`; ValueError ``native: ... is not ...`` otherwise."""
    text = str(value).strip().lower() if isinstance(value, (str, bool, int)) else None
    if isinstance(value, bool):
        text = "on" if value else "off"
    mode = _ALIASES.get(text, text) if text is not None else None
    if mode not in MODES:
        raise ValueError(f"native: {value!r} is not one of auto, on, off (or 1/0)")
    return mode


def configure(mode: str) -> ModuleType | None:
    """Use the extension per ``mode`` (auto | on | off, see :func:`normalize_mode`); returns it or
    None. RuntimeError for ``on`` when it cannot be used (not built, or not bit-exact)."""
    global ext
    mode = normalize_mode(mode)
    if mode == "on" and _MODULE is None:
        raise RuntimeError(f"native: on, but {WHY_NOT}; build it (pip install needs a C compiler) or set "
                           "native: auto / off")
    ext = None if mode == "off" else _MODULE
    return ext


def available() -> bool:
    """Is the extension built and bit-exact here (whatever the mode)?"""
    return _MODULE is not None


def _from_env() -> None:
    try:
        configure(os.environ.get(ENV, "auto"))
    except (ValueError, RuntimeError):
        configure("auto")  # the settings' validation says what is wrong, at startup


_from_env()
