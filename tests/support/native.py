"""Run a test under each implementation of the hot path (kvlookup.native): ``python`` and ``native``.

The ``impl`` fixture (tests/conftest.py) sets the mode for the test's process and, through
``KVLOOKUP_NATIVE``, for the controllers it starts. ``native`` is skipped, with the reason, when the
C extension is not built, except where the run promises it (``KVLOOKUP_REAL_PEERS=1``, as in CI, or
``KVLOOKUP_REQUIRE_NATIVE=1``): there a missing extension fails the test.
"""

from __future__ import annotations

import os

import pytest

from kvlookup import native

IMPLS = ("python", "native")


def required() -> bool:
    """Must the extension be there (CI builds it)?"""
    return os.environ.get("KVLOOKUP_REAL_PEERS") == "1" or os.environ.get("KVLOOKUP_REQUIRE_NATIVE") == "1"


def use(impl: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Switch this process (and the processes it starts) to ``impl``; skip or fail as above."""
    if impl == "native" and not native.available():
        message = f"the C extension is not in use: {native.WHY_NOT}"
        if required():
            pytest.fail(f"{message} (KVLOOKUP_REAL_PEERS=1 / KVLOOKUP_REQUIRE_NATIVE=1 need it built)")
        pytest.skip(message)
    monkeypatch.setenv(native.ENV, "on" if impl == "native" else "off")  # create_app and child processes
    monkeypatch.setattr(native, "ext", native._MODULE if impl == "native" else None)  # undone after the test
