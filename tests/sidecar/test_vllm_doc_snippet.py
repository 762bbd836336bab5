"""docs/vllm.md "Checking a setup by hand": its publisher snippet, run as printed (only its port
changed to a free one) against a real sidecar and controller, gives the answer the doc names
while it runs, and once it exits the same lookup answers nothing after disconnect_grace_s, as
the doc says (the sidecar takes the closed socket as the engine stopping)."""

from __future__ import annotations

import re
import subprocess
import sys
import time

from kvlookup.proc.redis_server import free_port
from tests.support.helpers import wait_for
from tests.support.procs import ROOT, ControllerProc, SidecarProc

TOKENS = list(range(1000, 1032))


def snippet() -> str:
    text = (ROOT / "docs" / "vllm.md").read_text()
    section = text.split("## Checking a setup by hand", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_the_vllm_md_publisher_snippet_answers_while_it_runs_and_not_after(redis_args):
    code = snippet()
    assert 'pub.bind("tcp://127.0.0.1:5557")' in code and "input(" in code
    port = free_port()
    code = code.replace("5557", str(port))
    ctrl = ControllerProc(*redis_args)
    sidecar = SidecarProc(*redis_args, "--instance-id", "pod-a", "--vllm-endpoint", f"tcp://127.0.0.1:{port}",
                          env={"KVLOOKUP_DISCONNECT_GRACE_S": "1"})
    engine = None
    try:
        ctrl.wait_ready()
        sidecar.start()
        engine = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  text=True, cwd=ROOT)
        assert wait_for(lambda: ctrl.layout(TOKENS), {"pod-a": ["GPU", 32]}, timeout=30) == {"pod-a": ["GPU", 32]}
        time.sleep(1.5)  # longer than the grace: the running script's open socket keeps it
        assert ctrl.layout(TOKENS) == {"pod-a": ["GPU", 32]}
        engine.communicate("\n", timeout=30)  # Enter: the script exits
        assert engine.returncode == 0
        assert wait_for(lambda: ctrl.layout(TOKENS), {}, timeout=30) == {}
    finally:
        if engine is not None and engine.poll() is None:
            engine.kill()
            engine.wait(5)
        sidecar.stop()
        ctrl.stop()
