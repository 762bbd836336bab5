"""Messages of LMCache's multiprocess (MP) coordinator protocol (HTTP/JSON), as msgspec structs.

Source: ``lmcache.v1.mp_coordinator.schemas`` / ``api`` of LMCache 0.5.6 and 0.5.7rc2 (pydantic
there). Field names, defaults and order are the coordinator's; unknown fields are ignored at
every level, as pydantic does. :func:`decode` validates a body: any failure raises
:class:`MPBodyError` (the coordinator answers 422) naming the field as ``$.batches[0].seq``;
nothing of a rejected body is applied.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta, Struct

#: The largest integer kvlookup takes in a field that reaches its Redis scripts (2**53 - 1): Lua
#: numbers are doubles, exact only up to here, and the scripts write them with ``%d`` (beyond
#: int64 a wrong number, or a script error half-way through a request). The coordinator takes any
#: int; no emitter sends more (seqs and incarnations count from 1 or are unix seconds, sizes are
#: bytes): larger is refused (422, naming the field).
MAX_EXACT = 2**53 - 1
#: The largest world size a packed ``kv_rank`` holds (8 bits: kvlookup.hashing.mp.kv_rank); a
#: directory lookup answers one key per rank, so a larger one would only build a huge answer.
MAX_WORLD_SIZE = 255
#: The latest ``ts`` (unix seconds) taken: the scripts keep it in milliseconds, within MAX_EXACT.
MAX_TS = MAX_EXACT / 1000
NonNeg = Annotated[int, Meta(ge=0, le=MAX_EXACT)]
Port = Annotated[int, Meta(ge=1, le=65535)]
EventType = Literal["store", "delete", "access", "config"]
Tier = Literal["l1", "l2"]
#: Characters a ``cache_salt`` may not hold (LMCache ``ObjectKey``), and its longest length.
SALT_FORBIDDEN = ("@", "/", "\\", "\0")
SALT_MAX = 128
#: Characters a batch's ``backend`` may not hold in kvlookup (the coordinator takes any): they
#: separate fields of its placement and capacity values (kvlookup.index.mp_scripts).
BACKEND_FORBIDDEN = ("\t", ",", ";", "\x1e", "\x1f")


class MPBodyError(ValueError):
    """A body the coordinator would refuse (422); ``str()`` names the field and the rule."""


class RegisterRequest(Struct, kw_only=True):
    """``POST /instances``. ``instance_id`` "" -> the coordinator picks ``mp-<uuid4 hex>``;
    ``chunk_size`` (0.5.7) binds the fleet's chunk size (a conflict is 409)."""

    ip: str
    http_port: Port
    instance_id: str = ""
    metadata: dict[str, str] = {}
    p2p_advertised_url: str = ""
    mq_port: Annotated[int, Meta(ge=0, le=65535)] = 0
    chunk_size: Annotated[int, Meta(ge=1, le=MAX_EXACT)] | None = None


class ChunkSizeRequest(Struct):
    """``PUT /config/chunk-size`` (0.5.7): ``{"chunk_size": n}``, n >= 1."""

    chunk_size: Annotated[int, Meta(ge=1, le=MAX_EXACT)]


class EncodedObjectKey(Struct, kw_only=True, gc=False):
    """An MP object key: ``chunk_hash_hex`` (hex of the chunk digest), ``model_name``,
    ``kv_rank`` (packed, :func:`kvlookup.hashing.mp.kv_rank`), ``object_group_id``, ``cache_salt``."""

    chunk_hash_hex: str
    model_name: str
    kv_rank: int
    object_group_id: Annotated[int, Meta(ge=0)] = 0  # text only (a space's name): any size
    cache_salt: str = ""


class CacheEventEntry(Struct, kw_only=True, gc=False):
    """One key of a batch: ``size_bytes`` (store), ``token_ids``/``token_offset`` (store, when known; -1 unknown)."""

    key: EncodedObjectKey
    size_bytes: NonNeg = 0
    token_ids: list[int] = []
    token_offset: Annotated[int, Meta(ge=-1, le=MAX_EXACT)] = -1


class CacheEventBatch(Struct, kw_only=True, gc=False):
    """One batch of one emitter: one event type on one (tier, backend, shared), numbered
    ``(incarnation, seq)``. ``dropped_events`` (0.5.7): events the emitter lost so far."""

    instance_id: Annotated[str, Meta(min_length=1)]
    incarnation: NonNeg
    seq: Annotated[int, Meta(ge=1, le=MAX_EXACT)]
    event_type: EventType
    tier: Tier
    backend: str = ""
    entries: list[CacheEventEntry] = []
    shared: bool = False
    ts: Annotated[float, Meta(ge=0.0, le=MAX_TS)] = 0.0
    capacity_bytes: NonNeg = 0
    capacity_revision: NonNeg = 0
    dropped_events: NonNeg = 0


class CacheEventsRequest(Struct):
    """``POST /events``: ``{"batches": [CacheEventBatch, ...]}``."""

    batches: list[CacheEventBatch] = []


class DirectoryLookupRequest(Struct, kw_only=True):
    """``POST /directory/lookup``: exactly one of ``keys`` or ``token_ids`` (+ ``model_name``)."""

    keys: list[EncodedObjectKey] = []
    token_ids: list[int] = []
    model_name: str | None = None
    world_size: Annotated[int, Meta(ge=1, le=MAX_WORLD_SIZE)] = 1
    cache_salt: str = ""


