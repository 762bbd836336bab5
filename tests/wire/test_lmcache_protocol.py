"""Byte-exact LMCache encodings of both eras, and lenient decoding.

0.5.6 hex strings were captured from the real LMCache 0.5.6 worker and controller
(re-encoded byte for byte with LMCache's own classes). Era 0.3 frames are checked against
an independent encoder (msgpack with ordered maps), fields in LMCache 0.3.7 declaration order.
"""

from __future__ import annotations

import msgpack
import msgspec
import pytest

from kvlookup.devtools.workersim import WorkerSim
from kvlookup.wire import lmcache as proto
from kvlookup.wire.errors import WireError
from tests.conftest import SEED_HASH

REGISTER_056 = ("86a474797065ab52656769737465724d7367ab696e7374616e63655f6964a6696e73742d61a9776f726b65725f69"
                "6400a26970a93132372e302e302e31a4706f7274cd1f41ad706565725f696e69745f75726cc0")
ADMIT_056 = ("85a474797065b5426174636865644b564f7065726174696f6e4d7367ab696e7374616e63655f6964a6696e73742d61a977"
             "6f726b65725f696400a86c6f636174696f6eaf4c6f63616c4350554261636b656e64aa6f7065726174696f6e739183a76f"
             "705f74797065a561646d6974a36b6579cf411718f2993f541fa77365715f6e756d00")
EVICT_NEG_056 = ("85a474797065b5426174636865644b564f7065726174696f6e4d7367ab696e7374616e63655f6964a6696e73742d61"
                 "a9776f726b65725f696400a86c6f636174696f6eaf4c6f63616c4350554261636b656e64aa6f7065726174696f6e73"
                 "9183a76f705f74797065a56576696374a36b6579d3c8e482f9c26b8896a77365715f6e756d04")
DEREGISTER_056 = ("85a474797065ad446552656769737465724d7367ab696e7374616e63655f6964a6696e73742d61a9776f726b65725f"
                  "696400a26970a93132372e302e302e31a4706f7274cd1f41")
REGISTER_RET_EMPTY = "82a474797065ae52656769737465725265744d7367ac65787472615f636f6e66696780"
REGISTER_RET_HB = ("82a474797065ae52656769737465725265744d7367ac65787472615f636f6e66696781ad6865617274626561745f"
                   "75726cae3132372e302e302e313a38353030")
HEARTBEAT_RET_EMPTY = "82a474797065af4865617274626561745265744d7367a8636f6d6d616e647390"
HEARTBEAT_RET_SYNC = ("82a474797065af4865617274626561745265744d7367a8636f6d6d616e64739183ac636f6d6d616e645f74797065"
                      "a966756c6c5f73796e63a6726561736f6eb2636f6e74726f6c6c65725f72657374617274a461726773c0")
FULL_SYNC_START_RET = ("84a474797065b346756c6c53796e6353746172745265744d7367a773796e635f6964b1696e73742d615f305f30"
                       "30303030303030a86163636570746564c3a96572726f725f6d7367c0")
FULL_SYNC_STATUS_RET = ("86a474797065b446756c6c53796e635374617475735265744d7367a773796e635f6964b268622d696e73745f30"
                        "5f3264316666316463ab69735f636f6d706c657465c3af676c6f62616c5f70726f6772657373cb3ff00000000000"
                        "00af63616e5f657869745f667265657a65c3af6d697373696e675f6261746368657390")
FULL_SYNC_BATCH_056 = ("87a474797065b046756c6c53796e6342617463684d7367ab696e7374616e63655f6964a6696e73742d61a9776f72"
                       "6b65725f696400a86c6f636174696f6eaf4c6f63616c4350554261636b656e64a773796e635f6964b1696e73742d"
                       "615f305f3030303030303030a862617463685f696400a46b65797391cf411718f2993f541f")
ERROR = "82a474797065a84572726f724d7367a56572726f72a178"


