"""Access control through real sockets: allowed_peers (ZAP on the sidecar's bound sockets),
allowed_instance_ids (ingest), worker_networks (controller -> worker calls).

Linux routes all of 127.0.0.0/8 to lo, so a client picks its source address with ZMQ's
``tcp://SRC:0;HOST:PORT`` endpoint: 127.0.0.1 plays an allowed host, 127.0.0.2 a denied one.
"""

from __future__ import annotations

import contextlib
import ipaddress
import re
import socket
import threading
import time
from pathlib import Path

import msgspec
import pytest
import yaml
import zmq
from prometheus_client import REGISTRY

from kvlookup import cli
from kvlookup.app import create_app
from kvlookup.cli import main
from kvlookup.client import Client, VllmChains
from kvlookup.config import load
from kvlookup.devtools.workersim import WorkerSim
from kvlookup.index import keys
from kvlookup.index.store import Store
from kvlookup.netpolicy import LOOPBACK_NETWORKS, address_allowed, parse_networks
from kvlookup.proc.redis_server import free_port
from kvlookup.sidecar.service import Sidecar
from kvlookup.sidecar.vllm_zmq import VllmSource
from kvlookup.wire import lmcache as proto
from kvlookup.wire import lmcache_control as ctl
from tests.conftest import SEED_HASH, SEED_TOKENS
from tests.support.helpers import SidecarThread, wait_for
from tests.support.vllm_helpers import payload, stored

ONLY_1 = parse_networks("127.0.0.1/32", "allowed_peers")


def rejected(reason: str, source: str) -> float:
    return REGISTRY.get_sample_value("kvlookup_rejected_frames_total", {"source": source, "reason": reason}) or 0


def from_src(src: str, url: str) -> str:
    """ZMQ endpoint connecting to ``url`` (host:port) from source address ``src``."""
    return f"tcp://{src}:0;{url}"


def redis_state(r) -> dict:
    """Every key with its type and exact content (the whole index, for before/after checks)."""
    read = {"string": r.get, "hash": r.hgetall, "set": r.smembers, "list": lambda k: r.lrange(k, 0, -1),
            "zset": lambda k: r.zrange(k, 0, -1, withscores=True)}
    own = (keys.REGISTRY + "sidecar", keys.lease_clock_key())  # the sidecars' leases, status, renewal clock
    return {k: (t, read[t](k)) for k in sorted(r.scan_iter(count=1000)) if not k.startswith(own)
            for t in [r.type(k)]}


def seeded(r, instance_id: str = "victim") -> dict:
    """Register ``instance_id`` with one chunk, as another sidecar would have; the Redis state."""
    store = Store(r)
    store.register_worker(instance_id, 0, "127.0.0.1", 8001)
    store.apply([(instance_id, 0, "LocalCPUBackend", [("a", SEED_HASH)])])
    return redis_state(r)


def wait_denied(before: float, reason: str = "peer_not_allowed", source: str = "zmq") -> float:
    return wait_for(lambda: rejected(reason, source) > before, True)


# -- allowed_peers -------------------------------------------------------------------------


def test_push_from_allowed_peer_applied_from_denied_peer_dropped(r):
    # no liveness leases: their renewal (every second) would change the state compared below
    client = Client(redis=r, instance_ttl_s=0)
    with SidecarThread(Store(r, instance_ttl_s=0), peers=ONLY_1) as sc:
        good = WorkerSim("good", era="0.3", pull_url=from_src("127.0.0.1", sc.pull_url))
        good.register()
        good.admit([SEED_HASH])
        assert wait_for(lambda: client.lookup(SEED_TOKENS)[1], {"good": ("LocalCPUBackend", 12)}) == {
            "good": ("LocalCPUBackend", 12)}
        state = redis_state(r)
        denied = rejected("peer_not_allowed", "zmq")
        bad = WorkerSim("good", era="0.3", pull_url=from_src("127.0.0.2", sc.pull_url))
        bad.push.setsockopt(zmq.SNDTIMEO, 500)  # refused peers have no pipe at times: send may block
        with contextlib.suppress(zmq.Again):
            bad.register()  # applied, a new epoch would retire every record of "good"
            bad.evict([SEED_HASH])
            bad.admit([SEED_HASH + 1])
            bad.deregister()
        assert wait_denied(denied)
        time.sleep(0.3)  # refused at the handshake: nothing it queued can arrive later
        assert redis_state(r) == state
        assert client.lookup(SEED_TOKENS)[1] == {"good": ("LocalCPUBackend", 12)}
        good.close()
        bad.close()


