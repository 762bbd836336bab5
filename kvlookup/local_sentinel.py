"""A Sentinel-managed Redis on loopback: one master, its replicas and the Sentinels watching it.

For the tests (and trying ``redis+sentinel://`` URLs on one machine): the same valkey-server
binary as the embedded Redis runs the data nodes and, with ``--sentinel`` and a sentinel.conf,
the Sentinels. Failover is the Sentinels' own: kill -9 the master and they promote a replica,
then turn the old master into a replica of the new one when it comes back.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import redis

from kvlookup.local_cluster import Node, spawn, stop_all
from kvlookup.redis_server import free_port


class LocalSentinel:
    """A master with ``replicas`` replicas and ``sentinels`` Sentinels (quorum: a majority).

    data_dir: one folder per process (its log, the Sentinels' rewritten sentinel.conf).
    master_name: the name the Sentinels know the master by (the URL's path).
    down_after_ms: Sentinel ``down-after-milliseconds``: how long the master must be
    unreachable before it is considered down (the failover takes about 1-2 s more).
    """

    def __init__(self, data_dir: str | os.PathLike, replicas: int = 1, sentinels: int = 3, *,
                 master_name: str = "kvlookup", down_after_ms: int = 1000, failover_timeout_ms: int = 10_000):
        self.dir = Path(data_dir)
        self.n_replicas, self.n_sentinels = replicas, sentinels
        self.master_name = master_name
        self.down_after_ms, self.failover_timeout_ms = down_after_ms, failover_timeout_ms
        self.data: list[Node] = []  # the master first, as started; roles change with failovers
        self.sentinels: list[Node] = []

    @property
    def url(self) -> str:
        """``redis+sentinel://127.0.0.1:P1,127.0.0.1:P2,.../<master name>/0``."""
        hosts = ",".join(s.addr for s in self.sentinels)
        return f"redis+sentinel://{hosts}/{self.master_name}/0"

    def start(self, timeout: float = 30.0) -> str:
        """Start the master, its replicas (synced) and the Sentinels (each seeing every replica
        and the other Sentinels); returns :attr:`url`."""
        master = spawn(Node(free_port(), self.dir / "data-0"), [])
        self.data.append(master)
        for i in range(self.n_replicas):
            self.data.append(spawn(Node(free_port(), self.dir / f"data-{i + 1}"),
                                   ["--replicaof", "127.0.0.1", str(master.port)]))
        self.wait_replicas(timeout)
        quorum = self.n_sentinels // 2 + 1
        for i in range(self.n_sentinels):
            node = Node(free_port(), self.dir / f"sentinel-{i}")
            node.dir.mkdir(parents=True, exist_ok=True)
            conf = node.dir / "sentinel.conf"  # Sentinels rewrite their config: one file each
            conf.write_text(
                f"sentinel monitor {self.master_name} 127.0.0.1 {master.port} {quorum}\n"
                f"sentinel down-after-milliseconds {self.master_name} {self.down_after_ms}\n"
                f"sentinel failover-timeout {self.master_name} {self.failover_timeout_ms}\n"
                f"sentinel parallel-syncs {self.master_name} 1\n")
            self.sentinels.append(spawn(node, [], sentinel_conf=conf))
        self.wait_watching(timeout)
        return self.url

    def wait_replicas(self, timeout: float = 30.0) -> None:
        """Until every live replica's link to its master is up and its sync is done."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                infos = [n.client().info("replication") for n in self.live(self.data)]
                if all(i.get("master_link_status") == "up" and not i.get("master_sync_in_progress")
                       for i in infos if i.get("role") == "slave"):
                    return
            except redis.RedisError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError("replicas did not sync")
            time.sleep(0.1)

    def wait_watching(self, timeout: float = 30.0) -> None:
        """Until every live Sentinel knows the master, its replicas and the other Sentinels
        (a Sentinel that has not met the others cannot take part in a failover)."""
        deadline = time.monotonic() + timeout
        replicas = len(self.live(self.data)) - 1
        while True:
            try:
                ok = True
                for s in self.live(self.sentinels):
                    info = s.client().execute_command("SENTINEL", "MASTER", self.master_name)
                    fields = dict(zip(info[::2], info[1::2], strict=True)) if isinstance(info, list) else info
                    ok = ok and int(fields["num-slaves"]) >= replicas and \
                        int(fields["num-other-sentinels"]) >= len(self.live(self.sentinels)) - 1
                if ok:
                    return
            except (redis.RedisError, KeyError):
                pass
            if time.monotonic() > deadline:
                raise TimeoutError("sentinels did not discover each other and the replicas")
            time.sleep(0.1)

    def master(self) -> Node:
        """The data node the Sentinels name as master now (raises LookupError if unknown)."""
        for s in self.live(self.sentinels):
            try:
                addr = s.client().execute_command("SENTINEL", "GET-MASTER-ADDR-BY-NAME", self.master_name)
            except redis.RedisError:
                continue
            if addr:
                port = int(addr[1])
                for n in self.data:
                    if n.port == port:
                        return n
        raise LookupError("no Sentinel names a master")

    def wait_new_master(self, old: Node, timeout: float = 30.0) -> Node:
        """Until the Sentinels name another master than ``old`` and it serves as one; returns it."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                new = self.master()
                if new is not old and new.client().info("replication").get("role") == "master":
                    return new
            except (LookupError, redis.RedisError):
                pass
            if time.monotonic() > deadline:
                raise TimeoutError("the Sentinels did not promote a replica")
            time.sleep(0.05)

    @staticmethod
    def live(nodes: list[Node]) -> list[Node]:
        return [n for n in nodes if n.proc is not None and n.proc.poll() is None]

    def kill(self, node: Node, sig: int = signal.SIGKILL) -> None:
        """Kill one process (kill -9 by default) and wait for it to exit."""
        if node.proc is not None and node.proc.poll() is None:
            node.proc.send_signal(sig)
            node.proc.wait(10)

    def freeze(self, node: Node) -> None:
        """SIGSTOP a node: it neither serves nor replicates until :meth:`thaw`."""
        if node.proc is not None and node.proc.poll() is None:
            node.proc.send_signal(signal.SIGSTOP)

    def thaw(self, node: Node) -> None:
        """SIGCONT a node stopped by :meth:`freeze`."""
        if node.proc is not None and node.proc.poll() is None:
            node.proc.send_signal(signal.SIGCONT)

    def restart(self, node: Node, timeout: float = 30.0) -> None:
        """Start a killed data node again on its port, empty and as a master, as a supervisor
        would; the Sentinels see it back and make it a replica of the current master. Waits
        until it is one and synced."""
        spawn(node, [])
        deadline = time.monotonic() + timeout
        while True:
            try:
                info = node.client().info("replication")
                if info.get("role") == "slave" and info.get("master_link_status") == "up" \
                        and not info.get("master_sync_in_progress"):
                    return
            except redis.RedisError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError("the Sentinels did not make the restarted node a replica")
            time.sleep(0.1)

    def stop(self) -> None:
        """Stop every process (Sentinels first, so none fails over a stopping master)."""
        stop_all(self.sentinels)
        stop_all(self.data)

