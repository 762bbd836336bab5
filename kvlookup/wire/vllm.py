"""Decode vLLM's KV cache event payloads (no sockets, no Redis here).

vLLM (``vllm/distributed/kv_events.py``) sends one msgpack ``KVEventBatch`` per ZMQ message.
Its shape changed across versions (docs/vllm-events.md §2, fixtures in
tests/fixtures/vllm/). vLLM's own two encodings (an array batch of tagged positional events, or
of maps under ``"type"``) are decoded by msgspec into the event structs (:func:`decode_typed`,
~5x faster); anything else is read generically, level by level, with the same result:

- batch: an array ``[ts, events, data_parallel_rank?]`` or a map with those keys;
- event: a positional array ``["BlockStored", block_hashes, parent_block_hash, token_ids,
  block_size, lora_id, medium, lora_name, extra_keys, group_idx, ...]`` (vLLM <= 0.25) or a map
  with ``"type"`` (0.25+); missing trailing fields read as None, unknown extra fields are ignored;
- block hash: msgpack uint64, a negative int64 (relays), or bytes (``VLLM_KV_EVENTS_USE_INT_
  BLOCK_HASHES=0``), all normalised to the unsigned low 64 bits, big-endian for bytes, exactly
  as vLLM's ``maybe_convert_block_hash`` does.

:func:`decode_batch` raises :class:`WireError` when the batch itself is unreadable; a bad
event inside a readable batch becomes a :class:`Malformed` entry, so the others still apply.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Any

import msgspec

from kvlookup.index import keys
from kvlookup.wire.errors import WireError

U64_MASK = (1 << 64) - 1

STORED_FIELDS = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
                 "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind", "kv_cache_spec_sliding_window",
                 "locality", "ownership", "session_id", "lookahead_token_ids")
REMOVED_FIELDS = ("block_hashes", "medium", "group_idx", "locality", "ownership")
BATCH_FIELDS = ("ts", "events", "data_parallel_rank")


if TYPE_CHECKING:  # what the fields hold once decode_batch returns them
    _Hash = int
    _Token = int
    _Tokens = tuple[int, ...]
else:  # what the typed decode takes: a u64 (msgpack ints end at 2**64 - 1) or bytes to reduce
    # (the generic path, ``block_hash``, reads the other forms); a token_ids of nil becomes ()
    _Hash = Annotated[int, msgspec.Meta(ge=0)] | bytes
    _Token = Annotated[int, msgspec.Meta(ge=0)]
    _Tokens = tuple[_Token, ...] | None


class BlockStored(msgspec.Struct, frozen=True, tag_field="type", tag="BlockStored"):
    """Blocks cached by one engine: hashes are u64; token_ids is empty for offloading stores.

    block_size: tokens per block (None when the event omits it). medium: None means GPU.
    extra_keys: one entry per block (tuple or None), or None when absent.
    group_idx: the KV cache group (hybrid models); kv_cache_spec_kind / _sliding_window: that
    group's kind (``"full_attention"``, ``"sliding_window"``, ``"mamba"``, ...) and window in
    tokens, annotated on stores only (vLLM 0.26+). locality: ``"LOCAL"``/``"REMOTE"`` tier
    relative to the engine; ownership: the secondary tier that made the event (``"kvcr"``);
    session_id: the request context that stored or reused the block (0.33+).
    lookahead_token_ids: per block, the tokens after it that its hash covers (EAGLE block
    drop, 0.33+), or None.

    A msgspec struct shaped as vLLM 0.25+'s map form (``{"type": "BlockStored", ...}``), so
    :func:`decode_batch`'s typed path decodes such events straight into it; the field types'
    constraints apply there only (the generic path checks the same itself).
    """

    block_hashes: tuple[_Hash, ...]
    parent_block_hash: _Hash | None
    token_ids: _Tokens
    block_size: int | None
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: tuple | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: tuple[tuple[_Token, ...], ...] | None = None


class BlockRemoved(msgspec.Struct, frozen=True, tag_field="type", tag="BlockRemoved"):
    """Blocks evicted from ``medium`` (None means GPU) of KV cache group ``group_idx``."""

    block_hashes: tuple[_Hash, ...]
    medium: str | None = None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(msgspec.Struct, frozen=True, tag_field="type", tag="AllBlocksCleared"):
    """The engine dropped its whole prefix cache (``reset_prefix_cache``)."""


@dataclass(frozen=True)
class Malformed:
    """An event that could not be read. reason: metric label; detail: for the log."""

    reason: str
    detail: str


Event = BlockStored | BlockRemoved | AllBlocksCleared | Malformed


@dataclass(frozen=True)
class EventBatch:
    """One published batch. ts: unix seconds; data_parallel_rank: None when absent."""

    ts: float
    events: tuple[Event, ...]
    data_parallel_rank: int | None = None


def decode_batch(payload: bytes) -> EventBatch:
    """Decode one msgpack payload (the third frame of a live message, or a replay reply).

    The typed path first (:func:`decode_typed`: vLLM's own shapes, decoded by msgspec into the
    event structs); anything it does not take goes the generic way, field by field, with the
    same result. Raises WireError (reasons ``msgpack``, ``batch_shape``) when the batch is
    unreadable.
    """
    typed = decode_typed(payload)
    return typed if typed is not None else decode_generic(payload)


def decode_generic(payload: bytes) -> EventBatch:
    """:func:`decode_batch` without the typed path: every level read field by field (any shape
    of docs/vllm-events.md §2). Raises WireError as :func:`decode_batch` does."""
    try:
        raw = msgspec.msgpack.decode(payload)
    except msgspec.DecodeError as exc:
        raise WireError("msgpack", f"payload is not msgpack: {exc}") from None
    ts, events, rank = _fields(raw, BATCH_FIELDS)
    if not isinstance(events, list) or not isinstance(ts, (int, float)) or isinstance(ts, bool):
        raise WireError("batch_shape", f"not a KV event batch: {type(raw).__name__}")
    if rank is not None and (not isinstance(rank, int) or isinstance(rank, bool)):
        raise WireError("batch_shape", f"data_parallel_rank is {rank!r}")
    return EventBatch(float(ts), tuple(decode_event(e) for e in events), rank)


def decode_event(raw: Any) -> Event:
    """Decode one generic event (array or map); never raises: bad input gives Malformed."""
    try:
        return _decode_event(raw)
    except (TypeError, ValueError) as exc:
        return Malformed("event_shape", str(exc))


def _decode_event(raw: Any) -> Event:
    body: list[Any] | dict[str, Any]
    if isinstance(raw, list) and raw and isinstance(raw[0], str):
        tag, body = raw[0], raw[1:]
    elif isinstance(raw, dict) and isinstance(raw.get("type"), str):
        tag, body = raw["type"], raw
    else:
        return Malformed("event_shape", f"event is neither a tagged array nor a typed map: {raw!r:.80}")
    if tag == "BlockStored":
        (hashes, parent, tokens, block_size, lora_id, medium, lora_name, extra_keys, group_idx, kind, window,
         locality, ownership, session_id, lookahead) = _fields(body, STORED_FIELDS)
        return BlockStored(
            block_hashes=_hashes(hashes), parent_block_hash=None if parent is None else block_hash(parent),
            token_ids=_ints(tokens or [], "token_ids"), block_size=_opt_int(block_size, "block_size"),
            lora_id=_opt_int(lora_id, "lora_id"), medium=_opt_str(medium, "medium"),
            lora_name=_opt_str(lora_name, "lora_name"), extra_keys=_extra_keys(extra_keys),
            group_idx=_opt_int(group_idx, "group_idx"), kv_cache_spec_kind=_opt_str(kind, "kv_cache_spec_kind"),
            kv_cache_spec_sliding_window=_opt_int(window, "kv_cache_spec_sliding_window"),
            locality=_opt_str(locality, "locality"), ownership=_opt_str(ownership, "ownership"),
            session_id=_opt_str(session_id, "session_id"), lookahead_token_ids=_lookahead(lookahead))
    if tag == "BlockRemoved":
        hashes, medium, group_idx, locality, ownership = _fields(body, REMOVED_FIELDS)
        return BlockRemoved(_hashes(hashes), _opt_str(medium, "medium"), _opt_int(group_idx, "group_idx"),
                            _opt_str(locality, "locality"), _opt_str(ownership, "ownership"))
    if tag == "AllBlocksCleared":
        return AllBlocksCleared()
    return Malformed("unknown_type", f"unknown event type {tag!r}")


def _fields(raw: Any, names: tuple[str, ...]) -> list[Any]:
    """Values of ``names`` from a positional array or a map; missing ones are None."""
    if isinstance(raw, list):
        return [raw[i] if i < len(raw) else None for i in range(len(names))]
    if isinstance(raw, dict):
        return [raw.get(n) for n in names]
    raise WireError("batch_shape", f"expected an array or a map, got {type(raw).__name__}")


def block_hash(value: Any) -> int:
    """vLLM's external block hash as an unsigned 64-bit int.

    int: u64 as is, negative i64 wrapped; bytes: the low 64 bits big-endian (the last 8 bytes,
    like ``maybe_convert_block_hash``). Raises ValueError otherwise.
    """
    if isinstance(value, bool):
        raise ValueError(f"block hash {value!r} is not an int or bytes")
    if isinstance(value, int):
        if not -(1 << 63) <= value <= U64_MASK:
            raise ValueError(f"block hash {value} does not fit 64 bits")
        return value & U64_MASK
    if isinstance(value, (bytes, bytearray, memoryview)) and len(value) > 0:
        return int.from_bytes(bytes(value)[-8:], "big")
    raise ValueError(f"block hash {value!r:.40} is not an int or bytes")


def _hashes(value: Any) -> tuple[int, ...]:
    if not isinstance(value, list):
        raise ValueError(f"block_hashes is {type(value).__name__}, not a list")
    return tuple(block_hash(h) for h in value)


def _ints(value: Any, name: str) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(type(t) is int and t >= 0 for t in value):
        raise ValueError(f"{name} must be a list of non-negative ints")
    return tuple(value)


def _opt_int(value: Any, name: str) -> int | None:
    if value is None or (type(value) is int):
        return value
    raise ValueError(f"{name} must be an int, got {value!r:.40}")


def _opt_str(value: Any, name: str) -> str | None:
    """None, or a name the index can store (keys.printable_name: no TAB or other control
    character, at most keys.MAX_NAME characters); ValueError otherwise."""
    if value is None:
        return value
    if not isinstance(value, str):
        raise ValueError(f"{name} must be a string, got {value!r:.40}")
    if not keys.printable_name(value):
        raise ValueError(f"{name} must be 1..{keys.MAX_NAME} printable characters, got {value!r:.60}")
    return value


def _lookahead(value: Any) -> tuple[tuple[int, ...], ...] | None:
    if value is None:
        return None
    if not isinstance(value, list):
        raise ValueError("lookahead_token_ids must be a list (one token list per block)")
    return tuple(_ints(v, "lookahead_token_ids[i]") for v in value)


def _extra_keys(value: Any) -> tuple | None:
    if value is None:
        return None
    if not isinstance(value, list):
        raise ValueError("extra_keys must be a list (one entry per block)")
    return tuple(_freeze(v) for v in value)


def _freeze(value: Any) -> Any:
    """Lists (msgpack arrays) become tuples so extra keys are hashable and comparable."""
    if isinstance(value, list):
        return tuple(_freeze(v) for v in value)
    return value


# -- typed path -------------------------------------------------------------------------------
# vLLM encodes its events with msgspec (``KVCacheEvent``: tagged, ``array_like=True`` up to 0.25,
# tagged maps under ``"type"`` since), its batch as an array ``[ts, events, rank]``. Both forms
# decode here in C into structs; a batch the structs do not take (a map batch, a relay's negative
# hashes, an unknown event type, a bad field) returns None and goes the generic way, which then
# reports exactly what is wrong with which event.


def _positional(cls: type) -> Any:
    """``cls`` (an event struct) in vLLM's positional form: the same fields in the same order
    (``STORED_FIELDS`` for BlockStored), every one after the first optional, so trailing ones
    may be missing; extra ones are ignored."""
    fields = [(f.name, f.type, None) if i else (f.name, f.type)
              for i, f in enumerate(msgspec.structs.fields(cls))]
    return msgspec.defstruct(f"_Array{cls.__name__}", fields, array_like=True, tag=cls.__name__)


_ArrayStored = _positional(BlockStored)
_ArrayRemoved = _positional(BlockRemoved)


class _ArrayCleared(msgspec.Struct, array_like=True, tag="AllBlocksCleared"):
    pass


class _MapBatch(msgspec.Struct, array_like=True):
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


class _ArrayBatch(msgspec.Struct, array_like=True):
    ts: float
    events: list[_ArrayStored | _ArrayRemoved | _ArrayCleared]  # type: ignore[valid-type]  # built by _positional
    data_parallel_rank: int | None = None


_DECODERS: list[msgspec.msgpack.Decoder[Any]] = [msgspec.msgpack.Decoder(_MapBatch),
                                                 msgspec.msgpack.Decoder(_ArrayBatch)]
_CLEARED = AllBlocksCleared()
_astuple = msgspec.structs.astuple
_replace = msgspec.structs.replace


def decode_typed(payload: bytes) -> EventBatch | None:
    """The batch decoded by the typed path, or None when it is not one of vLLM's own shapes
    (:func:`decode_batch` then reads it generically). Never raises."""
    for i, dec in enumerate(_DECODERS):
        try:
            batch = dec.decode(payload)
        except (msgspec.DecodeError, msgspec.ValidationError):
            continue
        if i:  # the form that answered is tried first next time
            _DECODERS.insert(0, _DECODERS.pop(i))
        events = [_checked(e) for e in batch.events]
        if None in events:
            return None
        return EventBatch(batch.ts, tuple(events), batch.data_parallel_rank)  # type: ignore[arg-type]
    return None


def _checked(ev: Any) -> Event | None:
    """A typed event as the generic path makes it (names checked, bytes hashes reduced, lists
    frozen), or None when the generic path would find something wrong with it."""
    t = type(ev)
    if t is _ArrayStored:
        ev, t = BlockStored(*_astuple(ev)), BlockStored
    elif t is _ArrayRemoved:
        ev, t = BlockRemoved(*_astuple(ev)), BlockRemoved
    elif t is _ArrayCleared or t is AllBlocksCleared:
        return _CLEARED
    stored = t is BlockStored
    for name in (ev.medium, ev.lora_name, ev.kv_cache_spec_kind, ev.locality, ev.ownership, ev.session_id) \
            if stored else (ev.medium, ev.locality, ev.ownership):
        if name is not None and name not in _GOOD_NAMES:
            if not keys.printable_name(name):
                return None
            if len(_GOOD_NAMES) < _GOOD_NAMES_MAX:
                _GOOD_NAMES.add(name)
    fix: dict[str, Any] = {}
    try:
        if not all(map(_is_int, ev.block_hashes)):
            fix["block_hashes"] = _hashes(list(ev.block_hashes))
        if stored:
            if type(ev.parent_block_hash) is bytes:
                fix["parent_block_hash"] = block_hash(ev.parent_block_hash)
            if ev.token_ids is None:
                fix["token_ids"] = ()
            if ev.extra_keys is not None:
                fix["extra_keys"] = _extra_keys(list(ev.extra_keys))
    except ValueError:  # an empty bytes hash: the generic path makes it Malformed
        return None
    return _replace(ev, **fix) if fix else ev


#: Names already found printable (media, group kinds: a handful per engine), not checked again.
_GOOD_NAMES: set[str] = set()
_GOOD_NAMES_MAX = 1024
_is_int = int.__instancecheck__  # typed hashes are int or bytes (never bool)


#: The 8-byte seq of a replay terminator (vLLM sends -1 as a signed big-endian int).
REPLAY_END = -1


def parse_live(frames: list[bytes]) -> tuple[bytes, int, bytes]:
    """A live PUB message ``[topic, seq (8-byte big-endian), payload]`` -> (topic, seq, payload).

    Raises WireError (reason ``frames``) on any other shape.
    """
    if len(frames) != 3 or len(frames[1]) != 8:
        raise WireError("frames", f"live message has {len(frames)} frame(s), not [topic, seq8, payload]")
    return frames[0], int.from_bytes(frames[1], "big"), frames[2]


def parse_replay(frames: list[bytes]) -> tuple[int, bytes]:
    """A replay reply seen by a DEALER -> (seq, payload); seq is :data:`REPLAY_END` at the end.

    Accepts ``[b"", seq8, payload]`` (vLLM <= 0.25) and ``[b"", topic, seq8, payload]`` (0.26+).
    Raises WireError (reason ``replay_frames``) on any other shape.
    """
    if len(frames) not in (3, 4) or frames[0] != b"" or len(frames[-2]) != 8:
        raise WireError("replay_frames", f"replay reply of {len(frames)} frame(s) has an unknown shape")
    return int.from_bytes(frames[-2], "big", signed=True), frames[-1]
