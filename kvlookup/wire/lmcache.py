"""LMCache worker <-> controller messages: lenient decoding and exact encodings.

LMCache encodes every message as a msgspec Struct tagged by ``"type"`` (the class name),
as a msgpack map (or a JSON object) with every field in declaration order. Field names and
order below are facts from LMCache 0.3.x and 0.5.6 (docs/lmcache-protocol.md §2).

Decoding accepts every era at once: a frame is JSON when it starts with ``{``, msgpack
otherwise; the ``"type"`` tag picks a lenient target struct whose era-specific fields are
optional. Anything else raises :class:`WireError` with a short reason, for counting.
"""

from __future__ import annotations

import re
from typing import Any, Literal

import msgspec

from kvlookup.wire.errors import WireError

# -- decoding targets (lenient: era-specific fields optional, unknown fields ignored) -------

ChunkKey = int | str


class Register(msgspec.Struct):
    """RegisterMsg / HeartbeatMsg: distributed_url (0.3.3-0.3.9) or peer_init_url (0.3.12+)."""

    instance_id: str
    worker_id: int
    ip: str = ""
    port: int = 0
    distributed_url: str | None = None
    peer_init_url: str | None = None


class DeRegister(msgspec.Struct):
    instance_id: str
    worker_id: int
    ip: str = ""
    port: int = 0


class KVOp(msgspec.Struct):
    """KVAdmitMsg / KVEvictMsg (0.3.x; str keys in 0.3.0-0.3.2) and KVOperationMsg."""

    instance_id: str
    worker_id: int
    key: ChunkKey
    location: str
    seq_num: int = 0


class KVOpEvent(msgspec.Struct):
    op_type: Literal["admit", "evict"]
    key: ChunkKey
    seq_num: int = 0


class BatchedKVOperation(msgspec.Struct):
    instance_id: str
    worker_id: int
    location: str
    operations: list[KVOpEvent]


class FullSyncStart(msgspec.Struct):
    instance_id: str
    worker_id: int
    location: str
    sync_id: str
    total_keys: int = 0
    batch_count: int = 0


class FullSyncBatch(msgspec.Struct):
    instance_id: str
    worker_id: int
    location: str
    sync_id: str
    batch_id: int
    keys: list[ChunkKey]


class FullSyncEnd(msgspec.Struct):
    instance_id: str
    worker_id: int
    location: str
    sync_id: str
    actual_total_keys: int = 0


class FullSyncStatus(msgspec.Struct):
    instance_id: str
    worker_id: int
    sync_id: str


class BatchedP2PLookup(msgspec.Struct):
    hashes: list[int]
    instance_id: str
    worker_id: int


#: tag -> (target struct, operation kind for KVOp)
DECODE_TARGETS: dict[str, type] = {
    "RegisterMsg": Register,
    "HeartbeatMsg": Register,
    "DeRegisterMsg": DeRegister,
    "KVAdmitMsg": KVOp,
    "KVEvictMsg": KVOp,
    "BatchedKVOperationMsg": BatchedKVOperation,
    "FullSyncStartMsg": FullSyncStart,
    "FullSyncBatchMsg": FullSyncBatch,
    "FullSyncEndMsg": FullSyncEnd,
    "FullSyncStatusMsg": FullSyncStatus,
    "BatchedP2PLookupMsg": BatchedP2PLookup,
}

MAX_NAME = 256
_HEX_KEY = re.compile(r"[0-9a-f]{1,64}")


_json = msgspec.json.Decoder()
_msgpack = msgspec.msgpack.Decoder()


class _IntKeyOpEvent(msgspec.Struct):
    """A :class:`KVOpEvent` whose key decoded as a msgpack integer (so within the 64-bit range
    ``_check`` asks for: msgpack has no other integers)."""

    op_type: Literal["admit", "evict"]
    key: int
    seq_num: int = 0


class _BatchedFrame(msgspec.Struct):
    """A ``BatchedKVOperationMsg`` frame as sent (its tag a field), decoded straight into structs:
    the hot message (LMCache's every admit and evict) skips the generic decode to dicts and the
    convert, 5-8x the cost (docs/benchmarks-notes.md "Ingest, issue 18"). Integer keys only (what
    LMCache 0.5 sends): their range needs no check an op; any other frame goes the generic way."""

    type: str
    instance_id: str
    worker_id: int
    location: str
    operations: list[_IntKeyOpEvent]


_batched = msgspec.msgpack.Decoder(_BatchedFrame)