def test_router_register_from_denied_peer_never_reaches_the_registry(r):
    state = seeded(r)
    with SidecarThread(Store(r), peers=ONLY_1) as sc:
        denied = rejected("peer_not_allowed", "zmq")
        bad = WorkerSim("victim", era="0.5", pull_url=from_src("127.0.0.2", sc.pull_url),
                        reply_url=from_src("127.0.0.2", sc.reply_url))
        bad.dealer.setsockopt(zmq.RCVTIMEO, 500)
        bad.dealer.setsockopt(zmq.SNDTIMEO, 500)  # no pipe to a refusing peer at times: send may block
        with pytest.raises(zmq.Again):
            bad.register()
        assert wait_denied(denied)
        start = proto.FullSyncStartMsg("victim", 0, "LocalCPUBackend", "victim_0_x", 0, 1)
        with contextlib.suppress(zmq.Again):  # Again: refused, so no connection to queue on
            bad.dealer.send_multipart([b"", proto.encode(start)], zmq.NOBLOCK)
        assert not bad.dealer.poll(300)
        assert redis_state(r) == state
        bad.close()
        ok = WorkerSim("pod", era="0.5", pull_url=sc.pull_url, reply_url=sc.reply_url)
        assert ok.register()["type"] == "RegisterRetMsg"  # 127.0.0.1 is let through
        ok.close()


def test_default_allows_loopback_and_star_allows_anyone(r):
    with SidecarThread(Store(r)) as sc:  # default: 127.0.0.0/8 and ::1
        w = WorkerSim("a", era="0.5", pull_url=from_src("127.0.0.2", sc.pull_url),
                      reply_url=from_src("127.0.0.2", sc.reply_url))
        assert w.register()["type"] == "RegisterRetMsg"
        w.close()
    with SidecarThread(Store(r), peers=parse_networks("*", "allowed_peers")) as sc:
        assert sc.sidecar.pull.zap_domain == b""  # no ZAP at all
        w = WorkerSim("b", era="0.5", pull_url=from_src("127.0.0.2", sc.pull_url),
                      reply_url=from_src("127.0.0.2", sc.reply_url))
        assert w.register()["type"] == "RegisterRetMsg"
        w.close()


def test_bound_vllm_sub_is_guarded(r):
    url = f"127.0.0.1:{free_port()}"
    sidecar = Sidecar(Store(r), None, vllm=(VllmSource("pod-v", url, bind=True),), peers=ONLY_1)
    thread = threading.Thread(target=sidecar.run, daemon=True)
    thread.start()
    ctx = zmq.Context.instance()
    pubs = {src: ctx.socket(zmq.PUB) for src in ("127.0.0.1", "127.0.0.2")}
    denied = rejected("peer_not_allowed", "zmq")
    for src, pub in pubs.items():
        pub.setsockopt(zmq.LINGER, 0)
        pub.connect(from_src(src, url))
    assert wait_denied(denied)
    tokens = {"127.0.0.1": list(range(1000, 1016)), "127.0.0.2": list(range(2000, 2016))}
    block = {"127.0.0.1": 1, "127.0.0.2": 2}
    seqs = iter(range(1_000_000))

    def publish_both():  # again on every poll: a PUB drops what it sends before the subscription arrives
        for src, pub in pubs.items():
            pub.send_multipart([b"kv@pod-v", next(seqs).to_bytes(8, "big"), payload(stored([block[src]], tokens[src]))])

    client = Client(redis=r, extra_chains=[VllmChains(r, refresh_s=0)])

    def layout(t):
        return [(m.instance_id, m.matched_prefix_length) for m in client.matches(t)]

    assert wait_for(lambda: publish_both() or layout(tokens["127.0.0.1"]), [("pod-v", 16)]) == [("pod-v", 16)]
    publish_both()
    time.sleep(0.2)
    assert layout(tokens["127.0.0.2"]) == []
    for pub in pubs.values():
        pub.close()
    sidecar.stop()
    thread.join(5)


# -- allowed_instance_ids ------------------------------------------------------------------


