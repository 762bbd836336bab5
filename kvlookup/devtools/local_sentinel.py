"""A Sentinel-managed Redis on loopback: one master, its replicas and the Sentinels watching it.

For the tests (and trying ``redis+sentinel://`` URLs on one machine): the same valkey-server
binary as the embedded Redis runs the data nodes and, with ``--sentinel`` and a sentinel.conf,
the Sentinels. Failover is the Sentinels' own: kill -9 the master and they promote a replica,
then turn the old master into a replica of the new one when it comes back.
"""

from __future__ import annotations

import os
from pathlib import Path

import redis

from kvlookup.devtools.local_cluster import Node, Processes, replicas_synced, spawn, stop_all, wait
from kvlookup.proc.redis_server import free_port


class LocalSentinel(Processes):
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
        wait(lambda: replicas_synced(self.live(self.data)), timeout, "replicas did not sync")

    def wait_watching(self, timeout: float = 30.0) -> None:
        """Until every live Sentinel knows the master, its replicas and the other Sentinels
        (a Sentinel that has not met the others cannot take part in a failover)."""
        replicas, sentinels = len(self.live(self.data)) - 1, self.live(self.sentinels)

        def watching() -> bool:
            for s in sentinels:
                info = s.client().execute_command("SENTINEL", "MASTER", self.master_name)
                fields = dict(zip(info[::2], info[1::2], strict=True)) if isinstance(info, list) else info
                if int(fields["num-slaves"]) < replicas or int(fields["num-other-sentinels"]) < len(sentinels) - 1:
                    return False
            return True

        wait(watching, timeout, "sentinels did not discover each other and the replicas")

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

    def restart(self, node: Node, timeout: float = 30.0) -> None:
        """Start a killed data node again on its port, empty and as a master, as a supervisor
        would; the Sentinels see it back and make it a replica of the current master. Waits
        until it is one and synced."""
        spawn(node, [])
        wait(lambda: node.client().info("replication").get("role") == "slave" and replicas_synced([node]),
             timeout, "the Sentinels did not make the restarted node a replica")

    def stop(self) -> None:
        """Stop every process (Sentinels first, so none fails over a stopping master)."""
        stop_all(self.sentinels)
        stop_all(self.data)