def _decode_batched(frame: bytes) -> BatchedKVOperation | None:
    """The frame as a BatchedKVOperation when it is a valid one, else None (the generic path
    then decodes it, with its errors)."""
    try:
        f = _batched.decode(frame)
    except (msgspec.DecodeError, msgspec.ValidationError, UnicodeDecodeError, ValueError, RecursionError):
        return None
    if f.type != "BatchedKVOperationMsg":
        return None
    return BatchedKVOperation(f.instance_id, f.worker_id, f.location, f.operations)  # type: ignore[arg-type]


def decode_frame(frame: bytes) -> tuple[str, Any]:
    """Decode one worker frame into ``(tag, message)``.

    frame: msgpack map or JSON object bytes with a ``"type"`` tag. Returns the tag and an
    instance of its target struct. Raises WireError(reason) with reason one of
    ``undecodable``, ``not_a_map``, ``unknown_type``, ``invalid_fields``, ``invalid_key``.
    """
    if frame[:1] != b"{" and (batched := _decode_batched(frame)) is not None:
        _check_fields("BatchedKVOperationMsg", batched)  # its keys are msgpack integers: 64-bit
        return "BatchedKVOperationMsg", batched
    try:
        raw = _json.decode(frame) if frame[:1] == b"{" else _msgpack.decode(frame)
    except (msgspec.DecodeError, UnicodeDecodeError, ValueError) as exc:
        raise WireError("undecodable", str(exc)[:200]) from None
    except RecursionError:
        raise WireError("undecodable", "nested too deeply") from None
    if not isinstance(raw, dict):
        raise WireError("not_a_map", f"expected a map with 'type', got {type(raw).__name__}")
    tag = raw.get("type")
    target = DECODE_TARGETS.get(tag) if isinstance(tag, str) else None
    if target is None:
        raise WireError("unknown_type", f"unknown message type {str(tag)[:80]!r}")
    assert isinstance(tag, str)  # a target is found for string tags only
    try:
        msg: Any = msgspec.convert(raw, target)
    except msgspec.ValidationError as exc:
        raise WireError("invalid_fields", f"{tag}: {exc}"[:300]) from None
    except RecursionError:
        raise WireError("invalid_fields", f"{tag}: nested too deeply") from None
    _check(tag, msg)
    return tag, msg


def _check(tag: str, msg: Any) -> None:
    """Reject names, addresses and keys that cannot be stored or used faithfully."""
    _check_fields(tag, msg)
    _check_keys(tag, msg)


def _check_fields(tag: str, msg: Any) -> None:
    """Reject names and addresses that cannot be stored or used faithfully."""
    for name in ("instance_id", "location"):
        value = getattr(msg, name, None)
        if value is not None and not (0 < len(value) <= MAX_NAME and value.isprintable()):
            raise WireError("invalid_fields", f"{tag}: {name} must be 1..{MAX_NAME} printable characters")
    worker_id = getattr(msg, "worker_id", 0)
    if not 0 <= worker_id < 1 << 31:
        raise WireError("invalid_fields", f"{tag}: worker_id {worker_id} out of range")
    port = getattr(msg, "port", 0)
    if not 0 <= port < 65536:
        raise WireError("invalid_fields", f"{tag}: port {port} out of range 0..65535")
    for name in ("ip", "distributed_url", "peer_init_url"):
        value = getattr(msg, name, None)
        if value is not None and not (len(value) <= MAX_NAME and value.isprintable() and " " not in value):
            raise WireError("invalid_fields", f"{tag}: {name} must be a host or URL of at most {MAX_NAME} characters")


def _check_keys(tag: str, msg: Any) -> None:
    """Reject keys that cannot be stored or used faithfully."""
    keys: list = []
    if isinstance(msg, KVOp):
        keys = [msg.key]
    elif isinstance(msg, BatchedKVOperation):
        keys = [op.key for op in msg.operations]
    elif isinstance(msg, FullSyncBatch):
        keys = msg.keys
    if _all_int64(keys):
        return
    for key in keys:
        if isinstance(key, int) and not -(1 << 63) <= key < 1 << 64:
            raise WireError("invalid_key", f"{tag}: chunk key {str(key)[:40]} is outside the 64-bit range")
        if isinstance(key, str) and not _HEX_KEY.fullmatch(key):
            raise WireError("invalid_key", f"{tag}: chunk key {key[:80]!r} is neither an int nor a hex digest")


