"""Issue 20 item 10: ``allowed_instance_ids`` on the owning sidecar protects its instances.

Before, a second sidecar with an empty list (the controller's embedded one too) took any
peer's messages for them: a RegisterMsg there retired the instance's records (a new epoch) and
took it over, a DeRegisterMsg or evicts wiped it. Now a sidecar claims the instances its list
names (keys.claims_key) and every other sidecar refuses messages for them while the claimer's
lease holds; once the claimer is gone (kill -9, lease lapsed), another sidecar may take the
instance over. Real sidecar processes, real ZMQ, real Redis.
"""

from __future__ import annotations

import time

import zmq
from msgspec import msgpack

from kvlookup.index import keys
from kvlookup.proc.redis_server import free_port
from kvlookup.wire import lmcache as proto
from tests.support.helpers import wait_for
from tests.support.procs import SidecarProc

CPU = "LocalCPUBackend"
HASHES = [101, 102, 103]
CLAIMED = ("instance 'prot' belongs to sidecar 'A' (its allowed_instance_ids names it); this sidecar takes no "
           "writes for it while that sidecar runs")


def _request(reply_url: str, msg) -> dict:
    sock = zmq.Context.instance().socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 10_000)
    sock.connect(f"tcp://{reply_url}")
    try:
        sock.send(proto.encode(msg))
        return msgpack.decode(sock.recv())
    finally:
        sock.close()


def _push(pull_url: str, *msgs) -> None:
    sock = zmq.Context.instance().socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 5000)
    sock.connect(f"tcp://{pull_url}")
    sock.send_multipart([proto.encode(m) for m in msgs])
    sock.close()


def _sidecar(redis_args, sid: str, *args: str) -> SidecarProc:
    pull, reply = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    return SidecarProc(*redis_args, "--sidecar-id", sid, *args, pull_url=pull, reply_url=reply).start()


def _records(r, inst: str) -> int:
    holder = r.hget(keys.worker_key(inst, 0), f"loc:{CPU}")
    return int(r.hget(keys.records_key(), holder) or 0) if holder else 0


def test_a_claimed_instance_cannot_be_wiped_retired_or_taken_over_through_another_sidecar(r, redis_args):
    a = _sidecar(redis_args, "A", "--allowed-instance-ids", "prot")
    b = _sidecar(redis_args, "B")  # an empty list: any instance
    try:
        assert r.hget(keys.claims_key(), "prot") == "A"
        assert _request(a.reply_url, proto.RegisterMsg("prot", 0, "127.0.0.1", 0, None))["type"] == "RegisterRetMsg"
        _push(a.pull_url, *[proto.KVAdmitMsg("prot", 0, h, CPU) for h in HASHES])
        assert wait_for(lambda: _records(r, "prot"), len(HASHES)) == len(HASHES)
        holder = r.hget(keys.worker_key("prot", 0), f"loc:{CPU}")

        refused = _request(b.reply_url, proto.RegisterMsg("prot", 0, "127.0.0.1", 0, None))
        assert refused == {"type": "ErrorMsg", "error": CLAIMED}
        _push(b.pull_url, proto.KVEvictMsg("prot", 0, HASHES[0], CPU), proto.DeRegisterMsg("prot", 0, "127.0.0.1", 0))
        metric = 'kvlookup_rejected_frames_total{reason="instance_claimed",source="lmcache"} 3.0'
        assert wait_for(lambda: metric in b.metrics(), True)
        time.sleep(0.5)  # B's loop wrote whatever it was going to
        assert r.hget(keys.worker_key("prot", 0), "epoch") == "1"
        assert r.hget(keys.worker_key("prot", 0), f"loc:{CPU}") == holder
        assert r.hget(keys.owners_key(), "prot") == "A"
        assert _records(r, "prot") == len(HASHES)
        # an unclaimed instance still registers through B
        assert _request(b.reply_url, proto.RegisterMsg("free", 0, "127.0.0.1", 0, None))["type"] == "RegisterRetMsg"

        a.kill()  # the claimer is gone: once its lease lapses (5 s) the instance may move
        start = time.monotonic()
        again = proto.RegisterMsg("prot", 0, "127.0.0.1", 0, None)
        assert wait_for(lambda: _request(b.reply_url, again)["type"], "RegisterRetMsg", timeout=20) == "RegisterRetMsg"
        print(f"taken over {time.monotonic() - start:.1f} s after the claimer's kill -9")
        assert r.hget(keys.owners_key(), "prot") == "B"
    finally:
        a.kill()
        b.stop()
