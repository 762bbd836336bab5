"""Settings load in layers; shipped example files stay valid; compose file parses."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from kvlookup.config import load

ROOT = Path(__file__).resolve().parents[2]


def test_layers_defaults_file_env_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("port: 9100\nlookup_response: layout_info\nhash: {chunk_size: 512}\n")
    settings = load(str(path), overrides={"port": 9200}, env={"KVLOOKUP_MAX_TOKENS": "77",
                                                              "KVLOOKUP_HASH__SAVE_UNFULL_CHUNK": "false"})
    assert (settings.port, settings.lookup_response, settings.max_tokens) == (9200, "layout_info", 77)
    profile = settings.profile()
    assert (profile.chunk_size, profile.save_unfull_chunk, profile.extra_keys) == (512, False, "empty")
    assert settings.host == "127.0.0.1"  # loopback unless configured


@pytest.mark.parametrize(("layer", "message"), [
    ({"lookup_response": "xml"}, "lookup_response: 'xml' is not one of flat, layout_info"),
    ({"port": 0}, r"port: 0 is not a TCP port \(1..65535\)"),
    ({"gunicorn_worker_class": "eventlet"},
     "gunicorn_worker_class: 'eventlet' is not one of uvicorn, gevent, gthread, sync"),
    ({"nope": 1}, "unknown setting 'nope'"),
    ({"hash": {"chunk_size": -1}}, "hash.chunk_size: -1 is not a positive integer"),
    ({"gunicorn_workers": 100000}, r"gunicorn_workers: 100000 is not an integer 1..256"),
    ({"lookup_cache": "maybe"}, "lookup_cache: 'maybe' is not one of on, fenced, off"),
    ({"lookup_cache_keys": 0}, "lookup_cache_keys: 0 is not a positive integer"),
    ({"redis_url": "http://user:secret@x"},
     r"^redis_url: scheme 'http' is not one of redis://, rediss://, unix://, redis\+sentinel:// "
     r"\(the URL itself is not shown: it may carry a password\)$"),
    ({"pull_url": "localhost:abc"}, "pull_url: 'localhost:abc' is not host:port or a ZMQ endpoint"),
    ({"reply_url": "nohost"}, "reply_url: 'nohost' is not host:port or a ZMQ endpoint"),
])
def test_bad_settings_are_named(layer, message):
    with pytest.raises(ValueError, match=message):
        load(None, overrides=layer, env={})


@pytest.mark.parametrize("name", ["controller.yaml", "sidecar.yaml"])
def test_example_configs_load(name):
    settings = load(str(ROOT / "config" / name), env={})
    assert settings.profile().chunk_size == 256


def test_monitor_ports():
    settings = load(None, overrides={"monitor_ports": {"pull": 9001, "reply": 9002}}, env={})
    assert (settings.pull_port(), settings.reply_port()) == (9001, 9002)
    settings = load(None, overrides={"monitor_port": 9001}, env={})
    assert (settings.pull_port(), settings.reply_port()) == (9001, None)


def test_compose_file_is_valid_yaml_with_three_services():
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    default = {name for name, s in compose["services"].items() if "profiles" not in s}
    assert default == {"redis", "controller", "sidecar"}
    assert compose["services"]["controller"]["command"][0] == "controller"


def test_compose_cluster_profile_is_consistent():
    """`docker compose config` needs a Docker engine; check by hand what it would."""
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    services = compose["services"]
    cluster = {name for name, s in services.items() if s.get("profiles") == ["cluster"]}
    nodes = {f"valkey-{i}" for i in range(1, 7)}
    assert cluster == nodes | {"cluster-init", "cluster-controller", "cluster-sidecar"}
    for name in nodes:
        assert "--cluster-enabled" in services[name]["command"] and services[name]["volumes"] == [f"{name}:/data"]
    init = services["cluster-init"]
    hosts = init["command"][0].split("for h in ", 1)[1].split(";", 1)[0].split()
    assert set(init["depends_on"]) == nodes == set(hosts)
    assert "--cluster-replicas 1" in init["command"][0]
    for name in ("cluster-controller", "cluster-sidecar"):
        cmd = services[name]["command"]
        assert "--redis-cluster" in cmd and cmd[cmd.index("--redis-url") + 1] == "redis://valkey-1:6379/0"
        assert services[name]["depends_on"] == {"cluster-init": {"condition": "service_completed_successfully"}}
    ports = [p for s in services.values() for p in s.get("ports", [])]
    assert len(ports) == len(set(ports))  # both stacks can run side by side
    for s in services.values():
        assert {v.split(":")[0] for v in s.get("volumes", [])} <= set(compose["volumes"])
        assert set(s.get("depends_on") or {}) <= set(services)