def _all_int64(keys: list) -> bool:
    """Are all keys ints within the 64-bit range? (the common case, checked in C: min and max;
    False for an empty list or any other key, which the per-key checks then judge)."""
    try:
        return bool(keys) and all(type(k) is int for k in keys) and -(1 << 63) <= min(keys) and max(keys) < 1 << 64
    except TypeError:
        return False


# -- exact encodings (what LMCache itself sends and expects) ---------------------------------


class _WorkerV3(msgspec.Struct):
    """Fields of a 0.3.3-0.3.9 worker identity message (RegisterMsg, HeartbeatMsg)."""

    instance_id: str
    worker_id: int
    ip: str
    port: int
    distributed_url: str


class RegisterMsgV3(_WorkerV3, tag="RegisterMsg"):
    """0.3.3-0.3.9 RegisterMsg (PUSH)."""


class HeartbeatMsgV3(_WorkerV3, tag="HeartbeatMsg"):
    """0.3.5-0.3.9 HeartbeatMsg (PUSH); LMCache subclasses RegisterMsg the same way."""


class _KVEvent(msgspec.Struct):
    instance_id: str
    worker_id: int
    key: ChunkKey
    location: str


class KVAdmitMsg(_KVEvent, tag=True):
    """0.3.x: one chunk stored (``key`` is a sha256 hex string in 0.3.0-0.3.2)."""


class KVEvictMsg(_KVEvent, tag=True):
    """0.3.x: one chunk removed."""


class DeRegisterMsg(msgspec.Struct, tag=True):
    instance_id: str
    worker_id: int
    ip: str
    port: int


class _Worker(msgspec.Struct):
    """Fields of a 0.3.12-0.5.6 worker identity message (RegisterMsg, HeartbeatMsg)."""

    instance_id: str
    worker_id: int
    ip: str
    port: int
    peer_init_url: str | None


class RegisterMsg(_Worker, tag=True):
    """0.3.12-0.5.6 RegisterMsg (DEALER -> ROUTER)."""


class HeartbeatMsg(_Worker, tag=True):
    """0.3.12-0.5.6 HeartbeatMsg (DEALER -> heartbeat ROUTER)."""


class OpEvent(msgspec.Struct):
    op_type: str
    key: int
    seq_num: int


class BatchedKVOperationMsg(msgspec.Struct, tag=True):
    instance_id: str
    worker_id: int
    location: str
    operations: list[OpEvent]


class FullSyncStartMsg(msgspec.Struct, tag=True):
    """0.5.x full sync, worker -> controller (DEALER): a sync of one location begins."""

    instance_id: str
    worker_id: int
    location: str
    sync_id: str
    total_keys: int
    batch_count: int


class FullSyncBatchMsg(msgspec.Struct, tag=True):
    """0.5.x full sync (PUSH): one batch of the location's chunk hashes."""

    instance_id: str
    worker_id: int
    location: str
    sync_id: str
    batch_id: int
    keys: list[int]


class FullSyncEndMsg(msgspec.Struct, tag=True):
    instance_id: str
    worker_id: int
    location: str
    sync_id: str
    actual_total_keys: int


class FullSyncStatusMsg(msgspec.Struct, tag=True):
    instance_id: str
    worker_id: int
    sync_id: str


class RegisterRetMsg(msgspec.Struct, tag=True):
    extra_config: dict[str, str] = {}


class FullSyncCommand(msgspec.Struct, tag="full_sync", tag_field="command_type"):
    reason: str | None = None
    args: dict[str, Any] | None = None


class HeartbeatRetMsg(msgspec.Struct, tag=True):
    commands: list[FullSyncCommand] = []


class FullSyncStartRetMsg(msgspec.Struct, tag=True):
    sync_id: str
    accepted: bool
    error_msg: str | None = None


class FullSyncStatusRetMsg(msgspec.Struct, tag=True):
    sync_id: str
    is_complete: bool
    global_progress: float
    can_exit_freeze: bool
    missing_batches: list[int] = []


class BatchedP2PLookupRetMsg(msgspec.Struct, tag=True):
    layout_info: list[tuple[str, str, int, str]]


class ErrorMsg(msgspec.Struct, tag=True):
    error: str


_encoder = msgspec.msgpack.Encoder()


def encode(msg: msgspec.Struct) -> bytes:
    """msgpack bytes of a message, exactly as LMCache's msgspec encoder writes them."""
    return _encoder.encode(msg)

