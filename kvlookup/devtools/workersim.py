"""A simulated LMCache worker that speaks the real wire protocol, byte for byte.

Era ``"0.3"`` (0.3.7-0.3.9, the seed's era): RegisterMsg with distributed_url, then one
KVAdmitMsg/KVEvictMsg per frame on PUSH, up to 50 frames per multipart message.
Era ``"0.5"`` (0.3.12-0.5.6): RegisterMsg over DEALER -> ROUTER (waits for RegisterRetMsg),
then BatchedKVOperationMsg with seq_num per location on PUSH.

Used by the demo, the tests and the benchmarks. It is not LMCache: tests prove compatibility
against the real LMCache code separately (tests/compat/test_lmcache_real.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec
import zmq

from kvlookup.hashing.lmcache import ChunkHash
from kvlookup.wire import lmcache as proto
from kvlookup.wire.zmqaddr import endpoint

MAX_FRAMES = 50


def chunk_ends(n_tokens: int, profile) -> list[int]:
    """The end token index of each chunk ``profile`` hashes for ``n_tokens`` tokens."""
    size = profile.chunk_size
    full = list(range(size, n_tokens + 1, size))
    if profile.save_unfull_chunk and n_tokens % size:
        full.append(n_tokens)
    return full


def _decoder():
    from kvlookup.wire import lmcache_control as ctl

    return msgspec.msgpack.Decoder(ctl.ClearWorkerMsg | ctl.PinWorkerMsg | ctl.CompressWorkerMsg
                                   | ctl.DecompressWorkerMsg | ctl.MoveWorkerMsg | ctl.HealthWorkerMsg
                                   | ctl.CheckFinishWorkerMsg)


class WorkerSim:
    """One LMCache worker (one TP rank) of one instance.

    era: "0.3" or "0.5". pull_url / reply_url: the controller's (sidecar's) addresses.
    """

    def __init__(self, instance_id: str, worker_id: int = 0, *, era: str = "0.3", pull_url: str,
                 reply_url: str | None = None, ip: str = "127.0.0.1", port: int = 8001,
                 ctx: zmq.Context | None = None):
        if era not in ("0.3", "0.5"):
            raise ValueError(f"era must be '0.3' or '0.5', got {era!r}")
        if era == "0.5" and not reply_url:
            raise ValueError("era 0.5 workers need reply_url (LMCache controller_reply_url)")
        self.instance_id, self.worker_id, self.era = instance_id, worker_id, era
        self.ip, self.port = ip, port
        self.ctx = ctx or zmq.Context.instance()
        self.push = self.ctx.socket(zmq.PUSH)
        self.push.setsockopt(zmq.LINGER, 2000)
        self.push.connect(endpoint(pull_url))
        self.dealer = None
        if reply_url:
            self.dealer = self.ctx.socket(zmq.DEALER)
            self.dealer.setsockopt(zmq.LINGER, 0)
            self.dealer.setsockopt(zmq.RCVTIMEO, 10_000)
            self.dealer.connect(endpoint(reply_url))
        self.seq: dict[str, int] = {}

    # -- registration ----------------------------------------------------------------------

    def register(self) -> dict | None:
        """Register; era 0.5 returns the decoded RegisterRetMsg."""
        if self.era == "0.3":
            url = f"localhost:{8200 + self.worker_id}"
            self.push.send_multipart([proto.encode(proto.RegisterMsgV3(
                self.instance_id, self.worker_id, self.ip, self.port, url))])
            return None
        return self.request(proto.RegisterMsg(self.instance_id, self.worker_id, self.ip, self.port, None))

    def heartbeat(self) -> dict | None:
        """Send a heartbeat (era 0.3 on PUSH; era 0.5 as a request, returning the reply)."""
        if self.era == "0.3":
            url = f"localhost:{8200 + self.worker_id}"
            self.push.send_multipart([proto.encode(proto.HeartbeatMsgV3(
                self.instance_id, self.worker_id, self.ip, self.port, url))])
            return None
        return self.request(proto.HeartbeatMsg(self.instance_id, self.worker_id, self.ip, self.port, None))

    def deregister(self) -> None:
        """Send DeRegisterMsg on PUSH (both eras)."""
        self.push.send_multipart([proto.encode(proto.DeRegisterMsg(
            self.instance_id, self.worker_id, self.ip, self.port))])

    def request(self, msg: msgspec.Struct) -> dict:
        """Send a request over DEALER as ``[b"", payload]`` and decode the last reply frame."""
        if self.dealer is None:
            raise RuntimeError("no reply_url: this worker cannot send requests")
        self.dealer.send_multipart([b"", proto.encode(msg)])
        return msgspec.msgpack.decode(self.dealer.recv_multipart()[-1])

    def full_sync(self, keys: Sequence[ChunkHash], location: str = "LocalCPUBackend",
                  sync_id: str | None = None, batch_size: int = 2000) -> tuple[dict, dict]:
        """Era 0.5: what LMCache's FullSyncSender does on a full_sync command: FullSyncStartMsg
        (DEALER), FullSyncBatchMsg... + FullSyncEndMsg (PUSH, one multipart), FullSyncStatusMsg
        (DEALER). Returns the decoded start and status replies; a start that is not accepted
        (or answered with an error) sends nothing more and returns ``(start, {})``, as
        LMCache's sender then retries the start later."""
        sync_id = sync_id or f"{self.instance_id}_{self.worker_id}_00000000"
        batches = [list(keys[i:i + batch_size]) for i in range(0, len(keys), batch_size)] or [[]]
        start = self.request(proto.FullSyncStartMsg(self.instance_id, self.worker_id, location, sync_id,
                                                    len(keys), len(batches)))
        if not start.get("accepted"):
            return start, {}
        frames = [proto.encode(proto.FullSyncBatchMsg(self.instance_id, self.worker_id, location, sync_id, i,
                                                      [int(k) for k in b])) for i, b in enumerate(batches)]
        frames.append(proto.encode(proto.FullSyncEndMsg(self.instance_id, self.worker_id, location, sync_id,
                                                        len(keys))))
        self.push.send_multipart(frames)
        status = self.request(proto.FullSyncStatusMsg(self.instance_id, self.worker_id, sync_id))
        return start, status

    # -- chunk events ----------------------------------------------------------------------

    def admit(self, keys: Sequence[ChunkHash], location: str = "LocalCPUBackend") -> None:
        """Report chunks stored in ``location``."""
        self._ops("admit", keys, location)

    def evict(self, keys: Sequence[ChunkHash], location: str = "LocalCPUBackend") -> None:
        """Report chunks removed from ``location``."""
        self._ops("evict", keys, location)

    def _ops(self, op: str, keys: Sequence[ChunkHash], location: str) -> None:
        if self.era == "0.3":
            cls = proto.KVAdmitMsg if op == "admit" else proto.KVEvictMsg
            frames = [proto.encode(cls(self.instance_id, self.worker_id, k, location)) for k in keys]
        else:
            frames = []
            for start in range(0, len(keys), MAX_FRAMES):
                ops = []
                for k in keys[start:start + MAX_FRAMES]:
                    seq = self.seq.get(location, 0)
                    self.seq[location] = seq + 1
                    ops.append(proto.OpEvent(op, int(k), seq))
                frames.append(proto.encode(proto.BatchedKVOperationMsg(
                    self.instance_id, self.worker_id, location, ops)))
        for start in range(0, len(frames), MAX_FRAMES):
            self.push.send_multipart(frames[start:start + MAX_FRAMES])

    def close(self, linger_ms: int | None = None) -> None:
        """Close the sockets; pending PUSH frames get up to 2 s to leave (``linger_ms``: that long
        instead; 0 drops them, so the process exits at once even when the sidecar is gone)."""
        self.push.close(linger_ms)
        if self.dealer is not None:
            self.dealer.close()


