"""A sidecar killed with ``kill -9``: its instances' leases lapse, lookups of their prompt then
send no RESOLVE each (their lapsed answers are kept while the registry version stays), and once
the sidecar is started again its first renewal (``TOUCH``, which moves the version when it revives
a lapsed lease: scripts._REVIVE) brings them back at the very next lookup.

Real processes: a ``python -m kvlookup sidecar`` (1 s instance leases), an LMCache 0.5-era
worker on real ZMQ sockets (kvlookup.devtools.workersim), lookups in process on one Redis and
on the Redis Cluster, through the plain read path (``lookup_cache: off``) and cached reads.
"""

from __future__ import annotations

import signal
import time

from kvlookup.client import Client
from kvlookup.devtools.workersim import WorkerSim
from kvlookup.index import keys
from kvlookup.index.scripts import LAPSED_SLACK_MS
from kvlookup.index.store import Store
from kvlookup.proc.redis_server import free_port
from tests.conftest import SEED_HASH, SEED_TOKENS
from tests.support.helpers import command_calls, wait_for
from tests.support.procs import SidecarProc

CPU = "LocalCPUBackend"
HELD = {"lapse-a": (CPU, 12)}
LOOKUPS = 5


def test_kill9_lapsed_leases_cost_no_resolve_and_a_renewal_counts_at_once(r, redis_args, cluster):
    pull, reply = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    sidecar = SidecarProc(*redis_args, "--instance-ttl", "1", "--sidecar-id", "side-lapse",
                          pull_url=pull, reply_url=reply)
    sidecar.start()
    worker = WorkerSim("lapse-a", era="0.5", pull_url=pull, reply_url=reply)
    plain = Client(store=Store(r, instance_ttl_s=1))
    cached = Client(store=Store(r, instance_ttl_s=1, cache_reads="fenced"))
    clients = (plain, cached)
    try:
        assert worker.register()["type"] == "RegisterRetMsg"
        worker.admit([SEED_HASH])
        for c in clients:
            assert wait_for(lambda c=c: c.lookup(SEED_TOKENS)[1], HELD) == HELD
        sidecar.kill(signal.SIGKILL)
        for c in clients:  # nobody renews: the lease lapses within its 1 s
            assert wait_for(lambda c=c: c.lookup(SEED_TOKENS)[1], {}) == {}
        time.sleep(LAPSED_SLACK_MS / 1000 + 0.2)  # lapsed for good on the server's clock
        for c in clients:
            assert c.lookup(SEED_TOKENS)[1] == {}  # resolved once more: now marked lapsed
        for c in clients:  # the clock's offset kept: its measurement (SERVER_TIME, each second) is an EVALSHA
            c.store.clock.refresh_s = float("inf")  # too, which a slow run's lookups would span and count
        before = command_calls(r)
        for _ in range(LOOKUPS):
            for c in clients:
                assert c.lookup(SEED_TOKENS)[1] == {}
        spent = command_calls(r).get("evalsha", 0) - before.get("evalsha", 0)
        assert spent == (0 if cluster else LOOKUPS)  # one Redis, plain: one CHUNK_HEADS a lookup; no RESOLVE

        sidecar.start()  # resumes what it owns: its first renewal revives the lease
        assert wait_for(lambda: (r.zscore(keys.alive_key(), "lapse-a") or 0) > plain.store.clock.now_ms(), True)
        for c in clients:
            assert c.lookup(SEED_TOKENS)[1] == HELD  # the very next lookup
    finally:
        worker.close()
        sidecar.stop()
