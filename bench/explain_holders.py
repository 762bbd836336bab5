"""How long ``/lookup/explain`` takes as the holders of a prompt grow (issue 20 item 8).

Starts a private valkey, registers N instances (one worker each) that hold the first 1-3
chunks of a 600-token prompt, and times one in-process ``Explainer.explain`` of that prompt.

    .venv/bin/python -m kvlookup.bench.explain_holders 20000     # PROF=1 for a profile
"""

from __future__ import annotations

import cProfile
import os
import pstats
import sys
import tempfile
import time

from kvlookup.client import Client
from kvlookup.hashing.lmcache import HashProfile
from kvlookup.index.explain import Explainer
from kvlookup.index.store import ADMIT, Store
from kvlookup.proc.redis_server import EmbeddedRedis, connect


def main(n: int) -> None:
    srv = EmbeddedRedis(tempfile.mkdtemp(), appendonly=False)
    store = Store(connect(srv.start()), instance_ttl_s=0)
    tokens = list(range(1000, 1600))
    hashes = HashProfile().chunk_hashes(tokens)
    batch = []
    for i in range(n):
        store.register_worker(f"inst-{i}", 0, "127.0.0.1", 0)
        batch.append((f"inst-{i}", 0, "LocalCPUBackend", [(ADMIT, h) for h in hashes[: 1 + i % 3]]))
        if len(batch) >= 500:
            store.apply(batch)
            batch = []
    if batch:
        store.apply(batch)
    explainer = Explainer(Client(store=store))
    prof = cProfile.Profile()
    if os.environ.get("PROF"):
        prof.enable()
    start = time.perf_counter()
    out = explainer.explain(tokens, {"layout": {}})
    took = time.perf_counter() - start
    prof.disable()
    print(f"{n} holders: explain {took:.3f} s, {len(out['instances'])} instances listed, "
          f"{out.get('instances_omitted', 0)} omitted")
    if os.environ.get("PROF"):
        pstats.Stats(prof).sort_stats("tottime").print_stats(15)
    srv.stop()


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 2000)
