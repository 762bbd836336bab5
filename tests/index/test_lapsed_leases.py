"""Lapsed leases (issue 18): a prompt held by instances whose leases lapsed (a dead fleet whose
records are not purged yet) costs no RESOLVE per lookup, and a lease renewed after lapsing counts
at the very next lookup.

RESOLVE marks a holder whose lease is missing or expired on Redis server time (``lapsed``); the
lookup's HolderCache keeps it out without asking again while the registry version stays, and
every lease write that revives a lapsed lease (``TOUCH``: Store.renew, ``OWN``: Store.own,
``TOUCH_LEASES``: Store.touch_instances) moves the version (scripts._REVIVE). Every read path:
one Redis plain (``lookup_cache: off``, what Sentinel runs) and cached, a cluster plain and
cached (the ``store`` fixture: both backends, both read paths); RESOLVE calls counted as the
servers count them (``INFO commandstats``, every master).
"""

from __future__ import annotations

import time

import pytest

from kvlookup.client import Client
from kvlookup.hashing.lmcache import HashProfile
from kvlookup.index import keys
from kvlookup.index.scripts import LAPSED_SLACK_MS
from kvlookup.index.store import ADMIT, Store
from tests.support.helpers import command_calls

CPU = "LocalCPUBackend"
TOKENS = list(range(1000, 2024))  # 4 chunks of 256
HASHES = HashProfile().chunk_hashes(TOKENS)
LIVE = [f"live-{i}" for i in range(8)]
DEAD = [f"dead-{i}" for i in range(24)]
LOOKUPS = 5


def _fleet(store: Store, ids: list[str], sidecar: str) -> None:
    for inst in ids:
        store.register_worker(inst, 0)
        store.own(sidecar, inst)
        store.apply([(inst, 0, CPU, [(ADMIT, h) for h in HASHES])])


def _held(client: Client) -> set[str]:
    return set(client.lookup(TOKENS)[1])


def _measure_clock_once(store: Store) -> None:
    """The server clock's offset measured at the first lookup and kept: its measurement is an
    EVALSHA too (SERVER_TIME, every second), which a slow run's lookups would span and
    :func:`_resolves` count. Leases here are judged seconds apart; the offset does not drift."""
    store.clock.refresh_s = float("inf")


def _resolves(r, store: Store, before: dict[str, int]) -> int:
    """RESOLVE calls since ``before`` (command_calls): every EVALSHA a lookup sends, less the one
    CHUNK_HEADS call a lookup sends on one Redis with ``lookup_cache: off`` (the store's clock
    measured once: :func:`_measure_clock_once`)."""
    spent = command_calls(r).get("evalsha", 0) - before.get("evalsha", 0)
    heads = LOOKUPS if not store.cluster and store.records.cached is None else 0
    return spent - heads


@pytest.fixture()
def fleet(store, r):
    _fleet(store, LIVE, "sc-live")
    _fleet(store, DEAD, "sc-dead")
    r.zadd(keys.alive_key(), dict.fromkeys(DEAD, 0))  # their sidecar stopped renewing long ago
    _measure_clock_once(store)
    return store


def test_a_dead_fleets_prompt_costs_no_resolve_per_lookup(fleet, r):
    client = Client(store=fleet)
    assert _held(client) == set(LIVE)  # this one resolves every holder
    before = command_calls(r)
    for _ in range(LOOKUPS):
        assert _held(client) == set(LIVE)
    assert _resolves(r, fleet, before) == 0


@pytest.mark.parametrize("write", ["renew", "own", "touch_instances"])
def test_a_lease_renewed_after_lapsing_counts_at_the_next_lookup(fleet, r, write):
    client = Client(store=fleet)
    assert _held(client) == set(LIVE)
    assert _held(client) == set(LIVE)  # the lapsed answers kept
    if write == "renew":  # the owning sidecar back (TOUCH)
        fleet.renew("sc-dead")
        back = set(DEAD)
    elif write == "own":  # another sidecar takes one over (OWN)
        fleet.own("sc-new", DEAD[0])
        back = {DEAD[0]}
    else:  # renewed without a sidecar (TOUCH_LEASES)
        fleet.touch_instances(DEAD[3:5])
        back = set(DEAD[3:5])
    assert _held(client) == set(LIVE) | back
    before = command_calls(r)
    for _ in range(LOOKUPS):
        assert _held(client) == set(LIVE) | back
    assert _resolves(r, fleet, before) == 0


