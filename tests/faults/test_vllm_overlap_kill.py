"""kill -9 of a vLLM sidecar whose writes are left in flight (``vllm_overlap_writes``, the
default) while a stream pours in, batches published while it is dead, a restart with the same
identity: the index converges to the exact records, engine map and seq of the whole stream.

Real processes: a ``python -m kvlookup sidecar`` subscribed to a loopback vLLM publisher (PUB +
replay ROUTER, vLLM's wire protocol) in this process; Redis from the harness (both backends)."""

from __future__ import annotations

import threading
import time

from kvlookup.index import keys
from tests.sidecar.test_vllm_overlap import engine_map, expected_map, held_after, script, view
from tests.support.helpers import wait_for
from tests.support.procs import SidecarProc
from tests.support.vllm_helpers import LoopbackPublisher, payload


def test_kill9_mid_stream_and_restart_converge_exactly(r, redis_args):
    pub = LoopbackPublisher()
    sc = SidecarProc(*redis_args, "--instance-id", "pod-a", "--vllm-endpoint", pub.endpoint,
                     "--vllm-replay-endpoint", pub.replay_endpoint)
    batches = script(11, 900)
    sent = threading.Event()

    def pour(part: list) -> None:  # as fast as the engine goes: the sidecar writes merged runs
        for k, batch in enumerate(part):
            pub.publish(payload(*batch))
            if k % 50 == 49:
                time.sleep(0.002)
        sent.set()

    try:
        sc.start()
        pub.publish(payload(*batches[0]))
        assert wait_for(lambda: r.hget(keys.instance_key("pod-a"), "seq:0"), "0", timeout=20) == "0"
        writer = threading.Thread(target=pour, args=(batches[1:600],))
        writer.start()
        assert wait_for(lambda: int(r.hget(keys.instance_key("pod-a"), "seq:0") or 0) >= 150, True,
                        timeout=30)
        sc.kill()  # kill -9 while the stream pours in: a write may be in flight
        killed_at = int(r.hget(keys.instance_key("pod-a"), "seq:0"))
        writer.join(30)
        assert sent.is_set()
        assert killed_at < 599  # it died mid-stream
        for batch in batches[600:800]:  # published while it is dead: only replay has them
            pub.publish(payload(*batch))
        sc.start()
        for batch in batches[800:]:
            pub.publish(payload(*batch))
        last = str(len(batches) - 1)
        assert wait_for(lambda: r.hget(keys.instance_key("pod-a"), "seq:0"), last, timeout=60) == last
        held = held_after(batches)
        assert wait_for(lambda: view(r, "pod-a"), held, timeout=30) == held
        assert engine_map(r, "pod-a") == expected_map(held)
        assert r.hget(keys.instance_key("pod-a"), "resync:0") is None
        assert "write_failed" not in sc.metrics()
    finally:
        sc.kill()
        pub.close()
