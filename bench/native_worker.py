"""One measuring round for ``python -m kvlookup.bench.native`` (run as a script, in its own process).

Uses only APIs main has too (parse_request, HashProfile, vllm.plain_chain, Client, LookupRoute), so
the same file times main's checkout and this branch's, python and native (KVLOOKUP_NATIVE).
argv: redis_url, JSON list of prompt lengths, seconds per item. Prints one JSON object:
``{"kvlookup": file, "native": bool, "rows": {n: {item: {"cpu_us", "wall_us", "ops"}}}}``.
"""

from __future__ import annotations

import json
import sys
import time


def timed(fn, seconds: float) -> dict:
    """CPU (process_time) and wall microseconds per call of ``fn``, over ~``seconds``."""
    fn()
    ops, wall0, cpu0 = 0, time.perf_counter(), time.process_time()
    end = wall0 + seconds
    while True:
        for _ in range(8):
            fn()
        ops += 8
        now = time.perf_counter()
        if now >= end:
            break
    cpu = time.process_time() - cpu0
    return {"cpu_us": round(cpu / ops * 1e6, 2), "wall_us": round((now - wall0) / ops * 1e6, 2), "ops": ops}


def main() -> None:
    import os

    import kvlookup
    from kvlookup.app.errors import json_bytes
    from kvlookup.app.lookup import LookupRoute, parse_request
    from kvlookup.bench.sweeps import prompt
    from kvlookup.client import Client, VllmChains
    from kvlookup.hashing import vllm as vh
    from kvlookup.hashing.lmcache import HashProfile
    from kvlookup.proc.redis_server import connect

    in_use = False
    if os.path.exists(os.path.join(os.path.dirname(kvlookup.__file__), "native.py")):  # main has none (an
        from kvlookup import native  # editable install's finder would hand main this checkout's module)
        in_use = native.ext is not None
    url, lengths, seconds = sys.argv[1], json.loads(sys.argv[2]), float(sys.argv[3])
    r = connect(url)
    client = Client(redis=r, extra_chains=[VllmChains(r)], instance_ttl_s=0, cache_reads=True)  # the default
    route = LookupRoute(None, client, "flat", 1 << 30)
    profile = HashProfile()
    longest = prompt(max(lengths), 1)
    rows: dict = {}
    for n in lengths:
        body = json.dumps({"tokens": longest[:n]}).encode()
        toks = parse_request(body, 1 << 30).tokens

        def decode(body=body):
            return parse_request(body, 1 << 30).tokens

        def decode_hash(body=body):
            return profile.chunk_hashes(parse_request(body, 1 << 30).tokens)

        def decode_hash_vllm(body=body):
            tokens = parse_request(body, 1 << 30).tokens
            return profile.chunk_hashes(tokens), vh.plain_chain(-5, tokens, 16)

        def lookup(body=body):
            keep: dict = {}
            status, answer, _ = route.respond("/lookup", "POST", "", body, keep, "application/json")
            assert status == 200, answer
            json_bytes(answer)
            route.count(keep)
            return answer

        assert len(json.loads(json_bytes(lookup()))) == 9  # event_id + the 8 holders: a hot hit
        rows[n] = {"decode": timed(decode, seconds), "hash_lmcache": timed(lambda t=toks: profile.chunk_hashes(t),
                                                                           seconds),
                   "decode+hash": timed(decode_hash, seconds), "decode+hash+vllm16": timed(decode_hash_vllm, seconds),
                   "lookup": timed(lookup, seconds)}
    print(json.dumps({"kvlookup": kvlookup.__file__, "native": in_use, "rows": rows}))


if __name__ == "__main__":
    main()
