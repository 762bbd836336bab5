"""The default worker's HTTP front (app.asgi, kvlookup.app.asgi_worker) through a real gunicorn +
uvicorn controller: bodies, chunked encoding, the Flask paths behind a2wsgi, errors as JSON."""

from __future__ import annotations

import json
import random
import re
import socket

import pytest

from tests.conftest import SEED_TOKENS
from tests.e2e.test_e2e import _raw, _response, _seed
from tests.support.procs import ControllerProc

pytestmark = pytest.mark.slow


@pytest.fixture
def ctrl(r, redis_args):
    _seed(r, [8001])
    proc = ControllerProc(*redis_args, "--workers", "1", "--instance-ttl", "0",
                          env={"KVLOOKUP_MAX_BODY_BYTES": "4096"})
    try:
        yield proc.wait_ready()
    finally:
        proc.stop()


def _chunked(path: str, body: bytes, pieces: int = 3) -> bytes:
    step = max(1, len(body) // pieces)
    parts = [body[i:i + step] for i in range(0, len(body), step)]
    chunks = b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in parts)
    return (f"POST {path} HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
            "Transfer-Encoding: chunked\r\n\r\n").encode() + chunks + b"0\r\n\r\n"


def _json(response: bytes) -> tuple[str, dict]:
    head, _, body = response.partition(b"\r\n\r\n")
    return head.split(b"\r\n")[0].decode(), json.loads(body)


def test_chunked_bodies_reach_lookup_and_the_flask_paths(ctrl):
    status, body = _json(_raw(ctrl.port, _chunked("/lookup?format=layout_info",
                                                  json.dumps({"tokens": SEED_TOKENS}).encode())))
    assert status == "HTTP/1.1 200 OK"
    assert body["layout_info"] == {"inst": ["LocalCPUBackend", 12]}
    status, body = _json(_raw(ctrl.port, _chunked("/query_instance", b'{"ip": "127.0.0.1", "port": 8001}')))
    assert status == "HTTP/1.1 200 OK" and body["res"] == "inst"


def test_errors_are_json(ctrl):
    status, body = _json(_raw(ctrl.port, b"GARBAGE\r\n\r\n"))
    assert status == "HTTP/1.1 400 Bad Request"
    assert body == {"error": "malformed HTTP request (bad request line, header or chunked encoding)"}
    big = b'{"tokens": [' + b"1, " * 2000 + b"1]}"
    status, body = _json(_raw(ctrl.port, b"POST /lookup HTTP/1.1\r\nHost: localhost\r\nContent-Length: %d\r\n\r\n%s"
                              % (len(big), big)))
    assert (status, body) == ("HTTP/1.1 413 Request Entity Too Large", {"error": "request body too large"})
    status, body = _json(_raw(ctrl.port, _chunked("/lookup", big, pieces=8)))  # no length declared
    assert (status, body) == ("HTTP/1.1 413 Request Entity Too Large", {"error": "request body too large"})
    status, body = _json(_raw(ctrl.port,
                              b"POST /lookup HTTP/1.1\r\nHost: localhost\r\nContent-Length: 9\r\n\r\n[1, 2, 3]"))
    assert status == "HTTP/1.1 400 Bad Request"
    assert body == {"error": "invalid request: Expected `object`, got `array`"}
    resp = ctrl.session.get(ctrl.http + "/lookup", timeout=5)
    assert (resp.status_code, resp.json(), resp.headers["Allow"]) == (
        405, {"error": "The method is not allowed for the requested URL."}, "OPTIONS, POST")
    resp = ctrl.session.options(ctrl.http + "/lookup", timeout=5)
    assert (resp.status_code, resp.headers["Allow"], resp.content) == (200, "OPTIONS, POST", b"")
    assert ctrl.session.get(ctrl.http + "/nope", timeout=5).json() == {
        "error": "The requested URL was not found on the server. If you entered the URL manually please check "
                 "your spelling and try again."}


