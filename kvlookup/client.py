"""In-process lookups: ``kvlookup.Client(...).lookup(tokens)`` for routers that want no HTTP hop."""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Annotated

import msgspec
import redis

from kvlookup.hashing import vllm as vh
from kvlookup.hashing.lmcache import HashProfile
from kvlookup.hashing.namespace import DEFAULT, Namespace
from kvlookup.index import instances
from kvlookup.index.clock import ServerClock
from kvlookup.index.records import Chain, Match, lmcache_chain, vllm_chain
from kvlookup.index.store import Store
from kvlookup.index.tracking import LOCAL_ONLY, NeedsRedis
from kvlookup.index.vllm_reuse import fill_reusable
from kvlookup.proc.redis_server import connect

log = logging.getLogger(__name__)

#: Tier order that breaks ties when a prefix spans locations equally.
LOCATION_PRIORITY = ("GPU", "LocalCPUBackend", "LocalDiskBackend")
MAX_TOKEN = 2**32


@dataclass
class InstanceMatch:
    """An instance's answer for one prompt.

    location: the tier holding most of the matched prefix (ties: GPU, LocalCPUBackend,
    LocalDiskBackend, then others by name). matched_prefix_length: tokens.
    locations: tokens of the prefix held per location. ranks: per-rank matched lengths for
    instances whose ranks are walked one by one (vLLM data parallel); empty otherwise.
    """

    instance_id: str
    location: str
    matched_prefix_length: int
    locations: dict[str, int] = field(default_factory=dict)
    ranks: dict[str, int] = field(default_factory=dict)
    reusable: dict[str, int] = field(default_factory=dict)

    def detail(self) -> dict:
        """JSON-ready detail: location, matched_prefix_length, locations, ranks (when any),
        reusable_prefix_length (vLLM instances, once :meth:`Client.add_reusable` ran: the best
        rank's hit as vLLM's coordinator computes it, kvlookup.index.vllm_groups)."""
        out: dict = {"location": self.location, "matched_prefix_length": self.matched_prefix_length,
                     "locations": self.locations}
        if self.ranks:
            out["ranks"] = self.ranks
        if self.reusable:
            out["reusable_prefix_length"] = max(self.reusable.values())
        return out


#: A token id: an int in [0, 2^32) (bools are not ints here).
TokenId = Annotated[int, msgspec.Meta(ge=0, lt=MAX_TOKEN)]


def validate_tokens(tokens: object, max_tokens: int | None = None) -> list[int]:
    """Check a token list at C speed; returns it.

    Raises ValueError naming the first bad element (not a list, non-integer, bool, negative,
    >= 2^32); OverflowError when longer than ``max_tokens``.
    """
    if not isinstance(tokens, list):
        raise ValueError(f"'tokens' must be a list of integers, got {type(tokens).__name__}")
    if max_tokens is not None and len(tokens) > max_tokens:
        raise OverflowError(f"'tokens' has {len(tokens)} ids, more than the maximum {max_tokens}")
    try:
        msgspec.convert(tokens, list[TokenId])
    except msgspec.ValidationError as exc:
        raise ValueError(f"'tokens': {str(exc).replace('$[', 'tokens[')}") from None
    return tokens


def pick_location(locations: dict[str, int]) -> str:
    """The location holding most tokens; ties by :data:`LOCATION_PRIORITY`, then by name."""
    if len(locations) == 1:
        return next(iter(locations))

    def rank(item: tuple[str, int]) -> tuple:
        loc, tokens = item
        prio = LOCATION_PRIORITY.index(loc) if loc in LOCATION_PRIORITY else len(LOCATION_PRIORITY)
        return (-tokens, prio, loc)
    return min(locations.items(), key=rank)[0] if locations else ""


def merge_matches(matches: Sequence[Match]) -> list[InstanceMatch]:
    """Fold per-rank matches into one entry per instance, longest first.

    A rank matched in several chains (vLLM GPU blocks of 16 beside CPU chunks of 256) is credited
    with its longest, and with the tokens each location holds at its own granularity (the most
    over its chains). An instance walked rank by rank answers with its best rank's length and
    locations.
    """
    per_rank: dict[tuple[str, str], Match] = {}
    for m in matches:
        key = (m.instance_id, m.worker_id)
        cur = per_rank.get(key)
        if cur is None:
            per_rank[key] = Match(m.instance_id, m.worker_id, m.matched_prefix_length, dict(m.locations))
            continue
        cur.matched_prefix_length = max(cur.matched_prefix_length, m.matched_prefix_length)
        for loc, n in m.locations.items():
            cur.locations[loc] = max(cur.locations.get(loc, 0), n)
    by_inst: dict[str, InstanceMatch] = {}
    for m in per_rank.values():
        best = by_inst.get(m.instance_id)
        cand = InstanceMatch(m.instance_id, pick_location(m.locations), m.matched_prefix_length, m.locations)
        if m.worker_id:
            ranks = best.ranks if best else {}
            ranks[m.worker_id] = m.matched_prefix_length
            cand.ranks = ranks
        if best is None or cand.matched_prefix_length > best.matched_prefix_length:
            by_inst[m.instance_id] = cand
    return sorted(by_inst.values(), key=lambda im: (-im.matched_prefix_length, im.instance_id))


