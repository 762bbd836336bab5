"""/lookup/explain and ``kvlookup explain`` through gunicorn, on traffic of the real LMCache 0.5.6
engine hashed with chunk_size 512 while the controller uses 256 (KVLOOKUP_LMCACHE_PYTHON)."""

from __future__ import annotations

import json
import subprocess
import sys

from kvlookup.hashing.lmcache import HashProfile
from tests.compat.test_lmcache_real import (  # noqa: F401  (the fixture)
    S600,
    fleet,
    pytestmark,  # noqa: F401
)
from tests.support.helpers import wait_for
from tests.support.procs import ROOT

H256 = HashProfile().chunk_hashes(S600)


def test_real_engine_with_chunk_size_512_is_named(fleet):  # noqa: F811
    ctrl, worker = fleet
    a = worker("inst-512", "--chunk-size", "512")
    a.op(op="store", tokens=S600)

    def explain():
        return ctrl.session.post(ctrl.http + "/lookup/explain", json={"tokens": S600}, timeout=10).json()

    out = wait_for(lambda: explain()["profiles"] != [], True, timeout=15) and explain()
    assert out["answer"].keys() == {"event_id"}
    assert out["profiles"] == [{"chunk_size": 512, "setting": "hash.chunk_size: 512",
                                "instances": {"inst-512": {"chunks": 2, "tokens": 600}}}]
    assert out["diagnosis"] == ["instance inst-512 stores chunk_size 512; this controller uses chunk_size 256: "
                                "set hash.chunk_size: 512"]
    assert out["cause"] == "profile_mismatch_suspected"
    cli = [sys.executable, "-m", "kvlookup", "explain", "--url", ctrl.http]
    raw = subprocess.run([*cli, "--json"], input=json.dumps(S600), capture_output=True, text=True, cwd=ROOT,
                         timeout=60)
    assert raw.returncode == 0 and json.loads(raw.stdout)["diagnosis"] == out["diagnosis"]
    table = subprocess.run([*cli, ",".join(map(str, S600))], capture_output=True, text=True, cwd=ROOT, timeout=60,
                           env={"COLUMNS": "200", "PATH": "/usr/bin:/bin"})
    assert table.returncode == 0, table.stderr
    assert "- instance inst-512 stores chunk_size 512; this controller uses chunk_size 256: set hash.chunk_size: 512" \
        in table.stdout
    assert "hash_profile" in table.stdout
    assert a.close()["rc"] == 0
    # deregistered on exit: chunk 0's holder is named as gone until its records are purged, or nothing is left
    after = explain()
    assert after["profiles"] == [] or after["instances"][0]["stop"]["reason"] == "deregistered"
