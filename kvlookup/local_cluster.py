"""A real Redis Cluster on loopback, from the same server binary as the embedded Redis.

For the tests, the benchmarks and ``kvlookup redis --cluster`` (trying the cluster backend on
one machine): N masters with R replicas each, created with ``valkey-cli --cluster create``
exactly as an operator would, plus the operations the fault tests need (kill a node, restart
it, add a master and rebalance slots while traffic runs).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import redis

from kvlookup.redis_server import find_server_binary, free_port


def find_cli_binary() -> str:
    """``valkey-cli``/``redis-cli`` beside the server binary, else on PATH."""
    server = Path(find_server_binary())
    for name in ("valkey-cli", "redis-cli"):
        candidate = server.parent / name
        if candidate.exists():
            return str(candidate)
        found = shutil.which(name)
        if found:
            return found
    raise FileNotFoundError("no valkey-cli/redis-cli beside the server binary or on PATH")


@dataclass
class Node:
    """One cluster server process."""

    port: int
    dir: Path
    proc: subprocess.Popen | None = None
    bus_port: int = 0  # cluster bus; the default port + 10000 overflows for high free ports

    @property
    def addr(self) -> str:
        return f"127.0.0.1:{self.port}"

    def client(self) -> redis.Redis:
        return redis.Redis(port=self.port, decode_responses=True, socket_timeout=2)


class LocalCluster:
    """``masters`` masters with ``replicas`` replicas each, on free loopback ports.

    data_dir: one folder per node (nodes.conf, AOF when ``appendonly``). node_timeout_ms:
    cluster-node-timeout, which bounds how soon a replica takes over a dead master
    (failover within about 2-3x this).
    """

    def __init__(self, data_dir: str | os.PathLike, masters: int = 3, replicas: int = 1, *,
                 node_timeout_ms: int = 2000, appendonly: bool = False):
        self.dir = Path(data_dir)
        self.n_masters, self.n_replicas = masters, replicas
        self.node_timeout_ms = node_timeout_ms
        self.appendonly = appendonly
        self.nodes: list[Node] = []

    @property
    def url(self) -> str:
        """redis:// URL of the first node (any node will do for RedisCluster)."""
        return f"redis://127.0.0.1:{self.nodes[0].port}/0"

    def start(self, timeout: float = 30.0) -> str:
        """Start every node, create the cluster, wait until every node sees it whole."""
        for _ in range(self.n_masters * (1 + self.n_replicas)):
            self.nodes.append(self._spawn(Node(free_port(), self.dir / f"node-{len(self.nodes)}")))
        self._cli("--cluster", "create", *(n.addr for n in self.nodes),
                  "--cluster-replicas", str(self.n_replicas), "--cluster-yes")
        self.wait_ok(timeout)
        return self.url

    def _spawn(self, node: Node) -> Node:
        node.dir.mkdir(parents=True, exist_ok=True)
        node.bus_port = node.bus_port or free_port()
        cmd = [find_server_binary(), "--port", str(node.port), "--bind", "127.0.0.1", "--dir", str(node.dir),
               "--cluster-enabled", "yes", "--cluster-port", str(node.bus_port), "--cluster-config-file", "nodes.conf",
               "--cluster-node-timeout", str(self.node_timeout_ms), "--save", "",
               "--appendonly", "yes" if self.appendonly else "no", "--logfile", str(node.dir / "log"),
               "--set-max-intset-entries", "4096", "--daemonize", "no"]
        node.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                     start_new_session=True)
        deadline = time.monotonic() + 10
        while True:
            try:
                if node.client().ping():
                    return node
            except redis.RedisError:
                if time.monotonic() > deadline or node.proc.poll() is not None:
                    raise RuntimeError(f"cluster node on port {node.port} did not start") from None
                time.sleep(0.05)

    def _cli(self, *args: str, timeout: float = 120) -> str:
        out = subprocess.run([find_cli_binary(), *args], capture_output=True, text=True, timeout=timeout)
        if out.returncode != 0:
            raise RuntimeError(f"valkey-cli {' '.join(args[:2])} failed: {out.stdout[-500:]} {out.stderr[-500:]}")
        return out.stdout

    def live_nodes(self) -> list[Node]:
        return [n for n in self.nodes if n.proc is not None and n.proc.poll() is None]

    def wait_ok(self, timeout: float = 30.0) -> None:
        """Until every live node reports cluster_state:ok and all slots covered."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                infos = [n.client().cluster("info") for n in self.live_nodes()]
                if all(i.get("cluster_state") == "ok" and int(i.get("cluster_slots_ok", 0)) == 16384
                       for i in infos):
                    return
            except redis.RedisError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError("cluster did not become ok")
            time.sleep(0.1)

    def masters(self) -> list[Node]:
        """Live nodes that are masters now (after failovers too)."""
        out = []
        for n in self.live_nodes():
            try:
                if n.client().info("replication").get("role") == "master":
                    out.append(n)
            except redis.RedisError:
                pass
        return out

    def kill(self, node: Node, sig: int = signal.SIGKILL) -> None:
        """Kill one node (kill -9 by default) and wait for it to exit."""
        if node.proc is not None and node.proc.poll() is None:
            node.proc.send_signal(sig)
            node.proc.wait(10)

    def restart(self, node: Node) -> None:
        """Start a killed node again on its port and data dir (it rejoins as a replica)."""
        self._spawn(node)

    def add_master(self, rebalance: bool = True) -> Node:
        """Start a new empty node, join it as a master, and move slots onto it (live)."""
        node = self._spawn(Node(free_port(), self.dir / f"node-{len(self.nodes)}"))
        self.nodes.append(node)
        seed = self.masters()[0]
        self._cli("--cluster", "add-node", node.addr, seed.addr)
        self.wait_known(node)
        if rebalance:
            self._cli("--cluster", "rebalance", seed.addr, "--cluster-use-empty-masters", timeout=600)
        return node

    def wait_known(self, node: Node, timeout: float = 30.0) -> None:
        """Until every live node knows ``node``."""
        deadline = time.monotonic() + timeout
        my_id = node.client().cluster("myid")
        while time.monotonic() < deadline:
            try:
                if all(my_id in n.client().execute_command("CLUSTER", "NODES") for n in self.live_nodes()):
                    return
            except redis.RedisError:
                pass
            time.sleep(0.1)
        raise TimeoutError("new node not known to every node")

    def flushall(self) -> None:
        """Empty every master."""
        for n in self.masters():
            n.client().flushall()

    def stop(self) -> None:
        """Stop every node."""
        for n in self.nodes:
            if n.proc is not None and n.proc.poll() is None:
                n.proc.terminate()
        for n in self.nodes:
            if n.proc is not None:
                try:
                    n.proc.wait(10)
                except subprocess.TimeoutExpired:
                    n.proc.kill()
                    n.proc.wait(5)
