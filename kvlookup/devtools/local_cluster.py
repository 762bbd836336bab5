"""A real Redis Cluster on loopback, from the same server binary as the embedded Redis.

For the tests and the benchmarks (trying the cluster backend on one machine): N masters with
R replicas each, created with ``valkey-cli --cluster create`` exactly as an operator would, plus
the operations the fault tests need (kill a node, stop it for a while, restart it, add a master
and rebalance slots while traffic runs).
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

from kvlookup.index.cluster_io import slot_of
from kvlookup.proc.redis_server import find_server_binary, free_port


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


def spawn(node: Node, args: list[str], timeout: float = 10.0, *, sentinel_conf: Path | None = None) -> Node:
    """Start ``valkey-server`` for ``node`` on loopback, with its own dir and log file, and
    extra ``args``; returns once it answers PING. A data node takes no RDB snapshots and lets
    replicas sync at once; with ``sentinel_conf`` the process is a Sentinel using that file.
    Raises RuntimeError when it exits or does not answer within ``timeout`` seconds."""
    node.dir.mkdir(parents=True, exist_ok=True)
    common = ["--port", str(node.port), "--bind", "127.0.0.1", "--dir", str(node.dir),
              "--logfile", str(node.dir / "log"), "--daemonize", "no"]
    if sentinel_conf is not None:
        cmd = [find_server_binary(), str(sentinel_conf), "--sentinel", *common, *args]
    else:
        cmd = [find_server_binary(), *args, *common, "--save", "", "--set-max-intset-entries", "4096",
               "--repl-diskless-sync-delay", "0"]
    node.proc = proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                        start_new_session=True)

    def up() -> bool:
        if proc.poll() is not None:
            raise RuntimeError(f"valkey-server on port {node.port} exited; see {node.dir}/log")
        return node.client().ping()

    wait(up, timeout, f"valkey-server on port {node.port} did not answer; see {node.dir}/log", every=0.05)
    return node


def wait(ready, timeout: float, what: str, every: float = 0.1):
    """Poll ``ready()`` until it returns something true (a Redis error counts as not yet) and
    return that; raises TimeoutError naming ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            got = ready()
            if got:
                return got
        except redis.RedisError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} (after {timeout:.0f} s)")
        time.sleep(every)


def replicas_synced(nodes: list[Node]) -> bool:
    """True when every replica among ``nodes`` has its link up and no sync in progress."""
    infos = [n.client().info("replication") for n in nodes]
    return all(i.get("master_link_status") == "up" and not i.get("master_sync_in_progress")
               for i in infos if i.get("role") == "slave")


class Processes:
    """Signals for the server processes of a local deployment."""

    @staticmethod
    def live(nodes: list[Node]) -> list[Node]:
        """The nodes whose process runs."""
        return [n for n in nodes if n.proc is not None and n.proc.poll() is None]

    def kill(self, node: Node, sig: int = signal.SIGKILL) -> None:
        """Kill one process (kill -9 by default) and wait for it to exit."""
        if node.proc is not None and node.proc.poll() is None:
            node.proc.send_signal(sig)
            node.proc.wait(10)

    def freeze(self, node: Node) -> None:
        """SIGSTOP a node: it neither serves nor replicates until :meth:`thaw` (stopped for less
        than the failure detection time, it stays a healthy node, only lagging)."""
        if node.proc is not None and node.proc.poll() is None:
            node.proc.send_signal(signal.SIGSTOP)

    def thaw(self, node: Node) -> None:
        """SIGCONT a node stopped by :meth:`freeze`."""
        if node.proc is not None and node.proc.poll() is None:
            node.proc.send_signal(signal.SIGCONT)


def stop_all(nodes: list[Node]) -> None:
    """SIGTERM every node still running (SIGCONT first, for a frozen one), then wait; SIGKILL
    a node that does not exit within 10 s."""
    for n in nodes:
        if n.proc is not None and n.proc.poll() is None:
            n.proc.send_signal(signal.SIGCONT)
            n.proc.terminate()
    for n in nodes:
        if n.proc is not None:
            try:
                n.proc.wait(10)
            except subprocess.TimeoutExpired:
                n.proc.kill()
                n.proc.wait(5)