def test_keep_alive_connection_serves_lookups_back_to_back(ctrl):
    body = json.dumps({"tokens": SEED_TOKENS}).encode()
    request = b"POST /lookup HTTP/1.1\r\nHost: localhost\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
    with socket.create_connection(("127.0.0.1", ctrl.port), timeout=5) as s:
        answers = []
        for _ in range(50):
            s.sendall(request)
            answers.append(_json(_response(s)))
    assert {(st, json.dumps({k: v for k, v in b.items() if k != "event_id"})) for st, b in answers} == {
        ("HTTP/1.1 200 OK", '{"inst": ["LocalCPUBackend", 12]}')}


def test_packed_uint32_body_through_the_server(ctrl):
    import struct

    resp = ctrl.session.post(ctrl.http + "/lookup", data=struct.pack(f"<{len(SEED_TOKENS)}I", *SEED_TOKENS),
                             headers={"Content-Type": "application/octet-stream"}, timeout=5)
    assert resp.status_code == 200
    assert {k: v for k, v in resp.json().items() if k != "event_id"} == {"inst": ["LocalCPUBackend", 12]}



def test_stalled_heads_and_huge_headers_are_refused(r, redis_args):
    """A connection that sends nothing, or dribbles its headers, gets 408 after body_timeout_s
    and is closed (silent connections used to fill uvicorn's connection limit: every other client
    got 503); over 100 header fields gets 431; a 413 closes the connection."""
    _seed(r, [8001])
    ctrl = ControllerProc(*redis_args, "--workers", "1", "--instance-ttl", "0",
                          env={"KVLOOKUP_BODY_TIMEOUT_S": "1", "KVLOOKUP_MAX_BODY_BYTES": "4096"})
    try:
        ctrl.wait_ready()
        silent = [socket.create_connection(("127.0.0.1", ctrl.port), timeout=5) for _ in range(50)]
        dribbling = socket.create_connection(("127.0.0.1", ctrl.port), timeout=5)
        dribbling.sendall(b"POST /lookup HTTP/1.1\r\nHost: localhost\r\n")
        assert ctrl.layout(SEED_TOKENS) == {"inst": ["LocalCPUBackend", 12]}  # served meanwhile
        for s in [*silent, dribbling]:
            assert _json(_response(s)) == ("HTTP/1.1 408 Request Timeout",
                                           {"error": "request headers not received within 1 s"})
            assert s.recv(1) == b""  # closed
            s.close()
        many = b"GET /health HTTP/1.1\r\n" + b"".join(b"X-%d: y\r\n" % i for i in range(101)) + b"\r\n"
        assert _json(_raw(ctrl.port, many)) == ("HTTP/1.1 431 Request Header Fields Too Large", {
            "error": "request header fields too large (at most 100 fields of 8190 bytes)"})
        with socket.create_connection(("127.0.0.1", ctrl.port), timeout=5) as s:
            s.sendall(b"POST /lookup HTTP/1.1\r\nHost: localhost\r\nContent-Length: 20000000\r\n\r\n")
            assert _json(_response(s)) == ("HTTP/1.1 413 Request Entity Too Large",
                                           {"error": "request body too large"})
            assert s.recv(1) == b""
    finally:
        ctrl.stop()


