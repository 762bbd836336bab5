"""Catch-up on connect: at sidecar start and on every (re)connect of a vLLM SUB socket the
sidecar asks the replay endpoint for what it missed, so a batch the SUB never saw is applied
without waiting for a later live batch. Real ZMQ sockets, real Redis, a loopback publisher
that speaks vLLM's protocol (tests/compat/test_vllm_real_033.py does the same with vLLM's own)."""

from __future__ import annotations

import time

import pytest

from kvlookup import metrics
from kvlookup.client import Client, VllmChains
from kvlookup.sidecar.vllm_zmq import VllmSource
from tests.support.helpers import vllm_sidecar, wait_for
from tests.support.vllm_helpers import LoopbackPublisher, layout, payload, stored

A = list(range(1000, 1032))
B = list(range(2000, 2016))


@pytest.fixture()
def client(r):
    return Client(redis=r, extra_chains=[VllmChains(r, refresh_s=0)])


def catchups(outcome: str) -> float:
    return metrics.CATCHUPS.labels(outcome)._value.get()


def test_restarted_publisher_one_missed_batch_then_quiet(r, client):
    pub = LoopbackPublisher()
    port, rport = pub.port, pub.replay_port
    sc = vllm_sidecar(r, VllmSource("pod-a", pub.endpoint, pub.replay_endpoint, replay_timeout_s=0.5))
    try:
        pub.publish(payload(stored([1, 2], A)))
        pub.publish(payload(stored([3], B)))
        assert wait_for(lambda: layout(client, A), {"pod-a": ("GPU", 32)}) == {"pod-a": ("GPU", 32)}
        pub.close()  # the engine stops ...
        rebuilt = catchups("rebuilt")
        pub = LoopbackPublisher(port=port, replay_port=rport)  # ... and comes back: seq from 0
        pub.publish(payload(stored([9], B)), send=False)  # its one batch, never seen live; then quiet
        start = time.monotonic()
        want = ({}, {"pod-a": ("GPU", 16)})
        assert wait_for(lambda: (layout(client, A), layout(client, B)), want, timeout=3.0) == want
        took = time.monotonic() - start
        ing = sc.ingest("pod-a")
        assert (ing.ranks[0].last, dict(ing.resyncs), catchups("rebuilt") - rebuilt) == (0, {"engine_restart": 1}, 1)
        assert took < 3.0
    finally:
        sc.close()
        pub.close()


def test_sidecar_restarted_while_its_engine_published(r, client):
    pub = LoopbackPublisher()
    source = VllmSource("pod-a", pub.endpoint, pub.replay_endpoint, replay_timeout_s=0.5)
    sc = vllm_sidecar(r, source)
    try:
        pub.publish(payload(stored([1, 2], A)))
        assert wait_for(lambda: layout(client, A), {"pod-a": ("GPU", 32)}) == {"pod-a": ("GPU", 32)}
        sc.close()
        pub.publish(payload(stored([3], B)))  # nobody listens
        pub.publish(payload(stored([4], B[:8] + A[:8])))
        resumed = catchups("resumed")
        start = time.monotonic()
        sc = vllm_sidecar(r, source)  # and the engine stays quiet from now on
        want = {"pod-a": ("GPU", 16)}
        assert wait_for(lambda: layout(client, B), want, timeout=3.0) == want
        took = time.monotonic() - start
        ing = sc.ingest("pod-a")
        assert (ing.ranks[0].last, dict(ing.resyncs), catchups("resumed") - resumed) == (2, {}, 1)
        assert layout(client, A) == {"pod-a": ("GPU", 32)}  # kept: the same engine, resumed
        assert took < 3.0
    finally:
        sc.close()
        pub.close()


def test_new_publisher_is_read_from_seq_0_at_start(r, client):
    pub = LoopbackPublisher()
    try:
        pub.publish(payload(stored([1, 2], A)), send=False)
        sc = vllm_sidecar(r, VllmSource("pod-a", pub.endpoint, pub.replay_endpoint, replay_timeout_s=0.5))
        try:
            want = {"pod-a": ("GPU", 32)}
            assert wait_for(lambda: layout(client, A), want, timeout=3.0) == want
            assert sc.ingest("pod-a").ranks[0].last == 0
        finally:
            sc.close()
    finally:
        pub.close()