class BlendLookupRequest(Struct, kw_only=True):
    """``POST /directory/blend-lookup``: ``tokens_b64`` = base64 of little-endian uint32 ids."""

    tokens_b64: str = ""
    model_name: str | None = None
    world_size: Annotated[int, Meta(ge=1, le=MAX_WORLD_SIZE)] = 1
    cache_salt: str = ""


def decode(body: bytes, model: type):
    """``body`` (JSON) as ``model``, checked as the coordinator checks it; MPBodyError otherwise."""
    if not body.strip():
        raise MPBodyError("body is empty (expected a JSON object)")
    try:
        msg: Any = msgspec.json.decode(body, type=model)
    except msgspec.ValidationError as exc:
        raise MPBodyError(str(exc)) from None
    except msgspec.DecodeError as exc:
        raise MPBodyError(f"body is not valid JSON: {exc}") from None
    except RecursionError:
        raise MPBodyError("body is not valid JSON: nested too deeply") from None
    check(msg)
    return msg


def check(msg) -> None:
    """The rules msgspec's types do not carry (hex, salt, model name, per event type)."""
    if isinstance(msg, CacheEventsRequest):
        for i, batch in enumerate(msg.batches):
            _check_batch(batch, f"$.batches[{i}]")
    elif isinstance(msg, DirectoryLookupRequest):
        for i, key in enumerate(msg.keys):
            check_key(key, f"$.keys[{i}]")
    elif isinstance(msg, RegisterRequest):
        msg.instance_id = msg.instance_id.strip()
        msg.ip = msg.ip.strip()
        msg.p2p_advertised_url = msg.p2p_advertised_url.strip()
        if not msg.ip:
            raise MPBodyError("ip must not be blank - at `$.ip`")


def _check_batch(batch: CacheEventBatch, where: str) -> None:
    if not batch.backend and batch.event_type != "access":
        raise MPBodyError(f"backend must be non-empty for {batch.event_type} batches - at `{where}.backend`")
    if any(c in batch.backend for c in BACKEND_FORBIDDEN):
        # kvlookup's own rule: these separate fields in its index (no LMCache adapter name holds them)
        raise MPBodyError(f"backend must not contain tab, ',', ';', \\x1e or \\x1f - at `{where}.backend`")
    if batch.event_type == "config" and batch.entries:
        raise MPBodyError(f"config batches declare capacity and carry no entries - at `{where}.entries`")
    if _plain(batch.entries, where):
        return
    checked: set[tuple[str, str]] = set()  # (model_name, cache_salt) pairs found valid
    for j, entry in enumerate(batch.entries):
        key = entry.key
        if (key.model_name, key.cache_salt) in checked:
            try:
                bytes.fromhex(key.chunk_hash_hex)
                continue
            except ValueError:
                pass
        check_key(key, f"{where}.entries[{j}].key")
        checked.add((key.model_name, key.cache_salt))


def _plain(entries: list[CacheEventEntry], where: str) -> bool:
    """True when the entries are valid as a whole: one valid (model_name, cache_salt) and every
    ``chunk_hash_hex`` 64 hex digits (one ``bytes.fromhex`` of them all: 64n characters giving
    32n bytes hold no whitespace, so each is 64 digits). False leaves the verdict, and the
    field an error names, to the entry-by-entry check."""
    if not entries:
        return True
    keys = [e.key for e in entries]
    if len({(k.model_name, k.cache_salt) for k in keys}) != 1:
        return False
    hexes = [k.chunk_hash_hex for k in keys]
    if set(map(len, hexes)) != {64}:
        return False
    try:
        check_key(keys[0], where)
        return len(bytes.fromhex("".join(hexes))) == 32 * len(keys)
    except (MPBodyError, ValueError):
        return False


def check_key(key: EncodedObjectKey, where: str) -> None:
    """Validate one key (``chunk_hash_hex`` is read as ``bytes.fromhex`` reads it); MPBodyError naming ``where``."""
    try:
        bytes.fromhex(key.chunk_hash_hex)
    except ValueError:
        raise MPBodyError(f"chunk_hash_hex is not valid hex - at `{where}.chunk_hash_hex`") from None
    if "@" in key.model_name:
        raise MPBodyError(f"model_name must not contain '@' - at `{where}.model_name`")
    if "\x1e" in key.model_name or "\x1f" in key.model_name or "\t" in key.model_name:
        # kvlookup's own rule: these separate fields in its index (LMCache models never hold them)
        raise MPBodyError(f"model_name must not contain tab, \\x1e or \\x1f - at `{where}.model_name`")
    check_salt(key.cache_salt, f"{where}.cache_salt")


def check_salt(salt: str, where: str) -> None:
    """MPBodyError when ``salt`` is not a valid cache salt (forbidden characters, > 128 chars)."""
    if len(salt) > SALT_MAX:
        raise MPBodyError(f"cache_salt is longer than {SALT_MAX} characters - at `{where}`")
    if any(c in salt for c in SALT_FORBIDDEN):
        raise MPBodyError(f"cache_salt must not contain '@', '/', '\\\\' or NUL - at `{where}`")
    if "\x1e" in salt or "\x1f" in salt or "\t" in salt:  # kvlookup's own rule (field separators in its index)
        raise MPBodyError(f"cache_salt must not contain tab, \\x1e or \\x1f - at `{where}`")