@pytest.mark.single_node
def test_a_hung_redis_never_holds_the_event_loop(tmp_path):
    """Redis stopped (SIGSTOP) while lookups wait on it: they wait in threads (then 503), and the
    worker's event loop goes on answering what needs no Redis (OPTIONS, a 413, a bad request)."""
    import os
    import signal
    import threading
    import time

    from kvlookup.proc.redis_server import EmbeddedRedis, connect

    server = EmbeddedRedis(tmp_path / "redis", appendonly=False)
    url = server.start()
    ctrl = ControllerProc("--redis-url", url, "--workers", "1", "--instance-ttl", "0",
                          env={"KVLOOKUP_MAX_BODY_BYTES": "4096"})
    try:
        _seed(connect(url), [8001])
        ctrl.wait_ready()
        assert ctrl.layout(SEED_TOKENS) == {"inst": ["LocalCPUBackend", 12]}
        os.kill(server.proc.pid, signal.SIGSTOP)
        waiting: list = []

        def lookup(tokens):
            import requests
            waiting.append(requests.post(ctrl.http + "/lookup", json={"tokens": tokens}, timeout=30))

        threads = [threading.Thread(target=lookup, args=(t,)) for t in (list(range(300)), SEED_TOKENS)]
        for t in threads:
            t.start()
        time.sleep(0.5)
        start = time.monotonic()
        assert ctrl.session.options(ctrl.http + "/lookup", timeout=5).headers["Allow"] == "OPTIONS, POST"
        assert _json(_raw(ctrl.port, b"POST /lookup HTTP/1.1\r\nHost: localhost\r\nContent-Length: 9999\r\n\r\n"))[0] \
            == "HTTP/1.1 413 Request Entity Too Large"
        assert _json(_raw(ctrl.port, b"GARBAGE\r\n\r\n"))[0] == "HTTP/1.1 400 Bad Request"
        assert time.monotonic() - start < 1.0
        assert any(t.is_alive() for t in threads)
        for t in threads:
            t.join(30)
        assert {w.status_code for w in waiting} <= {200, 503}
        assert any(w.status_code == 503 and w.json()["error"].startswith("index unavailable") for w in waiting)
    finally:
        os.kill(server.proc.pid, signal.SIGCONT)
        ctrl.stop()
        server.stop()


def test_mp_fast_paths_answer_as_the_flask_routes(ctrl):
    """POST /events and /directory/lookup are answered by the ASGI front itself (no WSGI
    bridge): the coordinator's bodies, a 422 naming the field, a chunked body, the Host check."""
    from kvlookup.hashing import mp as mphash

    tokens = list(range(1000, 1256))
    key = {"chunk_hash_hex": mphash.chunk_hashes_hex(tokens)[0], "model_name": "m", "kv_rank": 16777472,
           "object_group_id": 0, "cache_salt": ""}
    events = json.dumps({"batches": [{"instance_id": "mp-1", "incarnation": 1, "seq": 1, "event_type": "store",
                                      "tier": "l1", "backend": "dram",
                                      "entries": [{"key": key, "size_bytes": 7}]}]}).encode()
    status, body = _json(_raw(ctrl.port, _chunked("/events", events)))
    assert (status, body) == ("HTTP/1.1 200 OK", {"applied": 1, "duplicates": 0, "stale": 0})
    look = json.dumps({"token_ids": tokens, "model_name": "m"}).encode()
    status, body = _json(_raw(ctrl.port, _chunked("/directory/lookup", look)))
    assert status == "HTTP/1.1 200 OK"
    assert body == {"chunks": 1, "results": [{"key": key, "placements": [
        {"instance_id": "mp-1", "incarnation": 1, "tier": "l1", "backend": "dram", "size_bytes": 7, "shared": False}],
        "token_ids": [], "access_count": 0}]}
    status, body = _json(_raw(ctrl.port, _chunked("/events", b'{"batches": [{"instance_id": "x"}]}')))
    assert status == "HTTP/1.1 422 Unprocessable Entity"
    assert "$.batches[0]" in body["error"] and body["detail"] == body["error"]
    foreign = (b"POST /events HTTP/1.1\r\nHost: evil.example\r\nContent-Type: application/json\r\n"
               b"Content-Length: %d\r\n\r\n%s" % (len(events), events))
    status, body = _json(_raw(ctrl.port, foreign))
    assert status == "HTTP/1.1 421 Misdirected Request"


