"""The embedded Redis: binary discovery, URL forms, AOF persistence, and the shared server of a
data dir (one per dir, kept by a keeper while any user lives, restarted when killed)."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
import redis

from kvlookup.cli import build_parser
from kvlookup.config import Settings
from kvlookup.proc import embedded, redis_server
from kvlookup.proc.embedded import served_by
from kvlookup.proc.redis_server import EmbeddedRedis, connect, ping, running_url
from kvlookup.proc.runtime import ensure_redis
from tests.support.helpers import until
from tests.support.procs import ROOT
from tests.support.procs_embedded import UserProc, alive, keepers_of, kill9, servers_of


def test_binary_comes_from_path_or_the_valkey_wheel():
    path = redis_server.find_server_binary()
    assert path.endswith(("redis-server", "valkey-server"))


def test_free_port_never_hands_the_same_port_out_twice():
    """CI once gave a controller the port its monitor reply socket had been given a moment before."""
    ports = [redis_server.free_port() for _ in range(300)]
    assert len(set(ports)) == 300


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
    lease = ensure_redis(first)
    second = Settings(data_dir=str(tmp_path))
    other = ensure_redis(second)
    try:
        assert second.redis_url == first.redis_url == running_url(tmp_path)
        assert (lease.keepers_started, other.keepers_started) == (1, 0)
        assert connect(first.redis_url).config_get("appendonly") == {"appendonly": "yes"}
        assert connect(first.redis_url).config_get("appendfsync") == {"appendfsync": "everysec"}
        lease.stop()  # the process that started it leaves: the server stays for the other
        time.sleep(3 * embedded.USER_CHECK_S)
        assert running_url(tmp_path) == first.redis_url
    finally:
        other.stop()
    assert running_url(tmp_path) is None and served_by(tmp_path) is None  # the last user's stop waits for it


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


def test_concurrent_starts_on_a_fresh_dir_end_with_one_server(tmp_path):
    users = [UserProc(tmp_path) for _ in range(4)]  # all racing for the fresh dir
    infos = [u.ready().info for u in users]
    try:
        assert len({i["url"] for i in infos}) == 1 and len({i["pid"] for i in infos}) == 1
        assert servers_of(tmp_path) == [infos[0]["server_pid"]]
        assert keepers_of(tmp_path) == [infos[0]["pid"]]
        assert embedded.live_users(tmp_path) == 4
    finally:
        for u in users:
            u.leave()
    gone = until(lambda: not servers_of(tmp_path) and not keepers_of(tmp_path), 5)
    print(f"server stopped {gone:.2f} s after the last user left")
    assert served_by(tmp_path) is None and not (tmp_path / "redis.url").exists()
    assert list((tmp_path / "users").iterdir()) == []


def test_the_server_lives_until_its_last_user_leaves_even_by_kill9(tmp_path):
    starter, other = UserProc(tmp_path).ready(), UserProc(tmp_path).ready()
    url, server = starter.info["url"], starter.info["server_pid"]
    try:
        starter.leave()
        time.sleep(3 * embedded.USER_CHECK_S)  # three counts of the users: the other one is live
        assert ping(url) and servers_of(tmp_path) == [server] and embedded.live_users(tmp_path) == 1
        other.kill9()  # the kernel drops its user lock: the keeper sees no user left
        gone = until(lambda: not alive(server) and not keepers_of(tmp_path), 5)
        print(f"server stopped {gone:.2f} s after its last user was killed")
        assert gone < 2.0 and served_by(tmp_path) is None and not ping(url)
        assert list((tmp_path / "users").iterdir()) == []  # the dead user's file is pruned
    finally:
        other.kill9()


def _kvlookup_redis(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvlookup", "redis", *args], capture_output=True, text=True,
                          timeout=30, cwd=ROOT)


def test_kvlookup_redis_refuses_a_served_dir_naming_who_serves_it(tmp_path):
    lease = ensure_redis(Settings(data_dir=str(tmp_path)))
    try:
        refused = _kvlookup_redis("--data-dir", str(tmp_path))
        assert refused.returncode == 2, refused.stderr
        assert (f"kvlookup redis: error: data dir {tmp_path} is already served by pid {lease.info['pid']} "
                f"(keeper) at {lease.url}") in refused.stderr
        assert servers_of(tmp_path) == [lease.info["server_pid"]]
    finally:
        lease.stop()


def test_users_of_a_foreground_server_get_a_keeper_when_it_stops(tmp_path):
    fg = subprocess.Popen([sys.executable, "-m", "kvlookup", "redis", "--data-dir", str(tmp_path)],
                          stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=ROOT)
    url = fg.stdout.readline().strip()
    lease = ensure_redis(Settings(data_dir=str(tmp_path)))
    try:
        assert lease.url == url and lease.keepers_started == 0 and lease.info["mode"] == "foreground"
        refused = _kvlookup_redis("--data-dir", str(tmp_path))
        assert refused.returncode == 2 and f"served by pid {fg.pid} (foreground) at {url}" in refused.stderr
        connect(url).set("k", "v")
        fg.terminate()
        assert fg.wait(10) == 0
        back = until(lambda: (served_by(tmp_path) or {}).get("mode") == "keeper" and ping(url), 10)
        print(f"a keeper took over {back:.2f} s after the foreground server stopped")
        assert lease.url == url and connect(url).get("k") == "v"
        assert until(lambda: lease.status()["state"] == "up" and lease.keepers_started == 1, 2) < 2
    finally:
        fg.kill()
        lease.stop()


def test_a_killed_server_is_restarted_on_its_port_by_its_keeper(tmp_path):
    lease = ensure_redis(Settings(data_dir=str(tmp_path)))
    try:
        connect(lease.url).set("k", "v")
        time.sleep(1.2)  # appendfsync everysec
        old = lease.info["server_pid"]
        kill9(old)
        back = until(lambda: ping(lease.url) and served_by(tmp_path).get("server_pid") != old)
        print(f"server back {back:.2f} s after kill -9")
        assert back < 2.0
        info = served_by(tmp_path)
        assert (info["pid"], info["url"], info["restarts"]) == (lease.info["pid"], lease.url, 1)
        assert servers_of(tmp_path) == [info["server_pid"]] and connect(lease.url).get("k") == "v"
    finally:
        lease.stop()


def test_a_killed_keeper_takes_its_server_along_and_a_user_starts_a_new_one(tmp_path):
    lease = ensure_redis(Settings(data_dir=str(tmp_path)))
    try:
        connect(lease.url).set("k", "v")
        keeper, server = lease.info["pid"], lease.info["server_pid"]
        kill9(keeper)
        gone = until(lambda: not alive(server), 5)  # PR_SET_PDEATHSIG: SIGTERM when its keeper died
        back = until(lambda: lease.keepers_started == 2 and ping(lease.url), 10)
        print(f"orphaned server gone {gone:.2f} s, new keeper serving {back:.2f} s after kill -9 of the keeper")
        assert back < 5.0
        info = served_by(tmp_path)
        assert info["url"] == lease.url and info["pid"] != keeper  # same port: clients reconnect
        assert keepers_of(tmp_path) == [info["pid"]] and servers_of(tmp_path) == [info["server_pid"]]
        assert connect(lease.url).get("k") == "v"  # SIGTERM let the server write its AOF
    finally:
        lease.stop()


def test_redis_command_options_have_help():
    sub = next(a for a in build_parser()._actions if a.dest == "command").choices["redis"]
    options = {a.dest: a.help for a in sub._actions if a.dest != "help"}
    assert set(options) == {"data_dir", "port", "exit_when_unused"} and all(options.values())
    refused = _kvlookup_redis("--port", "70000")
    assert refused.returncode == 2 and "port must be 0..65535, got 70000" in refused.stderr


def test_a_new_keeper_shuts_down_an_orphaned_server_of_its_dir_and_takes_its_port(tmp_path):
    """A server of the dir still answering with no keeper (it missed the parent-death signal)."""
    orphan = EmbeddedRedis(tmp_path)
    url = orphan.start()
    connect(url).set("k", "v")
    try:
        lease = ensure_redis(Settings(data_dir=str(tmp_path)))
        try:
            assert orphan.proc.wait(5) == 0  # SHUTDOWN: the AOF is written
            assert lease.url == url and connect(url).get("k") == "v"
            assert servers_of(tmp_path) == [lease.info["server_pid"]] != [orphan.proc.pid]
        finally:
            lease.stop()
    finally:
        orphan.stop()


def test_backoff_doubles_to_its_cap_and_resets_after_a_stable_run():
    from kvlookup.proc.lifetime import Backoff

    b = Backoff(0.2, 1.0, 10.0)
    assert [b.next(), b.next(), b.next(), b.next(), b.next(3.0), b.next(10.0), b.next()] == \
        [0.2, 0.4, 0.8, 1.0, 1.0, 0.2, 0.4]
