"""A simulated LMCache worker REP port (real zmq REP socket) speaking the 0.5.6 control encoding."""

from __future__ import annotations

import threading
from collections.abc import Callable

import msgspec
import zmq

from kvlookup.proc.redis_server import free_port
from kvlookup.wire import lmcache_control as ctl
from kvlookup.wire.lmcache import ErrorMsg

Request = (
    ctl.ClearWorkerMsg
    | ctl.PinWorkerMsg
    | ctl.CompressWorkerMsg
    | ctl.DecompressWorkerMsg
    | ctl.MoveWorkerMsg
    | ctl.HealthWorkerMsg
    | ctl.CheckFinishWorkerMsg
)
_decoder = msgspec.msgpack.Decoder(Request)


def default_answer(msg) -> msgspec.Struct:
    """What a healthy worker holding 12 tokens answers."""
    if isinstance(msg, ctl.HealthWorkerMsg):
        return ctl.HealthWorkerRetMsg(0)
    name = type(msg).__name__.replace("WorkerMsg", "WorkerRetMsg")
    if isinstance(msg, ctl.CheckFinishWorkerMsg):
        return ErrorMsg(error=f"Unknown message: {msg}")
    return getattr(ctl, name)(12)


class RepWorker:
    """REP socket on 127.0.0.1:<port> in a thread; records every decoded request (and raw bytes).

    answer(msg) -> reply struct, raw bytes, or None to stay silent (a hung worker).
    """

    def __init__(self, answer: Callable = default_answer, port: int | None = None):
        self.port = port or free_port()
        self.answer = answer
        self.received: list = []
        self.raw: list[bytes] = []
        self._stop = threading.Event()
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.REP)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(f"tcp://127.0.0.1:{self.port}")
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(50):
                continue
            raw = self.sock.recv()
            self.raw.append(raw)
            msg = _decoder.decode(raw)
            self.received.append(msg)
            reply = self.answer(msg)
            if reply is None:
                return  # hung: never answers again (REP cannot receive before it sends)
            self.sock.send(reply if isinstance(reply, bytes) else ctl.encode(reply))

    def close(self) -> None:
        self._stop.set()
        self.thread.join(5)
        self.sock.close(0)
        self.ctx.term()