def test_mp_fast_paths_answer_503_without_redis(own_redis):
    proc = ControllerProc("--redis-url", own_redis.url, "--workers", "1", "--instance-ttl", "0")
    try:
        proc.wait_ready()
        own_redis.stop()
        look = json.dumps({"token_ids": list(range(256)), "model_name": "m"}).encode()
        status, body = _json(_raw(proc.port, _chunked("/directory/lookup", look), timeout=30))
        assert status == "HTTP/1.1 503 Service Unavailable" and body["error"].startswith("index unavailable")
    finally:
        proc.stop()


def _loop_attempts(ctrl) -> dict[str, float]:
    text = ctrl.session.get(ctrl.http + "/metrics", timeout=10).text
    found = re.findall(r'^kvlookup_lookup_loop_attempts_total\{attempt="(\w+)"\} ([\d.e+]+)$', text, re.M)
    return {k: float(v) for k, v in found}


def test_the_loop_attempt_is_skipped_while_fresh_prompts_miss_and_tried_again_when_hot(r, redis_args):
    """app.asgi.LoopOdds through a real one-worker controller: fresh prompts (every chunk new)
    make the event loop skip its attempt from the copies; a hot prompt brings it back (probes);
    every answer is the one a controller that always tries (KVLOOKUP_LOOP_SKIP=off) gives."""
    _seed(r, [8001])
    rng = random.Random(18)
    fresh = [[rng.randrange(128_000) for _ in range(12)] for _ in range(100)]
    args = (*redis_args, "--workers", "1", "--instance-ttl", "0", "--lookup-cache", "on")  # unfenced: the loop tries
    skip = ControllerProc(*args, env={"KVLOOKUP_LOOP_SKIP": "on"})
    always = ControllerProc(*args, env={"KVLOOKUP_LOOP_SKIP": "off"})
    try:
        skip.wait_ready()
        always.wait_ready()
        held = {"inst": ["LocalCPUBackend", 12]}
        for ctrl in (skip, always):
            assert [ctrl.layout(SEED_TOKENS) for _ in range(3)] == [held] * 3  # its copies connect
            assert [ctrl.layout(t) for t in fresh] == [{}] * len(fresh)
        after_fresh = _loop_attempts(skip)
        assert after_fresh.get("skipped", 0) >= 50  # tried until the rate fell (~22 misses), then 1 in 8
        assert _loop_attempts(always).get("skipped", 0) == 0
        answers = [skip.layout(SEED_TOKENS) for _ in range(120)]  # hot: back to the loop via probes
        assert answers == [held] * 120 == [always.layout(SEED_TOKENS) for _ in range(120)]
        back = _loop_attempts(skip)
        assert back["tried"] > after_fresh["tried"]
        assert [skip.layout(SEED_TOKENS) for _ in range(20)] == [held] * 20
        assert _loop_attempts(skip)["skipped"] == back["skipped"]  # hot: every lookup tried in the loop
        assert _loop_attempts(skip)["tried"] == back["tried"] + 20
    finally:
        skip.stop()
        always.stop()


def test_mp_directory_lookup_from_bucket_copies_in_the_loop(r, redis_args):
    """lookup_cache on (unfenced): /directory/lookup answered from the worker's bucket copies
    (kvlookup.index.mp_copies, in the event loop once every bucket is copied) is the answer of a
    directory without copies, and follows stores and deletes made elsewhere."""
    from kvlookup.hashing import mp as mphash
    from kvlookup.index.mp import MPDirectory
    from tests.index.test_mp_copies import MODEL, PROMPT, batch, entry, post
    from tests.support.helpers import wait_for

    writer, plain = MPDirectory(r), MPDirectory(r)
    hashes = mphash.chunk_hashes_hex(PROMPT)
    post(writer, batch(1, entries=[entry(h) for h in hashes[:20]]))
    proc = ControllerProc(*redis_args, "--workers", "1", "--instance-ttl", "0", env={"KVLOOKUP_LOOKUP_CACHE": "on"})
    try:
        proc.wait_ready()
        look = json.dumps({"token_ids": PROMPT, "model_name": MODEL}).encode()

        def ask():
            return _json(_raw(proc.port, _chunked("/directory/lookup", look)))[1]

        def want():
            return json.loads(plain.lookup_tokens_json(PROMPT, MODEL))

        for _ in range(5):  # read, copied in the background, then from the copies
            assert ask() == want()
        post(writer, batch(2, tier="l2", backend="fs", entries=[entry(h, size=5) for h in hashes[10:30]]))
        assert wait_for(ask, want()) == want()
        post(writer, batch(3, etype="delete", entries=[entry(h, size=0) for h in hashes[:5]]))
        assert wait_for(ask, want()) == want()
        assert [len(x["placements"]) for x in ask()["results"]][:12] == [0] * 5 + [1] * 5 + [2] * 2
    finally:
        proc.stop()