def test_spoofed_messages_for_other_instances_leave_their_records_alone(r):
    state = seeded(r, "victim")
    with SidecarThread(Store(r), allowed_instance_ids=("pod",)) as sc:
        before = rejected("instance_not_allowed", "lmcache")
        spoof = WorkerSim("victim", era="0.5", pull_url=sc.pull_url, reply_url=sc.reply_url)
        reply = spoof.register()
        assert reply == {"type": "ErrorMsg", "error": "instance 'victim' is not in this sidecar's allowed_instance_ids"}
        start = proto.FullSyncStart("victim", 0, "LocalCPUBackend", "victim_0_x", 0, 1)
        reply = spoof.request(proto.FullSyncStartMsg(**msgspec.structs.asdict(start)))
        assert reply["type"] == "ErrorMsg"
        assert spoof.heartbeat()["type"] == "ErrorMsg"
        spoof.push.send_multipart([proto.encode(proto.RegisterMsgV3("victim", 0, "10.9.9.9", 1, "x:1")),
                                   proto.encode(proto.KVEvictMsg("victim", 0, SEED_HASH, "LocalCPUBackend"))])
        spoof.deregister()
        assert wait_for(lambda: rejected("instance_not_allowed", "lmcache") - before, 6) == 6
        now = redis_state(r)
        assert list(now.pop(keys.claims_key())[1]) == ["pod"]  # the sidecar claims what its list names
        assert now == state
        pod = WorkerSim("pod", era="0.5", pull_url=sc.pull_url, reply_url=sc.reply_url)
        assert pod.register()["type"] == "RegisterRetMsg"
        pod.close()
        spoof.close()


# -- worker_networks -----------------------------------------------------------------------


@pytest.fixture()
def listener():
    """A TCP listener on 127.0.0.3 (loopback, but outside 127.0.0.1/32): counts connection attempts."""
    sock = socket.socket()
    sock.bind(("127.0.0.3", 0))
    sock.listen(8)
    sock.setblocking(False)
    yield sock
    sock.close()


def accepts(sock: socket.socket, wait_s: float = 0.3) -> int:
    sock.settimeout(wait_s)
    n = 0
    try:
        while True:
            conn, _ = sock.accept()
            conn.close()
            n += 1
    except (TimeoutError, BlockingIOError):
        return n


def _app(redis_settings, **settings):
    return create_app({**redis_settings, "control_timeout_s": 0.3, "control_retries": 0, **settings})


def test_health_outside_worker_networks_is_refused_without_connecting(redis_settings, store, listener):
    port = listener.getsockname()[1]
    store.register_worker("far", 0, "10.1.2.3", 8001)
    store.register_worker("near", 0, "127.0.0.3", port)
    app = _app(redis_settings, worker_networks="127.0.0.1/32")
    http = app.test_client()
    far = http.post("/health", json={"instance_id": "far"}).get_json()
    assert far["error_codes"] == {"0": -1006}
    assert far["errors"]["0"] == "worker address 10.1.2.3:8001 is not in worker_networks (127.0.0.1/32); not contacted"
    assert http.post("/health", json={"instance_id": "near"}).get_json()["error_codes"] == {"0": -1006}
    for path, body in (("/clear", {"location": "LocalCPUBackend"}), ("/pin", {"location": "x", "tokens": [1]}),
                       ("/compress", {"method": "cachegen", "location": "x"})):
        resp = http.post(path, json={"instance_id": "near", **body})
        assert resp.status_code == 403, path
        assert resp.get_json() == {"error": f"worker 0: worker address 127.0.0.3:{port} is not in "
                                            "worker_networks (127.0.0.1/32); not contacted"}
    assert accepts(listener) == 0
    app.extensions["kvlookup"]["control"].close()
    # the probe works: with 127.0.0.0/8 allowed, the same call does connect (and times out)
    app = _app(redis_settings, worker_networks=["127.0.0.0/8"])
    assert app.test_client().post("/health", json={"instance_id": "near"}).get_json()["error_codes"] == {"0": -1004}
    assert accepts(listener) == 1
    app.extensions["kvlookup"]["control"].close()


def test_default_worker_networks_refuse_remote_workers(redis_settings, store):
    store.register_worker("far", 0, "10.1.2.3", 8001)
    store.register_worker("named", 0, "pod-a.internal", 8001)
    app = _app(redis_settings)
    http = app.test_client()
    assert http.post("/clear", json={"instance_id": "far", "location": "x"}).status_code == 403
    assert http.post("/health", json={"instance_id": "named"}).get_json()["error_codes"] == {"0": -1006}
    assert http.post("/check_finish", json={"event_id": "x"}).status_code == 404
    app.extensions["kvlookup"]["control"].close()
    star = ctl.ControlClient(networks=parse_networks("*", "worker_networks"))  # '*' allows hostnames too
    assert star.refusal(ctl.Target(0, "pod-a.internal", 8001, ctl.HealthWorkerMsg("x"))) == ""
    star.close()



# -- settings ------------------------------------------------------------------------------


