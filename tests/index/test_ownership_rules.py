"""The ownership rules of issue 20 item 10 as the Lua scripts apply them (scripts.FOREIGN, OWN,
MP_HOLD), on a real Redis (single and cluster): a live claimer, then an MP registration, then
the live first owner keep every other writer off; a sidecar's own claim beats them; a lapsed
or signed-off lease frees the instance; ``shared_ownership`` lifts only the first-owner rule.
The real-process counterpart is tests/faults/test_instance_ownership.py."""

from __future__ import annotations

import pytest

from kvlookup.index import keys
from kvlookup.index.mp import MPDirectory
from kvlookup.index.store import OtherWriter, Store


@pytest.fixture()
def s(r):
    return Store(r, purge_grace_s=0)


def test_the_first_owner_keeps_others_off_while_its_lease_holds(r, s):
    s.renew("A")
    s.renew("B")
    s.own("A", "x")
    s.own("A", "x")  # the owner again: fine
    with pytest.raises(OtherWriter) as got:
        s.own("B", "x")
    assert (got.value.reason, got.value.who) == ("instance_owned", "owner:A")
    assert s.other_writer("x", "B") == "owner:A" and s.other_writer("x", "A") == ""
    assert r.hget(keys.owners_key(), "x") == "A" and r.smembers(keys.sidecar_instances_key("B")) == set()
    s.sign_off("A")  # a clean stop: free at once
    s.own("B", "x")
    assert r.hget(keys.owners_key(), "x") == "B"
    r.zadd(keys.sidecars_key(), {"B": 1})  # B's lease lapsed long ago (a kill -9)
    s.renew("A")
    s.own("A", "x")
    assert r.hget(keys.owners_key(), "x") == "A"


def test_shared_ownership_lifts_only_the_first_owner_rule(r, s):
    shared = Store(r, purge_grace_s=0)
    shared.shared_ownership = True
    for sid in ("A", "B", "C"):
        s.renew(sid)
    s.own("A", "x")
    shared.own("B", "x")  # today's semantics: the last taker renews the lease
    assert r.hget(keys.owners_key(), "x") == "B"
    s.claim("C", ["x"])
    with pytest.raises(OtherWriter) as got:
        shared.own("B", "x")
    assert got.value.who == "claim:C"


def test_a_claim_beats_an_owner_and_an_mp_registration_beats_sidecars(r, s):
    for sid in ("A", "B"):
        s.renew(sid)
    s.own("A", "x")
    s.claim("B", ["x"])
    assert s.other_writer("x", "A") == "claim:B"
    s.own("B", "x")  # its own claim beats A's first write
    with pytest.raises(OtherWriter):
        s.own("A", "x")

    mp = MPDirectory(r, instance_timeout_s=30)
    mp.hold("m")
    assert s.other_writer("m", "A") == "mp" and s.other_writer("m", "", mp=True) == ""
    with pytest.raises(OtherWriter) as got:
        s.own("A", "m")
    assert got.value.reason == "instance_mp" and not r.hexists(keys.owners_key(), "m")
    mp.hold("m", release=True)
    s.own("A", "m")
    assert s.other_writer("m", "", mp=True) == "owner:A"  # and now the MP coordinator is refused