def test_056_worker_messages_byte_exact():
    assert proto.encode(proto.RegisterMsg("inst-a", 0, "127.0.0.1", 8001, None)).hex() == REGISTER_056
    ops = [proto.OpEvent("admit", SEED_HASH, 0)]
    assert proto.encode(proto.BatchedKVOperationMsg("inst-a", 0, "LocalCPUBackend", ops)).hex() == ADMIT_056
    ops = [proto.OpEvent("evict", -3970904962213640042, 4)]
    assert proto.encode(proto.BatchedKVOperationMsg("inst-a", 0, "LocalCPUBackend", ops)).hex() == EVICT_NEG_056
    assert proto.encode(proto.DeRegisterMsg("inst-a", 0, "127.0.0.1", 8001)).hex() == DEREGISTER_056
    batch = proto.FullSyncBatchMsg("inst-a", 0, "LocalCPUBackend", "inst-a_0_00000000", 0, [SEED_HASH])
    assert proto.encode(batch).hex() == FULL_SYNC_BATCH_056


def test_056_controller_replies_byte_exact():
    assert proto.encode(proto.RegisterRetMsg()).hex() == REGISTER_RET_EMPTY
    assert proto.encode(proto.RegisterRetMsg(extra_config={"heartbeat_url": "127.0.0.1:8500"})).hex() == REGISTER_RET_HB
    assert proto.encode(proto.HeartbeatRetMsg()).hex() == HEARTBEAT_RET_EMPTY
    sync = proto.HeartbeatRetMsg(commands=[proto.FullSyncCommand(reason="controller_restart")])
    assert proto.encode(sync).hex() == HEARTBEAT_RET_SYNC
    assert proto.encode(proto.FullSyncStartRetMsg("inst-a_0_00000000", True)).hex() == FULL_SYNC_START_RET
    status = proto.FullSyncStatusRetMsg("hb-inst_0_2d1ff1dc", True, 1.0, True)
    assert proto.encode(status).hex() == FULL_SYNC_STATUS_RET
    assert proto.encode(proto.ErrorMsg("x")).hex() == ERROR


def _ordered(*pairs) -> bytes:
    return msgpack.packb(dict(pairs))


def test_03_worker_messages_byte_exact():
    register = _ordered(("type", "RegisterMsg"), ("instance_id", "lmcache_default_instance"), ("worker_id", 0),
                        ("ip", "127.0.0.1"), ("port", 8001), ("distributed_url", "localhost:8200"))
    got = proto.encode(proto.RegisterMsgV3("lmcache_default_instance", 0, "127.0.0.1", 8001, "localhost:8200"))
    assert got == register
    admit = _ordered(("type", "KVAdmitMsg"), ("instance_id", "lmcache_default_instance"), ("worker_id", 0),
                     ("key", -6790629623545678562), ("location", "LocalCPUBackend"))
    got = proto.encode(proto.KVAdmitMsg("lmcache_default_instance", 0, -6790629623545678562, "LocalCPUBackend"))
    assert got == admit
    evict = _ordered(("type", "KVEvictMsg"), ("instance_id", "i"), ("worker_id", 1), ("key", SEED_HASH),
                     ("location", "LocalDiskBackend"))
    assert proto.encode(proto.KVEvictMsg("i", 1, SEED_HASH, "LocalDiskBackend")) == evict


@pytest.mark.parametrize(("hexstr", "tag", "fields"), [
    (REGISTER_056, "RegisterMsg", {"instance_id": "inst-a", "worker_id": 0, "ip": "127.0.0.1", "port": 8001,
                                   "peer_init_url": None, "distributed_url": None}),
    (DEREGISTER_056, "DeRegisterMsg", {"instance_id": "inst-a", "worker_id": 0, "ip": "127.0.0.1", "port": 8001}),
    (FULL_SYNC_BATCH_056, "FullSyncBatchMsg", {"sync_id": "inst-a_0_00000000", "batch_id": 0, "keys": [SEED_HASH]}),
])
def test_decode_real_056_frames(hexstr, tag, fields):
    got_tag, msg = proto.decode_frame(bytes.fromhex(hexstr))
    assert got_tag == tag
    assert {k: getattr(msg, k) for k in fields} == fields


def test_decode_batched_ops_and_json_frames():
    tag, msg = proto.decode_frame(bytes.fromhex(EVICT_NEG_056))
    assert (tag, msg.location, [(o.op_type, o.key, o.seq_num) for o in msg.operations]) == (
        "BatchedKVOperationMsg", "LocalCPUBackend", [("evict", -3970904962213640042, 4)])
    frame = (b'{"type":"KVAdmitMsg","instance_id":"i","worker_id":0,'
             b'"key":"61c2b0ee121bc0763dbbeea739151226a766c47730c3a57bb614a91f1734493d","location":"LocalCPUBackend"}')
    tag, msg = proto.decode_frame(frame)
    assert (tag, msg.key) == ("KVAdmitMsg", "61c2b0ee121bc0763dbbeea739151226a766c47730c3a57bb614a91f1734493d")


