"""A vLLM instance's per-rank state in Redis, written by its sidecar: the engine map (engine block
hash -> kvlookup's chunk hash and the residencies holding it, ``keys.engine_map_key``) and the
rank fields of the instance hash (``keys.rank_field``: seq, digest, block sizes, session, resync;
``keys.group_field``: the hybrid groups learned). sidecar/vllm_ingest.py and vllm_apply.py keep
the protocol's semantics; every key and command is here."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from kvlookup import kinds
from kvlookup.index import keys
from kvlookup.index.store import Store

#: rank fields a wipe removes (with the rank's group fields)
RANK_FIELDS = ("seq", "digest", "block_size", "session")

#: The engine map's field of one engine block hash in one KV cache group (``keys.engine_field``).
engine_field = keys.engine_field
#: The hash space of a rank's prefix chain of ``block_size`` blocks (``keys.vllm_space``) and of a
#: hybrid model's other group (``keys.vllm_group_space``): what ``Store.apply(space=...)`` takes.
prefix_space = keys.vllm_space
group_space = keys.vllm_group_space


def rank_fields(rank: int, **values: str | int) -> dict[str, str | int]:
    """The instance hash fields of one rank (``keys.rank_field``: seq, digest, block_size,
    session) with their values, for :meth:`VllmRanks.write`'s ``persist``."""
    return {keys.rank_field(name, rank): v for name, v in values.items()}


def group_fields(rank: int, specs: Mapping[int, str]) -> dict[str, str]:
    """The instance hash fields (``keys.group_field``) of a rank's KV cache groups: group -> spec text."""
    return {keys.group_field(rank, g): text for g, text in specs.items()}


def chains_text(chains: Iterable[tuple[int, int]]) -> str:
    """The ``keys.block_sizes_key`` (and ``block_size`` rank field) value of a rank's
    (block size, lookahead) prefix chains."""
    return ",".join(keys.vllm_chain(bs, la) for bs, la in sorted(chains))


@dataclass
class PersistedRank:
    """What a rank persisted (:meth:`VllmRanks.persisted`): ``seq`` the last applied, as stored
    (None: nothing), ``digest`` of that batch, its prefix ``chains`` (block size, lookahead), its KV
    cache ``groups`` (group -> spec text), and ``old_layout``: its worker hash names a holder per
    medium only (a layout before hash spaces per medium), so its records must be rebuilt."""

    seq: str | None = None
    digest: str | None = None
    chains: list[tuple[int, int]] = field(default_factory=list)
    groups: dict[int, str] = field(default_factory=dict)
    old_layout: bool = False


class VllmRanks:
    """The Redis side of one vLLM instance's ranks (store: the sidecar's Store)."""

    def __init__(self, store: Store, instance_id: str):
        self.store, self.instance_id = store, instance_id
        self.r = store.r
        self.instance_key = keys.instance_key(instance_id)

    def write_model(self, model: str, only_if_vllm: bool = False) -> None:
        """Record the served model's name (``model`` field); with only_if_vllm, only when the
        instance is registered as a vLLM instance already."""
        if only_if_vllm and kinds.of(self.r.hget(self.instance_key, "kind")) is not kinds.VLLM:
            return
        self.r.hset(self.instance_key, "model", model)

    def persisted(self, rank: int) -> PersistedRank:
        """What a resumed rank reads back (the instance hash and the rank's worker hash field
        names), in two commands."""
        fields = self.r.hgetall(self.instance_key)
        worker = self.r.hkeys(keys.worker_key(self.instance_id, rank))
        seq = fields.get(keys.rank_field("seq", rank))
        prefix = keys.group_field(rank, 0)[:-1]
        groups = {int(name[len(prefix):]): value for name, value in fields.items()
                  if name.startswith(prefix) and name[len(prefix):].isdigit()}
        return PersistedRank(
            seq=seq, digest=fields.get(keys.rank_field("digest", rank)),
            chains=keys.parse_vllm_chains(fields.get(keys.rank_field("block_size", rank)) or ""), groups=groups,
            old_layout=any(f.startswith(keys.LOCATION_FIELD_PREFIX) and "@" not in f for f in worker))

    def engine_entries(self, rank: int, fields: Sequence[str]) -> list[str | None]:
        """The engine map's values of ``fields`` (``keys.engine_field``), None where absent."""
        return self.r.hmget(keys.engine_map_key(self.instance_id, rank), list(fields))

    def engine_map_size(self, rank: int) -> int:
        """How many fields the rank's engine map has (HLEN)."""
        return int(self.r.hlen(keys.engine_map_key(self.instance_id, rank)))

    def engine_map(self, rank: int) -> dict[str, str]:
        """The rank's whole engine map (HGETALL; callers bound it with :meth:`engine_map_size`)."""
        return self.r.hgetall(keys.engine_map_key(self.instance_id, rank))

    def write_commands(self, rank: int, map_sets: Mapping[str, str], map_dels: Iterable[str], *,
                       block_sizes: str | None = None, min_block_size: int | None = None,
                       persist: Mapping[str, str | int] | None = None) -> list[tuple]:
        """The commands of :meth:`write`, to send in another round trip (``Store.apply(then=)``):
        engine map fields set and deleted, the rank's block sizes (the walk's
        ``keys.block_sizes_key`` and the instance's ``block_size``) when they changed, and the
        rank fields in ``persist``."""
        cmds: list[tuple] = []
        map_key = keys.engine_map_key(self.instance_id, rank)
        dels = list(map_dels)
        if map_sets:
            cmds.append(("HSET", map_key, *[x for kv in map_sets.items() for x in kv]))
        if dels:
            cmds.append(("HDEL", map_key, *dels))
        if block_sizes is not None:
            cmds.append(("HSET", keys.block_sizes_key(), keys.worker_member(self.instance_id, rank), block_sizes))
            cmds.append(("HSET", self.instance_key, "block_size", min_block_size or 0))
        if persist:
            cmds.append(("HSET", self.instance_key, *[x for kv in persist.items() for x in kv]))
        return cmds

    def write(self, rank: int, map_sets: Mapping[str, str], map_dels: Iterable[str], *,
              block_sizes: str | None = None, min_block_size: int | None = None,
              persist: Mapping[str, str | int] | None = None) -> None:
        """One round trip: the commands of :meth:`write_commands`."""
        self.send(self.write_commands(rank, map_sets, map_dels, block_sizes=block_sizes,
                                      min_block_size=min_block_size, persist=persist))

    def send(self, cmds: Sequence[tuple]) -> None:
        """Send plain commands in one pipeline (nothing when there are none)."""
        if not cmds:
            return
        pipe = self.r.pipeline(transaction=False)
        for cmd in cmds:
            pipe.execute_command(*cmd)
        pipe.execute()

    def wipe(self, rank: int, groups: Iterable[int]) -> None:
        """Empty the rank's engine map and forget its rank fields and ``groups``' fields."""
        pipe = self.r.pipeline(transaction=False)
        pipe.unlink(keys.engine_map_key(self.instance_id, rank))
        pipe.hdel(self.instance_key, *[keys.rank_field(name, rank) for name in RANK_FIELDS],
                  *[keys.group_field(rank, g) for g in groups])
        pipe.execute()

    def mark_resync(self, rank: int, reason: str | None) -> None:
        """Say (``resync`` rank field) that the rank's records are incomplete and why; None clears it."""
        field = keys.rank_field("resync", rank)
        if reason:
            self.r.hset(self.instance_key, field, reason)
        else:
            self.r.hdel(self.instance_key, field)