class LocalCluster(Processes):
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
        """Start every node, create the cluster, wait until every node sees it whole and every
        replica has its master's data (a replica that never synced cannot take over)."""
        for _ in range(self.n_masters * (1 + self.n_replicas)):
            self.nodes.append(self._spawn(Node(free_port(), self.dir / f"node-{len(self.nodes)}")))
        self._cli("--cluster", "create", *(n.addr for n in self.nodes),
                  "--cluster-replicas", str(self.n_replicas), "--cluster-yes")
        self.wait_ok(timeout)
        self.wait_replicas(timeout)
        return self.url

    def _spawn(self, node: Node) -> Node:
        node.bus_port = node.bus_port or free_port()
        return spawn(node, ["--cluster-enabled", "yes", "--cluster-port", str(node.bus_port),
                            "--cluster-config-file", "nodes.conf", "--cluster-node-timeout", str(self.node_timeout_ms),
                            "--appendonly", "yes" if self.appendonly else "no"])

    def _cli(self, *args: str, timeout: float = 120) -> str:
        out = subprocess.run([find_cli_binary(), *args], capture_output=True, text=True, timeout=timeout)
        if out.returncode != 0:
            raise RuntimeError(f"valkey-cli {' '.join(args[:2])} failed: {out.stdout[-500:]} {out.stderr[-500:]}")
        return out.stdout

    def live_nodes(self) -> list[Node]:
        return self.live(self.nodes)

    def wait_ok(self, timeout: float = 30.0) -> None:
        """Until every live node reports cluster_state:ok and all slots covered."""
        def ok() -> bool:
            infos = [n.client().cluster("info") for n in self.live_nodes()]
            return all(i.get("cluster_state") == "ok" and int(i.get("cluster_slots_ok", 0)) == 16384 for i in infos)

        wait(ok, timeout, "cluster did not become ok")

    def wait_replicas(self, timeout: float = 30.0) -> None:
        """Until every live replica's link to its master is up and its initial sync is done."""
        wait(lambda: replicas_synced(self.live_nodes()), timeout, "cluster replicas did not sync")

    def node_of(self, key: str) -> Node:
        """The live node that is the master of ``key``'s slot now."""
        slot = slot_of(key)
        for n in self.masters():
            for start, end in _own_slots(n):
                if start <= slot <= end:
                    return n
        raise LookupError(f"no live master serves slot {slot}")

    def replicas_of(self, master: Node) -> list[Node]:
        """The live nodes replicating ``master``."""
        out = []
        for n in self.live_nodes():
            try:
                info = n.client().info("replication")
            except redis.RedisError:
                continue
            if info.get("role") == "slave" and int(info.get("master_port", 0)) == master.port:
                out.append(n)
        return out

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

    def restart(self, node: Node, timeout: float = 30.0) -> None:
        """Start a killed node again on its port and data dir (a master that was failed over
        rejoins as a replica of its successor); waits until the cluster is ok and synced."""
        self._spawn(node)
        self.wait_ok(timeout)
        self.wait_replicas(timeout)

    def add_master(self, rebalance: bool = True) -> Node:
        """Start a new empty node, join it as a master, and move slots onto it (live)."""
        node = self._spawn(Node(free_port(), self.dir / f"node-{len(self.nodes)}"))
        self.nodes.append(node)
        seed = self.masters()[0]
        self._cli("--cluster", "add-node", node.addr, seed.addr)
        self.wait_known(node)
        self.wait_ok()  # until the new node sees every slot served, it answers MIGRATE with CLUSTERDOWN
        if rebalance:
            self._cli("--cluster", "rebalance", seed.addr, "--cluster-use-empty-masters", timeout=600)
        return node

    def migrate(self, slot: int, src: Node, dst: Node, key_names: list[str] | None = None) -> None:
        """Start moving ``slot`` from ``src`` to ``dst`` by hand, as ``--cluster rebalance`` does
        slot by slot: mark it importing on dst and migrating on src, then MIGRATE ``key_names``
        (every key of the slot when None). Until :meth:`finish_migration`, src answers ASK for
        keys it no longer has and TRYAGAIN for multi-key commands it holds only some keys of."""
        src_id, dst_id = src.client().cluster("myid"), dst.client().cluster("myid")
        dst.client().execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", src_id)
        src.client().execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", dst_id)
        self._move_keys(slot, src, dst, key_names)

    def finish_migration(self, slot: int, src: Node, dst: Node) -> None:
        """Move the slot's remaining keys and give the slot to ``dst`` on every master."""
        self._move_keys(slot, src, dst, None)
        dst_id = dst.client().cluster("myid")
        for n in [dst, src, *(m for m in self.masters() if m is not dst and m is not src)]:
            n.client().execute_command("CLUSTER", "SETSLOT", slot, "NODE", dst_id)

    @staticmethod
    def _move_keys(slot: int, src: Node, dst: Node, key_names: list[str] | None) -> None:
        names = key_names if key_names is not None else src.client().execute_command(
            "CLUSTER", "GETKEYSINSLOT", slot, 10_000)
        if names:
            src.client().execute_command("MIGRATE", "127.0.0.1", dst.port, "", 0, 5000, "KEYS", *names)

    def wait_known(self, node: Node, timeout: float = 30.0) -> None:
        """Until every live node knows ``node``."""
        my_id = node.client().cluster("myid")
        wait(lambda: all(my_id in n.client().execute_command("CLUSTER", "NODES") for n in self.live_nodes()),
             timeout, "new node not known to every node")

    def slot_counts(self) -> dict[int, int]:
        """Slots owned per live master (port -> count)."""
        return {n.port: sum(end - start + 1 for start, end in _own_slots(n)) for n in self.masters()}

    def flushall(self) -> None:
        """Empty every master."""
        for n in self.masters():
            n.client().flushall()

    def stop(self) -> None:
        """Stop every node."""
        stop_all(self.nodes)


def _own_slots(node: Node) -> list[tuple[int, int]]:
    """The slot ranges a master serves, from its own ``CLUSTER NODES`` line (``myself``)."""
    for line in node.client().execute_command("CLUSTER", "NODES").splitlines():
        fields = line.split()
        if "myself" in fields[2].split(","):
            ranges = []
            for part in fields[8:]:
                if part.startswith("["):  # a slot being migrated or imported
                    continue
                start, _, end = part.partition("-")
                ranges.append((int(start), int(end or start)))
            return ranges
    return []