def _batched(ops, **fields) -> bytes:
    msg = {"type": "BatchedKVOperationMsg", "instance_id": "i", "worker_id": 3, "location": "LocalCPUBackend",
           "operations": [{"op_type": t, "key": k, "seq_num": n} for n, (t, k) in enumerate(ops)]}
    return msgpack.packb({**msg, **fields})


def test_batched_frames_decode_alike_on_the_typed_path_and_the_generic_one():
    """decode_frame reads BatchedKVOperationMsg frames with a typed decoder; what it returns is what
    the generic decode-then-convert gives (int and hex keys, the extremes of the 64-bit range)."""
    ops = [("admit", -(1 << 63)), ("evict", (1 << 64) - 1), ("admit", "61c2b0ee"), ("admit", SEED_HASH)]
    frame = _batched(ops)
    tag, msg = proto.decode_frame(frame)
    generic = msgspec.convert(msgspec.msgpack.decode(frame), proto.BatchedKVOperation)
    assert (tag, msg) == ("BatchedKVOperationMsg", generic)
    assert [(o.op_type, o.key, o.seq_num) for o in msg.operations] == [(t, k, n) for n, (t, k) in enumerate(ops)]
    assert (msg.instance_id, msg.worker_id, msg.location) == ("i", 3, "LocalCPUBackend")


@pytest.mark.parametrize(("frame", "reason"), [
    (_batched([("admit", "../x")]), "invalid_key"),
    (_batched([("bogus", 1)]), "invalid_fields"),  # the typed decode refuses; the generic path names why
    (_batched([("admit", 1)], worker_id="0"), "invalid_fields"),
    (_batched([("admit", 1)], instance_id=""), "invalid_fields"),
    (_batched([("admit", 1)], type="KVAdmitMsg"), "invalid_fields"),  # the tag decides, not the fields
])
def test_batched_frames_are_refused_as_before(frame, reason):
    with pytest.raises(WireError) as info:
        proto.decode_frame(frame)
    assert info.value.reason == reason


@pytest.mark.parametrize(("frame", "reason"), [
    (b"GET / HTTP/1.1\r\n\r\n", "undecodable"),
    (b"{not json", "undecodable"),
    (b"\xff\xfe\xfd", "undecodable"),
    (msgpack.packb([1, 2, 3]), "not_a_map"),
    (msgpack.packb({"type": "Nope"}), "unknown_type"),
    (msgpack.packb({"instance_id": "i"}), "unknown_type"),
    (msgpack.packb({"type": "KVAdmitMsg", "instance_id": "i", "worker_id": "0", "key": 1, "location": "L"}),
     "invalid_fields"),
    (msgpack.packb({"type": "KVAdmitMsg", "instance_id": "i", "worker_id": 0, "key": "../x", "location": "L"}),
     "invalid_key"),
    (msgpack.packb({"type": "KVAdmitMsg", "instance_id": "", "worker_id": 0, "key": 1, "location": "L"}),
     "invalid_fields"),
    (msgpack.packb({"type": "RegisterMsg", "instance_id": "i", "worker_id": -1}), "invalid_fields"),
])
def test_decode_rejects_with_reason(frame, reason):
    with pytest.raises(WireError) as info:
        proto.decode_frame(frame)
    assert info.value.reason == reason


def test_workersim_sends_exact_frames(monkeypatch):
    sent: list = []
    w = WorkerSim("inst-a", era="0.5", pull_url="127.0.0.1:1", reply_url="127.0.0.1:2")
    monkeypatch.setattr(w.push, "send_multipart", sent.append)
    w.admit([SEED_HASH])
    w.evict([-3970904962213640042, 1])
    assert sent[0] == [bytes.fromhex(ADMIT_056)]
    _, second = proto.decode_frame(sent[1][0])
    assert [(o.op_type, o.key, o.seq_num) for o in second.operations] == [
        ("evict", -3970904962213640042, 1), ("evict", 1, 2)]
    w.close()