#: ``source(tokens, namespace) -> [Chain]``: the chains of another hash space (sources ignore
#: what of the :class:`kvlookup.hashing.namespace.Namespace` they do not use).
ChainSource = Callable[[Sequence[int], Namespace], list[Chain]]


class SharedAnswer(list):
    """:meth:`Client.matches` of a kept answer (kvlookup.index.staged): a new list each call of
    the same :class:`InstanceMatch` objects (never change them). ``shared`` is a dict that lives
    as long as that answer, for what a caller derives from it (app.lookup keeps its encoded
    layout there)."""

    shared: dict


#: Where :meth:`Client.matches` keeps a request's chains in its ``scratch`` dict.
CHAINS_KEY = "kvlookup.chains"

#: Merged kept answers a Client keeps (all dropped when full).
MERGED_MAX = 4096

#: Distinct vLLM block sizes a lookup walks (fleets use one or two).
MAX_BLOCK_SIZES = 8


class VllmChains:
    """Chain source for vLLM instances: kvlookup's own chain (kvlookup.hashing.vllm) at every
    block size a live vLLM rank uses, and with the lookahead its EAGLE blocks are hashed with
    (``keys.block_sizes_key``; read at most every ``refresh_s`` seconds), in the request's
    namespace (base model unless ``lora_name`` / ``cache_salt`` are given). redis: a client with
    ``decode_responses=True`` (as kvlookup.proc.redis_server.connect makes). check_alive: count
    only ranks of instances with a current liveness lease (the store's ``instance_ttl_s`` > 0),
    so a block size no live rank uses leaves the walk.
    """

    def __init__(self, redis: redis.Redis, refresh_s: float = 1.0, check_alive: bool = True):
        self.r = redis
        self.refresh_s = refresh_s
        self.check_alive = check_alive
        self.clock = ServerClock(redis)  # leases are Redis server time
        self._sizes: list[tuple[int, int]] = []
        self._read_at = float("-inf")
        self._refreshing = threading.Event()

    def block_sizes(self) -> list[int]:
        """The distinct block sizes of :meth:`chains_in_use`."""
        return sorted({bs for bs, _la in self.chains_in_use()})

    def chains_in_use(self) -> list[tuple[int, int]]:
        """The (block size, lookahead) chains to walk: at most :data:`MAX_BLOCK_SIZES` (smallest
        first), so a publisher cycling through sizes cannot make every lookup hash without bound."""
        now = time.monotonic()
        if now - self._read_at >= self.refresh_s:
            if not LOCAL_ONLY.get():
                self._sizes = self._read_sizes()
                self._read_at = now
            elif self._read_at == float("-inf"):
                raise NeedsRedis()  # never read yet
            elif not self._refreshing.is_set():  # no waiting on Redis here: the last sizes serve meanwhile
                self._refreshing.set()
                threading.Thread(target=self._refresh, name="kvlookup-block-sizes", daemon=True).start()
        return self._sizes

    def _refresh(self) -> None:
        try:
            self._sizes = self._read_sizes()
            self._read_at = time.monotonic()
        except redis.RedisError as exc:
            log.debug("vLLM block sizes not refreshed: %s", exc)
        finally:
            self._refreshing.clear()

    def _read_sizes(self) -> list[tuple[int, int]]:
        sizes = instances.vllm_chains(self.r, self.clock.lease_now_ms if self.check_alive else None)
        if len(sizes) > MAX_BLOCK_SIZES:
            log.warning("%d vLLM block sizes in use; lookups walk the first %d", len(sizes), MAX_BLOCK_SIZES)
        return sizes[:MAX_BLOCK_SIZES]

    def __call__(self, tokens: Sequence[int], namespace: Namespace = DEFAULT) -> list[Chain]:
        chains = []
        for bs, lookahead in self.chains_in_use():
            root = vh.request_root(bs, namespace.lora_name, namespace.cache_salt)
            hashes = vh.chain(root, tokens, bs, lookahead=lookahead) if lookahead else vh.plain_chain(root, tokens, bs)
            chains.append(vllm_chain(bs, hashes))
        return chains