class SimEngine:
    """A simulated LMCache engine: what it holds (its true state, per location), one
    :class:`WorkerSim` per TP rank reporting it, and a control port per rank answering the
    controller's calls as LMCache's worker does (docs/lmcache-protocol.md §6): health (0),
    clear (every chunk of the location evicted and reported), pin / compress / decompress / move
    (the tokens of the longest prefix held there, under ``profile``), check_finish.

    A heartbeat whose reply carries a ``full_sync`` command is obeyed as LMCache's
    FullSyncSender would (the LocalCPUBackend keys, in batches), so tests can assert that the
    index converges to :attr:`held` exactly. era, pull_url, reply_url: as WorkerSim; tp: ranks.
    """

    def __init__(self, instance_id: str, *, era: str = "0.5", pull_url: str, reply_url: str | None = None,
                 tp: int = 1, ctx: zmq.Context | None = None, profile=None):
        import threading

        from kvlookup.hashing.lmcache import HashProfile

        self.instance_id = instance_id
        self.profile = profile or HashProfile()
        self._clearing: dict[str, tuple[int, set[int]]] = {}
        self.lock = threading.RLock()  # the control thread and the caller both send on the workers' sockets
        self.ctx = ctx or zmq.Context.instance()
        self.held: dict[str, set[ChunkHash]] = {}
        self.reps = []
        self.workers = []
        for rank in range(tp):
            rep = self.ctx.socket(zmq.REP)
            rep.setsockopt(zmq.LINGER, 0)
            port = rep.bind_to_random_port("tcp://127.0.0.1")
            self.reps.append(rep)
            self.workers.append(WorkerSim(instance_id, rank, era=era, pull_url=pull_url, reply_url=reply_url,
                                          port=port, ctx=self.ctx))
        self.health_calls = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._answer, daemon=True)
        self._thread.start()

    def _answer(self) -> None:
        from kvlookup.wire.lmcache_control import encode

        poller = zmq.Poller()
        for rep in self.reps:
            poller.register(rep, zmq.POLLIN)
        while not self._stop.is_set():
            for rep, _ev in poller.poll(100):
                raw = rep.recv()
                rep.send(encode(self.control(raw, rank=self.reps.index(rep))))

    def control(self, raw: bytes, rank: int = 0) -> msgspec.Struct:
        """The reply to one control request (msgpack bytes, as the controller sends them)."""
        from kvlookup.wire import lmcache_control as ctl

        try:
            msg = _control_decoder.decode(raw)
        except msgspec.DecodeError as exc:
            return proto.ErrorMsg(error=f"Unknown message: {exc}")
        if isinstance(msg, ctl.HealthWorkerMsg):
            self.health_calls += 1
            return ctl.HealthWorkerRetMsg(error_code=0)
        if isinstance(msg, ctl.CheckFinishWorkerMsg):
            return ctl.CheckFinishWorkerRetMsg(status="finished")
        if isinstance(msg, ctl.ClearWorkerMsg):
            return ctl.ClearWorkerRetMsg(num_tokens=self._clear(msg.location, rank))
        location = msg.old_position if isinstance(msg, ctl.MoveWorkerMsg) else msg.location
        tokens = self._held_prefix(list(msg.tokens or []), location)
        reply: dict[type, Any] = {
            ctl.PinWorkerMsg: ctl.PinWorkerRetMsg, ctl.CompressWorkerMsg: ctl.CompressWorkerRetMsg,
            ctl.DecompressWorkerMsg: ctl.DecompressWorkerRetMsg, ctl.MoveWorkerMsg: ctl.MoveWorkerRetMsg}
        return reply[type(msg)](num_tokens=tokens)

    def _clear(self, location: str, rank: int) -> int:
        """Tokens a clear of ``location`` drops on ``rank`` (chunks x chunk_size: the simulation knows
        hashes, not lengths). The controller asks every rank in
        turn; the first one evicts the (shared) chunks on every rank, and the others answer the
        same count, as real ranks holding the same chunks each would."""
        count, answered = self._clearing.get(location, (None, set()))
        if count is None or rank in answered:
            held = sorted(self.held.get(location, ()))
            count, answered = len(held) * self.profile.chunk_size, set()
            if held:
                self.evict(held, location)
        answered.add(rank)
        if len(answered) == len(self.workers):
            self._clearing.pop(location, None)
        else:
            self._clearing[location] = (count, answered)
        return count

    def _held_prefix(self, tokens: list[int], location: str) -> int:
        """How many leading tokens of ``tokens`` this engine holds at ``location``."""
        held, matched = self.held.get(location, set()), 0
        for end, chunk_hash in zip(chunk_ends(len(tokens), self.profile), self.profile.chunk_hashes(tokens),
                                   strict=True):
            if chunk_hash not in held:
                break
            matched = end
        return matched

    def register(self) -> None:
        for w in self.workers:
            w.register()

    def store(self, hashes: Sequence[ChunkHash], location: str = "LocalCPUBackend") -> None:
        with self.lock:
            self.held.setdefault(location, set()).update(hashes)
            for w in self.workers:
                w.admit(list(hashes), location)

    def evict(self, hashes: Sequence[ChunkHash], location: str = "LocalCPUBackend") -> None:
        with self.lock:
            self.held.setdefault(location, set()).difference_update(hashes)
            for w in self.workers:
                w.evict(list(hashes), location)

    def lose(self, stored: Sequence[ChunkHash] = (), evicted: Sequence[ChunkHash] = (),
             location: str = "LocalCPUBackend") -> None:
        """Change what the engine holds without telling anyone: the messages were lost (sent
        while nothing listened, or in flight when a sidecar died)."""
        held = self.held.setdefault(location, set())
        held.update(stored)
        held.difference_update(evicted)

    def heartbeat(self) -> list[str]:
        """Heartbeat every rank; returns the full-sync reasons the controller gave (and syncs)."""
        reasons = []
        for w in self.workers:
            reply = w.heartbeat() or {}
            for cmd in reply.get("commands", []):
                if cmd.get("command_type") == "full_sync":
                    reasons.append(cmd.get("reason"))
                    w.full_sync(sorted(self.held.get("LocalCPUBackend", set())))
        return reasons

    def truth(self) -> dict[str, set[ChunkHash]]:
        """Location -> chunk hashes this engine holds (every rank holds the same)."""
        return {loc: set(h) for loc, h in self.held.items() if h}

    def close(self, deregister: bool = True, linger_ms: int | None = None) -> None:
        """Deregister (unless not ``deregister``), close the workers (``linger_ms``: as
        :meth:`WorkerSim.close`) and stop answering control calls."""
        if deregister:
            for w in self.workers:
                w.deregister()
        for w in self.workers:
            w.close(linger_ms)
        self._stop.set()
        self._thread.join(2)
        for rep in self.reps:
            rep.close(0)


_control_decoder = _decoder()
