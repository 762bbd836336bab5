"""Instance kinds: one table decides probing, control calls and the worker rule."""

from kvlookup import kinds


def test_the_table():
    assert [(k.name, k.probed, k.control, k.worker_rule) for k in kinds.KINDS.values()] == [
        ("lmcache", True, True, "all"), ("vllm", False, False, "any")]


def test_missing_kind_is_lmcache_and_an_unknown_one_fails_closed():
    assert kinds.of(None) is kinds.LMCACHE and kinds.of("") is kinds.LMCACHE
    assert kinds.of("lmcache-mp-from-the-future") is kinds.UNKNOWN
    assert (kinds.UNKNOWN.probed, kinds.UNKNOWN.control) == (False, False)


def test_registry_round_trip(store):
    store.register_worker("v", 0, kind=kinds.VLLM)
    store.register_worker("l", 0, "127.0.0.1", 8001)
    from kvlookup.index.fleet import Fleet

    fleet = Fleet(store)
    assert (fleet.instance_kind("v"), fleet.instance_kind("l"), fleet.instance_kind("nobody")) == (
        kinds.VLLM, kinds.LMCACHE, kinds.LMCACHE)