class Client:
    """Answers lookups from the index, with no HTTP hop.

    redis_url or redis: where the index lives (redis_cluster: the URL names a node of a Redis
    Cluster). profile: the engines' :class:`HashProfile`.
    extra_chains: callables adding chains of other hash spaces (vLLM instances).
    max_tokens: prompts longer than this raise OverflowError. cache_reads: keep the chunk sets it
    reads, coherent with Redis (kvlookup.index.tracking; one Redis only): True, "fenced" or False.
    """

    def __init__(self, redis_url: str | None = None, profile: HashProfile | None = None, *,
                 redis_cluster: bool = False, redis: redis.Redis | None = None, store: Store | None = None,
                 extra_chains: Sequence[ChainSource] = (), max_tokens: int | None = 1_048_576,
                 instance_ttl_s: float = 30.0, worker_ttl_s: float = 0.0, cache_reads: bool | str = False,
                 cache_keys: int = 200_000):
        if store is None:
            if redis is None:
                if redis_url is None:
                    raise ValueError("Client needs redis_url, redis or store")
                redis = connect(redis_url, cluster=redis_cluster)
            store = Store(redis, instance_ttl_s=instance_ttl_s, worker_ttl_s=worker_ttl_s, cache_reads=cache_reads,
                          cache_keys=cache_keys)
        self.store = store
        self.profile = profile or HashProfile()
        self.extra_chains = list(extra_chains)
        self.max_tokens = max_tokens
        self._merged: dict[int, tuple] = {}  # id(kept answer) -> (it, its merge_matches)

    def chains(self, tokens: Sequence[int], namespace: Namespace = DEFAULT) -> list[Chain]:
        """Every hash chain a lookup of ``tokens`` in ``namespace`` walks (see :data:`ChainSource`)."""
        hashes = self.profile.chunk_hashes(tokens)
        chains = [lmcache_chain(hashes, self.profile.chunk_size, self.profile.hashed_length(len(tokens)))]
        for source in self.extra_chains:
            chains.extend(source(tokens, namespace))
        return chains

    def matches(self, tokens: Sequence[int], *, validate: bool = True, namespace: Namespace = DEFAULT,
                causes: list[str] | None = None, model_name: str | None = None,
                scratch: dict | None = None) -> list[InstanceMatch]:
        """Every instance holding a prefix of ``tokens``, longest first.

        validate: check tokens first (see :func:`validate_tokens`); callers that already
        validated (the HTTP layer) pass False. namespace: the request's LoRA adapter and
        vLLM cache salt; vLLM blocks match only within the same namespace (LMCache chunks are
        looked up as before). model_name: only instances serving that model (or naming none).
        causes: a list that gets the miss cause the
        walk knew for free appended (kvlookup.index.records.Matches.miss; '' on a hit or unknown).
        scratch: a dict living as long as one request: the chains hashed are kept there, so the
        same request asked again (app.asgi, after NeedsRedis) does not hash its prompt again.
        """
        if validate:
            validate_tokens(tokens, self.max_tokens)
        chains = scratch.get(CHAINS_KEY) if scratch is not None else None
        if chains is None:
            chains = self.chains(tokens, namespace)
            if scratch is not None:
                scratch[CHAINS_KEY] = chains
        found = self.store.lookup(chains)
        if causes is not None:
            causes.append(found.miss)
        if not found.kept:
            merged: list[InstanceMatch] = merge_matches(found)
        else:
            got = self._merged.get(id(found))  # a kept answer (kvlookup.index.staged): merged once
            if got is None or got[0] is not found:
                if len(self._merged) >= MERGED_MAX:
                    self._merged.clear()
                got = self._merged[id(found)] = (found, merge_matches(found), {})
            merged = SharedAnswer(got[1])
            merged.shared = got[2]
        return self._of_model(merged, model_name) if model_name and merged else merged

    def _of_model(self, matches: list[InstanceMatch], model_name: str) -> list[InstanceMatch]:
        """The matches of instances serving ``model_name`` or naming no model (LMCache instances,
        vLLM sources given by endpoint): a discovered vLLM server's ``model`` must equal it."""
        if LOCAL_ONLY.get():
            raise NeedsRedis()
        models = instances.models(self.store.r, [m.instance_id for m in matches])
        return [m for m, model in zip(matches, models, strict=True) if not model or model == model_name]

    def add_reusable(self, tokens: Sequence[int], matches: list[InstanceMatch],
                     namespace: Namespace = DEFAULT) -> list[InstanceMatch]:
        """``matches`` with ``reusable`` filled for the vLLM ones (kvlookup.index.vllm_reuse), as
        copies: a kept answer's matches are shared between lookups and never changed. Reads Redis,
        so under LOCAL_ONLY it raises NeedsRedis."""
        if not any(m.ranks for m in matches):
            return matches
        if LOCAL_ONLY.get():
            raise NeedsRedis()
        out = [dataclasses.replace(m, reusable={}) for m in matches]
        fill_reusable(self.store.r, tokens, out, namespace.lora_name, namespace.cache_salt)
        return out

    def lookup(self, tokens: list[int]) -> tuple[str, dict[str, tuple[str, int]]]:
        """LMCache's ``lookup(tokens) -> (event_id, layout_info)``.

        tokens: token ids. Returns ``("Lookup<uuid4>", {instance_id: (location,
        matched_prefix_length)})`` ordered longest first; ``{}`` when nothing matches.
        Raises ValueError/OverflowError on bad tokens (see :func:`validate_tokens`).
        """
        layout = {m.instance_id: (m.location, m.matched_prefix_length) for m in self.matches(tokens)}
        return new_event_id("Lookup"), layout


def new_event_id(prefix: str) -> str:
    """LMCache-style event id: the prefix followed directly by a uuid4."""
    return f"{prefix}{uuid.uuid4()}"
