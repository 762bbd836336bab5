"""Settings are declared once: flags, the embedded sidecar's settings and the docs table follow.

The bug this guards against: the controller built its embedded sidecar's command line by hand,
so ``worker_networks``, ``disconnect_grace_s``, ``max_queued_ops`` and ``control_timeout_s`` from
``--config`` or flags never reached it.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import requests

from kvlookup import cli
from kvlookup.config import Settings, load
from kvlookup.config.options import EMBEDDED, SIDECAR, declared, markdown_table
from kvlookup.devtools.workersim import SimEngine
from kvlookup.proc.redis_server import free_port
from tests.support.procs import ControllerProc

ROOT = Path(__file__).resolve().parents[2]

#: a value other than the default for every setting a sidecar reads
#: A password file (its first line is the password; a mounted secret in production).
PASSWORD_FILE = Path(__file__).with_name("embedded_redis_password.txt")
SIDECAR_VALUES = {
    "redis_url": "redis://10.0.0.9:6380/2", "redis_cluster": False, "data_dir": "/tmp/kvl-x",
    "instance_ttl_s": 12.5, "worker_ttl_s": 7.0, "log_level": "DEBUG", "host": "127.0.0.2",
    "max_body_bytes": 123456, "body_timeout_s": 3.5,
    "control_timeout_s": 0.7, "control_retries": 3, "worker_networks": ["10.0.0.0/8"],
    "instance_id": "pod-z", "advertise_reply": "pod-z.internal:9002", "sidecar_id": "box-1/embedded",
    "metrics_port": 9555, "disconnect_grace_s": 0.25, "max_frame_bytes": 1000, "max_message_bytes": 2000,
    "max_queued_ops": 1234, "max_workers_per_instance": 12, "allowed_peers": ["10.1.0.0/16"],
    "embedded_redis_password": "pw-z", "embedded_redis_password_file": str(PASSWORD_FILE),
    "allowed_instance_ids": ["pod-z"], "shared_instance_ownership": True,
    "vllm_endpoint": "tcp://pod-z:5557", "vllm_replay_endpoint": "tcp://pod-z:5558", "vllm_dp_size": 2,
    "vllm_bind": True, "vllm_topic": "kv@pod-z", "vllm_replay_timeout_s": 0.5, "vllm_url": "http://pod-z:8000",
    "vllm_overlap_writes": False, "lmcache_overlap_writes": False,
    "model": "model-z", "mp_listen": "127.0.0.1:9333", "mp_chunk_size": 512, "mp_instance_timeout_s": 12.0,
    "mp_replica_acks": 1, "native": "off",
}


def _sidecar_read() -> list[str]:
    return [f.name for f, opt in declared(Settings) if SIDECAR in opt.readers or EMBEDDED in opt.readers]


def test_every_setting_a_sidecar_reads_reaches_the_embedded_sidecar(tmp_path):
    assert sorted(set(_sidecar_read()) - {"pull_url", "reply_url"}) == sorted(SIDECAR_VALUES)  # a new one: add it
    settings = load(None, overrides={**SIDECAR_VALUES, "monitor_ports": {"pull": 9101, "reply": 9102}}, env={})
    child = cli._spawn_embedded_sidecar(settings, str(tmp_path))  # the supervised child, not started
    assert child.argv[-4:] == ["kvlookup", "sidecar", "--config", str(tmp_path / "embedded-sidecar.json")]
    assert (tmp_path / "embedded-sidecar.json").stat().st_mode & 0o777 == 0o600
    args = cli.build_parser().parse_args(child.argv[child.argv.index("kvlookup") + 1:])
    got = load(args.config, overrides=cli._overrides(args, "sidecar"), env={})
    for name, value in SIDECAR_VALUES.items():
        assert getattr(got, name) == value, name
    assert (got.pull_url, got.reply_url, got.monitor_ports) == ("127.0.0.2:9101", "127.0.0.2:9102", None)
    assert child.ports == [("127.0.0.2", 9101), ("127.0.0.2", 9102)]


def test_no_setting_or_secret_on_the_embedded_sidecars_command_line(tmp_path):
    settings = load(None, overrides={"redis_url": "redis://:s3cret@127.0.0.1:6379/0", "monitor_port": 9001,
                                     "api_token": "tok"}, env={})
    child = cli._spawn_embedded_sidecar(settings, str(tmp_path))
    assert not any("s3cret" in a or "tok" == a for a in child.argv)
    assert json.loads((tmp_path / "embedded-sidecar.json").read_text())["redis_url"].endswith("@127.0.0.1:6379/0")


def test_each_command_has_a_flag_for_every_setting_it_reads():
    parser = cli.build_parser()
    for command, flags in (("controller", ["--worker-networks", "10.0.0.0/8", "--disconnect-grace", "0.5",
                                           "--max-queued-ops", "99", "--control-timeout", "0.3"]),
                           ("sidecar", ["--worker-networks", "10.0.0.0/8", "--disconnect-grace", "0.5",
                                        "--max-queued-ops", "99", "--control-timeout", "0.3"])):
        args = parser.parse_args([command, *flags])
        got = load(None, overrides=cli._overrides(args, command), env={})
        assert (got.worker_networks, got.disconnect_grace_s, got.max_queued_ops, got.control_timeout_s) == (
            ["10.0.0.0/8"], 0.5, 99, 0.3), command


def test_docs_configuration_table_is_the_declared_one():
    doc = (ROOT / "docs" / "configuration.md").read_text()
    assert markdown_table(Settings) in doc, "docs/configuration.md: run python -m kvlookup.devtools.docgen"


def _worker_seen(ctl: ControllerProc, instance_id: str) -> bool:
    rows = requests.get(f"{ctl.http}/controller/workers", timeout=5).json()["workers"]
    return any(w["instance_id"] == instance_id for w in rows)


def _run(tmp_path, config: dict) -> tuple[bool, int, float]:
    """Controller with ``config`` and an embedded sidecar; a 0.5-era engine registers, then its
    connections close. Returns (still registered after 6 s, health calls it got, seconds to drop)."""
    pull, reply = free_port(), free_port()
    tmp_path.mkdir()
    path = tmp_path / "controller.yaml"
    path.write_text(json.dumps({**config, "monitor_ports": {"pull": pull, "reply": reply},
                                "data_dir": str(tmp_path / "data"), "disconnect_grace_s": 0.3}))
    ctl = ControllerProc("--config", str(path)).wait_ready()
    engine = SimEngine("pod-net", era="0.5", pull_url=f"127.0.0.1:{pull}", reply_url=f"127.0.0.1:{reply}")
    try:
        engine.register()
        deadline = time.monotonic() + 10
        while not _worker_seen(ctl, "pod-net"):
            assert time.monotonic() < deadline, "registration never arrived"
            time.sleep(0.1)
        for w in engine.workers:
            w.close()  # its connections close; its control port still answers
        start = time.monotonic()
        while time.monotonic() - start < 6 and _worker_seen(ctl, "pod-net"):
            time.sleep(0.1)
        return _worker_seen(ctl, "pod-net"), engine.health_calls, time.monotonic() - start
    finally:
        engine.close(deregister=False)
        ctl.stop()


def test_controller_config_worker_networks_is_enforced_by_its_embedded_sidecar(tmp_path):
    # allowed (the default loopback): the sidecar asks the worker's control port, which answers
    stays, calls, _ = _run(tmp_path / "a", {})
    assert stays and calls >= 1
    # 10.0.0.0/8 only: the worker at 127.0.0.1 is never contacted; its closed connections are the evidence
    stays, calls, took = _run(tmp_path / "b", {"worker_networks": ["10.0.0.0/8"]})
    assert (stays, calls) == (False, 0) and took < 6
