"""Issue 20 item 7: a poison string cannot break the fleet.

A TAB in a vLLM ``medium`` used to corrupt the holder description
(``<inst>\\t<rank>\\t<location>\\t<space>``): every ``/lookup/explain`` answered 500, the purge
failed on it ~10x/s forever and standalone sidecars' ``/health`` stayed 503. Now every
engine-controlled string is checked where it arrives (no control character, at most 256
characters), a description cannot be written ambiguously, and the loops that read descriptions
skip and count one they cannot parse (one written by an older version).
"""

from __future__ import annotations

import time

import msgspec
import pytest
import requests

from kvlookup.index import keys
from kvlookup.index.store import ADMIT, Store
from kvlookup.proc.redis_server import free_port
from kvlookup.wire import lmcache as proto
from kvlookup.wire import vllm as vw
from kvlookup.wire.errors import WireError
from tests.conftest import SEED_HASH, SEED_TOKENS
from tests.support.procs import ControllerProc, SidecarProc

#: Every C0 control character (TAB included), DEL, a C1 control (NEL) and a line separator.
POISON = [chr(i) for i in range(0x20)] + ["\x7f", "\x85", "\u2028"]


@pytest.mark.parametrize("field", ["medium", "lora_name"])
def test_every_control_character_in_a_vllm_string_is_refused_at_the_edge(field):
    for c in POISON:
        ev = {"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None, "token_ids": list(range(16)),
              "block_size": 16, "lora_id": None, "medium": "GPU", "lora_name": None, field: f"GP{c}U"}
        good = {**ev, field: "GPU"}
        batch = vw.decode_batch(msgspec.msgpack.encode([1.0, [ev, good], 0]))
        assert isinstance(batch.events[0], vw.Malformed), repr(c)
        assert "printable" in batch.events[0].detail
        assert getattr(batch.events[1], field) == "GPU"  # the rest of the batch is kept
    long = {"type": "BlockRemoved", "block_hashes": [1], "medium": "G" * 257}
    assert isinstance(vw.decode_event(long), vw.Malformed)


@pytest.mark.parametrize("field", ["instance_id", "location"])
def test_every_control_character_in_an_lmcache_string_is_refused_at_the_edge(field):
    for c in POISON:
        op = {"type": "KVAdmitMsg", "instance_id": "inst", "worker_id": 0, "key": 7, "location": "cpu",
              field: f"a{c}b"}
        with pytest.raises(WireError, match="printable"):
            proto.decode_frame(msgspec.json.encode(op))


def test_a_description_cannot_be_written_ambiguously():
    for c in POISON:
        with pytest.raises(ValueError, match="printable"):
            keys.holder_value("inst", 0, f"GPU{c}X", "v16")
    assert keys.parse_holder(keys.holder_value("inst", 0, "GPU", "v16")) == ("inst", "0", "GPU", "v16")
    with pytest.raises(ValueError, match="unparsable"):
        keys.parse_holder("inst\t0\tGPU\tX\tv16")
    assert keys.holder_space("inst\t0\tGPU\tX\tv16") == "v16"


@pytest.mark.single_node
def test_a_poisoned_description_already_in_redis_breaks_nothing(r, redis_url):
    """A description written by an older version with a TAB in its location: explain answers 200
    (skipping it), and a standalone sidecar purges its records once it is retired, its /health
    200 throughout. (Before: explain 500 everywhere, purge raising every turn, /health 503.)"""
    store = Store(r, instance_ttl_s=0, purge_grace_s=0)
    for inst in ("good", "poisoned"):
        store.register_worker(inst, 0, "127.0.0.1", 0)
        store.apply([(inst, 0, "LocalCPUBackend", [(ADMIT, SEED_HASH)])])
    hid = r.hget(keys.worker_key("poisoned", 0), keys.location_field("LocalCPUBackend"))
    r.hset(keys.holders_key(), hid, "poisoned\t0\tGPU\tX\t")  # what the old code wrote for medium "GPU\tX"
    ctl = ControllerProc("--redis-url", redis_url, "--instance-ttl", "0").wait_ready()
    side = None
    try:
        resp = ctl.session.post(f"{ctl.http}/lookup/explain", json={"tokens": SEED_TOKENS}, timeout=10)
        assert resp.status_code == 200, resp.text
        assert "good" in {e["instance_id"] for e in resp.json()["instances"]}
        store.deregister_worker("poisoned", 0)  # retired: the purge must get through it
        side = SidecarProc("--redis-url", redis_url, "--instance-ttl", "0",
                           pull_url=f"tcp://127.0.0.1:{free_port()}").start()
        deadline = time.monotonic() + 10
        while r.hexists(keys.holders_key(), hid) and time.monotonic() < deadline:
            assert requests.get(f"http://127.0.0.1:{side.metrics_port}/health", timeout=2).status_code == 200
            time.sleep(0.1)
        assert not r.hexists(keys.holders_key(), hid)
        assert r.zrange(keys.chunk_key(SEED_HASH), 0, -1) == [
            r.hget(keys.worker_key("good", 0), keys.location_field("LocalCPUBackend"))]
        assert requests.get(f"http://127.0.0.1:{side.metrics_port}/health", timeout=2).status_code == 200
        resp = ctl.session.post(f"{ctl.http}/lookup/explain", json={"tokens": SEED_TOKENS}, timeout=10)
        assert resp.status_code == 200
    finally:
        ctl.stop()
        if side is not None:
            side.kill()
