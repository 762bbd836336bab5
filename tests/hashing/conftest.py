"""Every hashing test runs under both implementations of the chains (kvlookup.native)."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _both_impls(impl):
    return impl