def test_allow_lists_parse_and_match():
    nets = parse_networks("10.0.0.0/8, 192.168.1.7 ,fd00::/8", "x")
    assert str(nets) == "10.0.0.0/8, 192.168.1.7/32, fd00::/8"
    assert [address_allowed(a, nets) for a in ("10.1.2.3", "192.168.1.7", "192.168.1.8", "fd00::1",
                                               "::ffff:10.0.0.1", "[fd00::2]", "pod-a", "")] == [
        True, True, False, True, True, True, False, False]
    assert address_allowed("pod-a", parse_networks(["*"], "x"))
    assert not address_allowed("pod-a", parse_networks("0.0.0.0/0", "x"))
    assert address_allowed("8.8.8.8", parse_networks('["0.0.0.0/0"]', "x"))
    assert [address_allowed(a, LOOPBACK_NETWORKS) for a in ("127.0.0.1", "127.9.9.9", "::1", "10.0.0.1")] == [
        True, True, True, False]


def test_settings_defaults_env_and_files():
    s = load(None, env={})
    assert (s.allowed_peers, s.worker_networks, s.allowed_instance_ids) == (["127.0.0.0/8", "::1"],) * 2 + ([],)
    assert s.peer_networks() == LOOPBACK_NETWORKS == s.worker_nets()
    s = load(None, env={"KVLOOKUP_ALLOWED_PEERS": "10.0.0.0/8,127.0.0.1", "KVLOOKUP_WORKER_NETWORKS": '["*"]',
                        "KVLOOKUP_ALLOWED_INSTANCE_IDS": "pod-a, pod-b"})
    assert (s.allowed_peers, s.worker_nets().any, s.allowed_instance_ids) == (
        ["10.0.0.0/8", "127.0.0.1"], True, ["pod-a", "pod-b"])


@pytest.mark.parametrize(("layer", "message"), [
    ({"allowed_peers": "abc"}, "allowed_peers: 'abc' is not an IP address or network"),
    ({"allowed_peers": ["10.0.0.0/8", "10.0.0.0/33"]}, "allowed_peers: '10.0.0.0/33' is not an IP address"),
    ({"worker_networks": "pod-a.internal"}, "worker_networks: 'pod-a.internal' is not an IP address or network"),
    ({"worker_networks": ""}, "worker_networks: the list is empty"),
    ({"allowed_peers": "[1,"}, r"allowed_peers: '\[1,' is not a JSON list"),
    ({"allowed_peers": {"a": 1}}, "allowed_peers: expected a list"),
    ({"allowed_instance_ids": ["ok", "b\x01d"]}, r"allowed_instance_ids: 'b\\x01d' is not 1..256 printable"),
    ({"allowed_instance_ids": "a,b", "instance_id": "c"}, "instance_id 'c' is not in allowed_instance_ids"),
])
def test_bad_access_settings_are_named(layer, message):
    with pytest.raises(ValueError, match=message):
        load(None, overrides=layer, env={})


def test_cli_refuses_bad_values_before_starting(capsys):
    assert main(["sidecar", "--pull-url", "127.0.0.1:1", "--allowed-peers", "abc"]) == 2
    assert "allowed_peers: 'abc' is not an IP address or network" in capsys.readouterr().err
    assert main(["controller", "--worker-networks", "10.0.0.0/8,nope"]) == 2
    assert "worker_networks: 'nope' is not an IP address or network" in capsys.readouterr().err


def test_embedded_sidecar_gets_the_controllers_allow_lists(tmp_path):
    settings = load(None, overrides={"redis_url": "redis://x", "monitor_port": 9001, "allowed_peers": "10.0.0.0/8",
                                     "allowed_instance_ids": "pod-a"}, env={})
    child = cli._spawn_embedded_sidecar(settings, str(tmp_path))  # the supervised child, not started
    args = cli.build_parser().parse_args(child.argv[child.argv.index("kvlookup") + 1:])
    child = load(args.config, overrides=cli._overrides(args, "sidecar"), env={})
    assert (child.allowed_peers, child.allowed_instance_ids, child.pull_url) == (
        ["10.0.0.0/8"], ["pod-a"], "127.0.0.1:9001")


def test_compose_allows_its_own_network():
    compose = yaml.safe_load((Path(__file__).resolve().parents[2] / "docker-compose.yml").read_text())
    subnet = compose["networks"]["default"]["ipam"]["config"][0]["subnet"]
    for name, setting in (("sidecar", "peer_networks"), ("controller", "worker_nets")):
        env = {k: re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", v) for k, v in compose["services"][name]["environment"].items()}
        nets = getattr(load(None, env=env), setting)()
        assert address_allowed("172.28.0.1", nets) and address_allowed("127.0.0.1", nets), name
        assert ipaddress.ip_network(subnet) in nets.nets, name
