"""The embedded Redis: binary discovery, URL forms, reuse by data dir, AOF persistence."""

from __future__ import annotations

import pytest
import redis

from kvlookup import redis_server
from kvlookup.config import Settings
from kvlookup.redis_server import EmbeddedRedis, connect, running_url
from kvlookup.runtime import ensure_redis


def test_binary_comes_from_path_or_the_valkey_wheel():
    path = redis_server.find_server_binary()
    assert path.endswith(("redis-server", "valkey-server"))


def test_password_and_unix_socket_urls(tmp_path):
    sock = str(tmp_path / "r.sock")
    server = EmbeddedRedis(tmp_path / "d", password="s3cret", unix_socket=sock, appendonly=False)
    url = server.start()
    try:
        assert url == f"redis://:s3cret@127.0.0.1:{server.port}/0"
        assert connect(url).ping() is True
        assert connect(f"unix://:s3cret@{sock}?db=0").ping() is True
        with pytest.raises(redis.AuthenticationError):
            connect(f"redis://:wrong@127.0.0.1:{server.port}/0").ping()
    finally:
        server.stop()


def test_rediss_url_uses_tls():
    client = connect("rediss://:pw@example.invalid:6380/0")
    kwargs = client.connection_pool.connection_kwargs
    assert client.connection_pool.connection_class.__name__ == "SSLConnection"
    assert (kwargs["password"], kwargs["port"]) == ("pw", 6380)


def test_processes_share_one_embedded_server_per_data_dir(tmp_path):
    first = Settings(data_dir=str(tmp_path))
    server = ensure_redis(first)
    try:
        assert server is not None and running_url(tmp_path) == first.redis_url
        second = Settings(data_dir=str(tmp_path))
        assert ensure_redis(second) is None and second.redis_url == first.redis_url
        assert connect(first.redis_url).config_get("appendonly") == {"appendonly": "yes"}
        assert connect(first.redis_url).config_get("appendfsync") == {"appendfsync": "everysec"}
    finally:
        server.stop()
    assert running_url(tmp_path) is None


def test_restarted_embedded_server_keeps_its_port(tmp_path):
    """A sidecar holding the URL of a controller's embedded Redis reconnects after a restart."""
    first = EmbeddedRedis(tmp_path)
    url = first.start()
    connect(url).set("k", "v")
    first.stop()
    second = EmbeddedRedis(tmp_path)
    try:
        assert second.start() == url
        assert connect(url).get("k") == "v"  # and the AOF brought the data back
    finally:
        second.stop()
