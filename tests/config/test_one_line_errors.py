"""What users get wrong is said in one line, never a traceback (kvlookup.cli.preflight): a busy
sidecar port, a Redis Cluster with no node, ``reap`` on a Redis that is down, ``bench report``
without matplotlib, a bad ``chunk_size`` in an engine YAML, a top-level ``chunk_size:``,
``KVLOOKUP_*`` variables that are no setting, and an unreachable ``--redis-url`` at start."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys

import pytest

from kvlookup.proc.redis_server import free_port
from tests.support.procs import ROOT

DOWN = "redis://127.0.0.1:1"  # nothing listens on port 1
REFUSED = "Error 111 connecting to 127.0.0.1:1. Connection refused."


def kvlookup(*args: str, env: dict | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvlookup", *args], capture_output=True, text=True, cwd=ROOT,
                          timeout=timeout, env={**os.environ, **(env or {})})


def one_line(done: subprocess.CompletedProcess) -> str:
    assert "Traceback" not in done.stderr, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    return lines[0]


def test_a_busy_sidecar_port_is_named():
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        done = kvlookup("sidecar", "--redis-url", DOWN, "--pull-url", f"127.0.0.1:{port}")
    assert done.returncode == 2
    assert one_line(done) == f"kvlookup: error: pull_url 127.0.0.1:{port} cannot be bound: Address already in use"


def test_a_redis_cluster_with_no_node_is_refused_at_once():
    done = kvlookup("controller", "--redis-url", DOWN, "--redis-cluster", "--port", str(free_port()))
    assert done.returncode == 2
    assert one_line(done) == (f"kvlookup: error: redis_cluster: no node of the Redis Cluster at {DOWN} answers "
                              f"(Redis Cluster cannot be connected. Please provide at least one reachable node: "
                              f"{REFUSED})")


def test_reap_on_a_redis_that_is_down():
    done = kvlookup("reap", "--redis-url", DOWN)
    assert done.returncode == 2
    assert one_line(done) == f"kvlookup: error: Redis does not answer: {REFUSED}"


def test_bench_report_without_matplotlib(tmp_path):
    hidden = tmp_path / "hide" / "matplotlib"
    hidden.mkdir(parents=True)
    (hidden / "__init__.py").write_text("raise ImportError('matplotlib hidden by the test')\n")
    (tmp_path / "results.json").write_text("{}")
    done = kvlookup("bench", "report", "--results", str(tmp_path / "results.json"), "--no-docs",
                    env={"PYTHONPATH": str(tmp_path / "hide")})
    assert done.returncode == 2
    assert one_line(done) == ("kvlookup: error: bench report draws its plots with matplotlib, which is not "
                              "installed: pip install 'kvlookup[bench]'")


@pytest.mark.parametrize(("flag", "yaml", "message"), [
    ("--lmcache-config", "chunk_size: big\n", "lmcache_config '{path}': chunk_size: 'big' is not an integer"),
    ("--config", "chunk_size: 512\n", "config '{path}': unknown setting 'chunk_size' (did you mean hash.chunk_size?)"),
    ("--config", "instance_tll_s: 5\n",
     "config '{path}': unknown setting 'instance_tll_s' (did you mean instance_ttl_s?)"),
])
def test_a_bad_yaml_key_is_named_with_a_hint(tmp_path, flag, yaml, message):
    path = tmp_path / "c.yaml"
    path.write_text(yaml)
    done = kvlookup("controller", flag, str(path), "--port", str(free_port()), "--data-dir", str(tmp_path / "d"))
    assert done.returncode == 2
    assert one_line(done) == "kvlookup: error: " + message.format(path=path)
    assert not (tmp_path / "d").exists()


def test_unknown_kvlookup_variables_warn_with_the_closest_setting(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("port: [1]\n")  # stops right after the warnings
    done = kvlookup("controller", "--config", str(path),
                    env={"KVLOOKUP_CHUNK_SIZE": "512", "KVLOOKUP_INSTANCE_TLL_S": "5", "KVLOOKUP_BOGUS": "1"})
    assert done.stderr.splitlines() == [
        "kvlookup: warning: KVLOOKUP_BOGUS is not a kvlookup setting and is ignored (settings: docs/configuration.md)",
        "kvlookup: warning: KVLOOKUP_CHUNK_SIZE is not a kvlookup setting and is ignored; did you mean "
        "KVLOOKUP_HASH__CHUNK_SIZE (hash.chunk_size)?",
        "kvlookup: warning: KVLOOKUP_INSTANCE_TLL_S is not a kvlookup setting and is ignored; did you mean "
        "KVLOOKUP_INSTANCE_TTL_S (instance_ttl_s)?",
        "kvlookup: error: port: [1] is not an integer"]


def test_an_unreachable_redis_url_is_said_at_start():
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "kvlookup", "controller", "--redis-url", DOWN, "--host",
                             "127.0.0.1", "--port", str(port), "--log-level", "WARNING"], cwd=ROOT,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        first = proc.stderr.readline()
        assert first.rstrip().endswith(f"Redis at {DOWN} does not answer ({REFUSED}): /health and /lookup answer "
                                       "503 until it does"), first
        assert "WARNING" in first
        assert proc.poll() is None  # it starts anyway: /health says 503 until Redis answers
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(30)


def test_every_kvlookup_variable_the_repository_uses_is_a_setting_or_known():
    """A variable read by scripts, tests or benchmarks that is no setting must be in NOT_SETTINGS,
    or every command run under it (CI exports several) warns that it is ignored."""
    import subprocess

    from kvlookup.config import setting_names
    from kvlookup.config.names import NOT_SETTINGS

    text = subprocess.run(["git", "grep", "-ohE", r"KVLOOKUP_[A-Z0-9_]*[A-Z0-9]", "--", "*.py", "*.sh", ".ci/run"],
                          cwd=ROOT, capture_output=True, text=True, check=True).stdout
    misspelt = {"BOGUS", "CHUNK_SIZE", "INSTANCE_TLL_S"}  # this file's own examples of a wrong name
    names = {n[len("KVLOOKUP_"):] for n in text.split()} - misspelt
    known = setting_names()
    assert sorted(n for n in names if n.lower() not in known and n not in NOT_SETTINGS
                  and not n.startswith("HASH")) == []  # KVLOOKUP_HASH__<KEY>: the hash setting
