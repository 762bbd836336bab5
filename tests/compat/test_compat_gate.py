"""tests/compat/gate.py: a skipped compatibility test says why on pytest's summary line, and
under KVLOOKUP_REAL_PEERS=1 (CI) it fails the run. Checked on a one-test suite in a subprocess."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SUITE = '''
import pytest

@pytest.mark.lmcache
@pytest.mark.skipif(True, reason="no peer here")
def test_needs_a_peer():
    pass

def test_plain():
    pass
'''


def run_suite(tmp_path, real_peers: str | None) -> subprocess.CompletedProcess:
    (tmp_path / "test_suite.py").write_text(SUITE)
    env = {k: v for k, v in os.environ.items() if k != "KVLOOKUP_REAL_PEERS"}
    if real_peers is not None:
        env["KVLOOKUP_REAL_PEERS"] = real_peers
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "tests.compat.gate", "-p", "no:cacheprovider",
                           "-o", "markers=lmcache", "--rootdir", str(tmp_path), "-c", os.devnull,
                           str(tmp_path / "test_suite.py")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)


def test_a_compat_skip_names_its_reason_on_the_summary_line(tmp_path):
    out = run_suite(tmp_path, None)
    assert out.returncode == 0, out.stdout + out.stderr
    summary = out.stdout.strip().splitlines()[-1]
    assert summary.startswith("1 passed, 1 skipped (no peer here) in "), summary
    assert "KVLOOKUP_REAL_PEERS=1 bash scripts/test.sh" in out.stdout


def test_a_compat_skip_fails_the_run_under_real_peers(tmp_path):
    out = run_suite(tmp_path, "1")
    assert out.returncode == 1, out.stdout + out.stderr
    assert ("compatibility test skipped although KVLOOKUP_REAL_PEERS=1 (scripts/real-peers.sh ran?): no peer here"
            in out.stdout)
    assert out.stdout.strip().splitlines()[-1].startswith("1 passed, 1 error in ")