def _loop_reads(ctrl) -> dict[str, float]:
    text = ctrl.session.get(ctrl.http + "/metrics", timeout=10).text
    found = re.findall(r'^kvlookup_lookup_loop_reads_total\{outcome="(\w+)"\} ([\d.e+]+)$', text, re.M)
    return {k: float(v) for k, v in found}


def _held_fleet(r) -> tuple[list[int], dict]:
    """Four instances holding 1, 2, 3, 4 chunks of a 1,024-token prompt; (the prompt, its answer
    with a new last chunk)."""
    from kvlookup.hashing.lmcache import HashProfile
    from kvlookup.index.store import ADMIT, Store

    prompt = list(range(40_000, 41_024))
    hashes = HashProfile().chunk_hashes(prompt)
    store = Store(r, instance_ttl_s=0)
    for i in range(4):
        store.register_worker(f"inst{i}", 0, "127.0.0.1", 8001 + i)
        store.apply([(f"inst{i}", 0, "LocalCPUBackend", [(ADMIT, h) for h in hashes[:i + 1]])])
    return prompt, {f"inst{i}": ["LocalCPUBackend", 256 * min(i + 1, 3)] for i in range(4)}


@pytest.mark.single_node
def test_first_misses_read_from_the_event_loop_answer_as_from_a_thread(r, redis_args):
    """app.asgi.MISS_LOOP=on through real one-worker controllers (unfenced copies): fresh prompts
    (a held prefix, a new last chunk) are read from the event loop on its own connection and
    answered exactly as a controller reading them in a thread (off, the default) answers."""
    prompt, want = _held_fleet(r)
    rng = random.Random(20)
    bodies = [prompt[:768] + [rng.randrange(128_000) for _ in range(256)] for _ in range(60)]
    args = (*redis_args, "--workers", "1", "--instance-ttl", "0", "--lookup-cache", "on")
    loop, thread = (ControllerProc(*args, env={"KVLOOKUP_MISS_LOOP": m}) for m in ("on", "off"))
    try:
        for ctrl in (loop, thread):
            ctrl.wait_ready()
            assert [ctrl.layout(prompt) for _ in range(3)][-1] == {**want, "inst3": ["LocalCPUBackend", 1024]}
        assert [loop.layout(b) for b in bodies] == [want] * 60 == [thread.layout(b) for b in bodies]
        assert _loop_reads(loop).get("answered", 0) >= 50  # (the first may load the digest script)
        assert _loop_reads(thread) == {}
    finally:
        loop.stop()
        thread.stop()