def test_a_renewal_of_a_live_lease_keeps_the_answers(fleet, r):
    """Only a revival moves the version: renewing leases that hold (every second, the normal
    case) leaves every kept answer in place."""
    version = r.get(keys.registry_version_key())
    fleet.renew("sc-live")
    fleet.own("sc-live", LIVE[0])
    fleet.touch_instances(LIVE)
    assert r.get(keys.registry_version_key()) == version
    fleet.touch_instances([DEAD[0]])
    assert r.get(keys.registry_version_key()) != version


def test_a_lease_that_lapses_while_kept_is_asked_once(store, r):
    """Leases that held when resolved and lapse later: the first lookup after the slack asks
    RESOLVE once, the next ones do not; the owner renewing them brings them back at once."""
    _measure_clock_once(store)
    short = Store(r, purge_grace_s=0, instance_ttl_s=1.0)
    _fleet(short, DEAD[:6], "sc-short")
    client = Client(store=store)
    short.renew("sc-short")  # a loaded box may take longer than a lease to write the fleet
    assert _held(client) == set(DEAD[:6])
    time.sleep(1.0 + LAPSED_SLACK_MS / 1000 + 0.2)
    assert _held(client) == set()
    before = command_calls(r)
    for _ in range(LOOKUPS):
        assert _held(client) == set()
    assert _resolves(r, store, before) == 0
    short.renew("sc-short")
    assert _held(client) == set(DEAD[:6])


def test_a_kept_out_lapsed_holder_counts_for_a_lookup_judged_earlier(store, r):
    """Liveness judged as of an earlier time (kvlookup.index.clock: frozen while Redis refuses
    writes) counts a holder whose lease had not lapsed then, though its lapsed answer is kept."""
    _fleet(store, LIVE[:2], "sc-live")
    _fleet(store, DEAD[:3], "sc-dead")
    now = store.clock.now_ms()
    r.zadd(keys.alive_key(), dict.fromkeys(DEAD[:3], now - 10_000))  # lapsed 10 s ago

    def held(at_ms: int) -> set[str]:
        return {m.instance_id for m in store.lookup(Client(store=store).chains(TOKENS), now_ms=at_ms)}

    assert held(now) == held(now) == set(LIVE[:2])  # kept: lapsed, not asked again
    assert held(now - 20_000) == set(LIVE[:2]) | set(DEAD[:3])
    assert held(now) == set(LIVE[:2])


def test_with_leases_off_a_sidecars_own_and_renew_write_no_lease_and_keep_the_version(r):
    """``instance_ttl_s: 0`` is "no leases": owning and renewing (OWN, TOUCH, every second in a
    sidecar) write no instance lease and never move the registry version. They used to write a
    lease expiring at once, so every renewal counted as a revival and moved the version, dropping
    every answer lookups kept, once a second."""
    off = Store(r, instance_ttl_s=0, purge_grace_s=0)
    _fleet(off, LIVE[:2], "sc-off")
    version = r.get(keys.registry_version_key())
    assert off.renew("sc-off") == 2
    off.own("sc-off", LIVE[0])
    assert off.renew("sc-off") == 2
    assert r.get(keys.registry_version_key()) == version
    assert r.zrange(keys.alive_key(), 0, -1) == []
    assert r.smembers(keys.sidecar_instances_key("sc-off")) == set(LIVE[:2])
    assert r.hgetall(keys.owners_key()) == dict.fromkeys(LIVE[:2], "sc-off")
    assert _held(Client(store=off)) == set(LIVE[:2])  # lookups check no lease
