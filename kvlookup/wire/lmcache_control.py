"""Controller -> LMCache worker control calls (clear, pin, compress, decompress, move, health).

Wire facts (LMCache 0.5.6, docs/lmcache-protocol.md §1, §2.1, §8; ``lmcache/v1/cache_controller/message.py`` and
``controllers/kv_controller.py``): the controller connects a REQ socket to the worker's REP
port (``RegisterMsg.ip`` and ``port``, i.e. the engine's ``lmcache_worker_ports``), sends one
msgpack frame and reads one frame back. Messages are msgspec structs tagged ``"type"`` = class name, every field in
declaration order.

Unlike LMCache's controller, every call here has a deadline: :class:`ControlClient` opens a
fresh REQ socket per call and attempt (a REQ socket that timed out is stuck in the wrong
state, so it is discarded), sends to all workers of an instance at once, waits at most
``timeout_s`` per attempt and retries the silent ones ``retries`` times. A dead worker
therefore costs at most ``timeout_s * (retries + 1)`` and never wedges a later call.
Under gevent (the controller's default gunicorn worker) the sockets are pyzmq's green ones, so
a call that waits on a slow worker yields to the lookups served by the same process.
A worker whose registered address is outside ``worker_networks`` (loopback by default) is
never connected to: its result is ``refused`` (health code -1006).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

import msgspec
import zmq
import zmq.green

from kvlookup import metrics
from kvlookup.netpolicy import LOOPBACK_NETWORKS, Networks, address_allowed
from kvlookup.proc.green import patched
from kvlookup.wire.lmcache import ErrorMsg

log = logging.getLogger(__name__)

# -- requests (exact 0.5.6 encodings) ------------------------------------------------------


class ClearWorkerMsg(msgspec.Struct, tag=True):
    worker_event_id: str
    location: str


class PinWorkerMsg(msgspec.Struct, tag=True):
    worker_event_id: str
    location: str
    tokens: list[int]


class _Codec(msgspec.Struct):
    worker_event_id: str
    method: str
    location: str
    tokens: list[int] | None = None


class CompressWorkerMsg(_Codec, tag=True):
    pass


class DecompressWorkerMsg(_Codec, tag=True):
    pass


class MoveWorkerMsg(msgspec.Struct, tag=True):
    worker_event_id: str
    old_position: str
    new_position: tuple[str, str]
    tokens: list[int] | None = None
    copy: bool | None = True


class HealthWorkerMsg(msgspec.Struct, tag=True):
    worker_event_id: str


class CheckFinishWorkerMsg(msgspec.Struct, tag=True):
    worker_event_id: str


# -- replies ---------------------------------------------------------------------------------


class _NumTokens(msgspec.Struct):
    num_tokens: int


class ClearWorkerRetMsg(_NumTokens, tag=True):
    pass


class PinWorkerRetMsg(_NumTokens, tag=True):
    pass


class CompressWorkerRetMsg(_NumTokens, tag=True):
    pass


class DecompressWorkerRetMsg(_NumTokens, tag=True):
    pass


class MoveWorkerRetMsg(_NumTokens, tag=True):
    pass


class HealthWorkerRetMsg(msgspec.Struct, tag=True):
    error_code: int


class CheckFinishWorkerRetMsg(msgspec.Struct, tag=True):
    status: str


ControlRet = (
    ClearWorkerRetMsg
    | PinWorkerRetMsg
    | CompressWorkerRetMsg
    | DecompressWorkerRetMsg
    | MoveWorkerRetMsg
    | HealthWorkerRetMsg
    | CheckFinishWorkerRetMsg
    | ErrorMsg
)

#: request type -> the reply type it expects
EXPECTED_REPLY: dict[type, type] = {
    ClearWorkerMsg: ClearWorkerRetMsg,
    PinWorkerMsg: PinWorkerRetMsg,
    CompressWorkerMsg: CompressWorkerRetMsg,
    DecompressWorkerMsg: DecompressWorkerRetMsg,
    MoveWorkerMsg: MoveWorkerRetMsg,
    HealthWorkerMsg: HealthWorkerRetMsg,
    CheckFinishWorkerMsg: CheckFinishWorkerRetMsg,
}

_encoder = msgspec.msgpack.Encoder()
_reply_decoder = msgspec.msgpack.Decoder(ControlRet)
MAX_REPLY_BYTES = 1 << 20

#: Outcomes of one call. LMCache's /health maps them to error codes.
OK, WORKER_ERROR, UNEXPECTED, UNDECODABLE, TIMEOUT, UNREACHABLE, REFUSED = (
    "ok",
    "worker_error",
    "unexpected",
    "undecodable",
    "timeout",
    "unreachable",
    "refused",
)
HEALTH_CODES = {WORKER_ERROR: -1001, UNEXPECTED: -1002, UNDECODABLE: -1003, TIMEOUT: -1004, UNREACHABLE: -1005,
                REFUSED: -1006}


@dataclass
class Target:
    """One worker to call: its id (for results), REP address, and the message to send."""

    worker_id: int | str
    ip: str
    port: int
    msg: msgspec.Struct


@dataclass
class Result:
    """What one worker answered. outcome: ok, worker_error, unexpected, undecodable, timeout,
    unreachable, refused (address outside worker_networks, never contacted).

    reply: the decoded reply struct (ok); error: a human-readable reason otherwise;
    attempts: sends made.
    """

    worker_id: int | str
    outcome: str
    reply: Any = None
    error: str = ""
    attempts: int = 0


def encode(msg: msgspec.Struct) -> bytes:
    """msgpack bytes exactly as LMCache 0.5.6 writes the message."""
    return _encoder.encode(msg)


def _host(ip: str) -> str:
    return "127.0.0.1" if ip in ("", "localhost") else ip


#: Sockets one ControlClient has open at once, all its callers together, and per call (issue
#: 20 item 10: a fan-out to ~1,000 workers opened ~1,000 sockets and failed with "Too many open
#: files"). A call to more workers runs in windows of WINDOW, each up to the timeout.
MAX_SOCKETS = 256
WINDOW = 128


class ControlClient:
    """Bounded, concurrent REQ calls to LMCache workers' REP ports.

    timeout_s: wait per attempt (send and reply); retries: further attempts for workers that
    did not answer (0 for non-idempotent calls); ctx: a zmq Context (default: a private one);
    networks: ``worker_networks``, the worker addresses it may connect to (default loopback);
    max_sockets: sockets open at once over all concurrent calls (each call also uses at most
    :data:`WINDOW` at once).
    """

    def __init__(self, timeout_s: float = 2.0, retries: int = 1, ctx: zmq.Context | None = None,
                 networks: Networks = LOOPBACK_NETWORKS, max_sockets: int = MAX_SOCKETS):
        self.networks = networks
        self.max_sockets = max(1, int(max_sockets))
        self._free = self.max_sockets  # sockets this client may still open (all its callers together)
        self._freed = threading.Condition()
        self.timeout_ms = max(1, int(timeout_s * 1000))
        self.retries = max(0, int(retries))
        self.zmq = zmq.green if patched() else zmq  # pyzmq's gevent-cooperative sockets under gevent
        self.ctx = ctx or self.zmq.Context()

    def refusal(self, target: Target) -> str:
        """Why ``target`` may not be contacted ("" when its address is in ``worker_networks``)."""
        if address_allowed(_host(target.ip), self.networks):
            return ""
        return f"worker address {target.ip}:{target.port} is not in worker_networks ({self.networks}); not contacted"

    def call(self, targets: list[Target], retries: int | None = None) -> list[Result]:
        """Send each target its message and collect replies, in target order.

        Returns one :class:`Result` per target; never raises for worker failures. Targets
        with a :meth:`refusal` get outcome ``refused`` and no connection.
        """
        results = {i: Result(t.worker_id, TIMEOUT) for i, t in enumerate(targets)}
        refused = {i: Result(t.worker_id, REFUSED, error=why)
                   for i, t in enumerate(targets) if (why := self.refusal(t))}
        results.update(refused)
        pending = [i for i in range(len(targets)) if i not in refused]
        tries = 1 + (self.retries if retries is None else max(0, retries))
        for _ in range(tries):
            if not pending:
                break
            left: list[int] = []
            for start in range(0, len(pending), WINDOW):  # at most WINDOW sockets at once per call
                window = pending[start:start + WINDOW]
                n = min(len(window), self.max_sockets)
                for part in (window[i:i + n] for i in range(0, len(window), n)):
                    self._take(len(part))
                    try:
                        left += self._attempt(targets, part, results)
                    finally:
                        self._give(len(part))
            pending = left
        for i in pending:
            t = targets[i]
            results[i].error = (
                f"no answer from {t.ip}:{t.port} within {self.timeout_ms / 1000:g}s ({results[i].attempts} attempt(s))"
            )
        for i, t in enumerate(targets):
            metrics.CONTROL_CALLS.labels(type(t.msg).__name__, results[i].outcome).inc()
            if results[i].error:
                log.warning("%s to worker %s: %s", type(t.msg).__name__, t.worker_id, results[i].error)
        return [results[i] for i in range(len(targets))]

    def _take(self, n: int) -> None:
        """Wait until ``n`` sockets may be opened (concurrent calls share ``max_sockets``)."""
        with self._freed:
            self._freed.wait_for(lambda: self._free >= n)
            self._free -= n

    def _give(self, n: int) -> None:
        with self._freed:
            self._free += n
            self._freed.notify_all()

    def _attempt(self, targets: list[Target], pending: list[int], results: dict[int, Result]) -> list[int]:
        poller = self.zmq.Poller()
        socks: dict[zmq.Socket, int] = {}
        try:
            for i in pending:
                t = targets[i]
                sock = self.ctx.socket(zmq.REQ)
                sock.setsockopt(zmq.LINGER, 0)
                sock.setsockopt(zmq.SNDTIMEO, self.timeout_ms)
                sock.setsockopt(zmq.MAXMSGSIZE, MAX_REPLY_BYTES)
                results[i].attempts += 1
                try:
                    sock.connect(f"tcp://{_host(t.ip)}:{int(t.port)}")
                except zmq.ZMQError as exc:  # a registration with an address ZMQ cannot use
                    sock.close(0)
                    results[i] = Result(t.worker_id, UNREACHABLE, error=f"address {t.ip}:{t.port} "
                                        f"is unusable: {exc}", attempts=results[i].attempts)
                    continue
                socks[sock] = i
                try:
                    sock.send(encode(t.msg), zmq.NOBLOCK)
                except zmq.Again:
                    pass  # queued on connect; a peer that never comes up times out below
                poller.register(sock, zmq.POLLIN)
            deadline = time.monotonic() + self.timeout_ms / 1000
            waiting = set(socks)
            while waiting:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                for sock, _ev in poller.poll(int(left * 1000) + 1):
                    i = socks[sock]
                    results[i] = self._decode(targets[i], sock.recv(), results[i].attempts)
                    poller.unregister(sock)
                    waiting.discard(sock)
            return sorted(socks[s] for s in waiting)
        finally:
            for sock in socks:
                sock.close(0)

    @staticmethod
    def _decode(target: Target, frame: bytes, attempts: int) -> Result:
        try:
            reply = _reply_decoder.decode(frame)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            return Result(
                target.worker_id, UNDECODABLE, error=f"undecodable reply: {exc}"[:300], attempts=attempts
            )
        if isinstance(reply, ErrorMsg):
            return Result(target.worker_id, WORKER_ERROR, reply, error=reply.error, attempts=attempts)
        if not isinstance(reply, EXPECTED_REPLY.get(type(target.msg), ())):
            return Result(
                target.worker_id,
                UNEXPECTED,
                reply,
                error=f"unexpected reply {type(reply).__name__}",
                attempts=attempts,
            )
        return Result(target.worker_id, OK, reply, attempts=attempts)

    def close(self) -> None:
        """Terminate the private context."""
        self.ctx.term()