@pytest.mark.single_node
def test_a_loop_read_waiting_on_a_hung_redis_never_holds_the_event_loop(tmp_path):
    """Redis stopped (SIGSTOP) while first misses are read from the event loop (unfenced copies):
    the loop goes on answering what needs no Redis, and the lookups end (503 once their read and
    the thread's timed out), and answer again once Redis is back."""
    import os
    import signal
    import threading
    import time

    import requests

    from kvlookup.proc.redis_server import EmbeddedRedis, connect

    server = EmbeddedRedis(tmp_path / "redis", appendonly=False)
    url = server.start()
    ctrl = ControllerProc("--redis-url", url, "--workers", "1", "--instance-ttl", "0", "--lookup-cache", "on",
                          env={"KVLOOKUP_MISS_LOOP": "on"})
    try:
        prompt, want = _held_fleet(connect(url))
        ctrl.wait_ready()
        rng = random.Random(21)
        fresh = [prompt[:768] + [rng.randrange(128_000) for _ in range(256)] for _ in range(8)]
        assert [ctrl.layout(prompt) for _ in range(3)] and [ctrl.layout(t) for t in fresh[:4]] == [want] * 4
        assert _loop_reads(ctrl).get("answered", 0) >= 2
        os.kill(server.proc.pid, signal.SIGSTOP)
        waiting: list = []

        def lookup(tokens):
            waiting.append(requests.post(ctrl.http + "/lookup", json={"tokens": tokens}, timeout=60))

        threads = [threading.Thread(target=lookup, args=(t,)) for t in fresh[4:]]
        for t in threads:
            t.start()
        time.sleep(0.5)
        start = time.monotonic()
        assert ctrl.session.options(ctrl.http + "/lookup", timeout=5).headers["Allow"] == "OPTIONS, POST"
        assert _json(_raw(ctrl.port, b"GARBAGE\r\n\r\n"))[0] == "HTTP/1.1 400 Bad Request"
        assert time.monotonic() - start < 1.0
        assert any(t.is_alive() for t in threads)
        os.kill(server.proc.pid, signal.SIGCONT)
        for t in threads:
            t.join(60)
        assert {w.status_code for w in waiting} <= {200, 503}
        assert [ctrl.layout(t) for t in fresh] == [want] * 8
    finally:
        os.kill(server.proc.pid, signal.SIGCONT)
        ctrl.stop()
        server.stop()


@pytest.mark.single_node
def test_large_fresh_bodies_in_the_heavy_pool_answer_as_fenced_reads(r, redis_args):
    """A packed body over 64 KB (app.asgi.BIG_BODY_BYTES: the heavy pool) with a new last chunk,
    on an unfenced controller (tried from the copies there, a first miss read by digest with the
    held prefix from the copies), answers exactly what a fenced controller (every read from Redis)
    answers, and a hot one likewise."""
    from array import array

    from kvlookup.hashing.lmcache import HashProfile
    from kvlookup.index.store import ADMIT, Store

    prompt = list(range(50_000, 50_000 + 68 * 256))  # 68 chunks, 69,632 bytes packed
    hashes = HashProfile().chunk_hashes(prompt)
    store = Store(r, instance_ttl_s=0)
    for i, held in enumerate((68, 40)):
        store.register_worker(f"big{i}", 0, "127.0.0.1", 8101 + i)
        store.apply([(f"big{i}", 0, "LocalCPUBackend", [(ADMIT, h) for h in hashes[:held]])])
    rng = random.Random(22)
    bodies = [prompt] * 3 + [prompt[:-256] + [rng.randrange(128_000) for _ in range(256)] for _ in range(12)]
    args = (*redis_args, "--workers", "1", "--instance-ttl", "0")
    unfenced = ControllerProc(*args, "--lookup-cache", "on")
    fenced = ControllerProc(*args, "--lookup-cache", "fenced")

    def packed_layout(ctrl, tokens):
        resp = ctrl.session.post(ctrl.http + "/lookup", data=array("I", tokens).tobytes(), timeout=30,
                                 headers={"Content-Type": "application/octet-stream"})
        assert resp.status_code == 200
        return {k: v for k, v in resp.json().items() if k != "event_id"}

    try:
        for ctrl in (unfenced, fenced):
            ctrl.wait_ready()
        got = [packed_layout(unfenced, t) for t in bodies]
        assert got == [packed_layout(fenced, t) for t in bodies]
        hot = {"big0": ["LocalCPUBackend", 68 * 256], "big1": ["LocalCPUBackend", 40 * 256]}
        assert got == [hot] * 3 + [{**hot, "big0": ["LocalCPUBackend", 67 * 256]}] * 12
    finally:
        unfenced.stop()
        fenced.stop()
