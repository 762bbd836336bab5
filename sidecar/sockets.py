"""ZMQ sockets of a sidecar loop: bounded receive queues and frame sizes, connection events.

One :class:`SocketSet` per thread (the LMCache loop, the vLLM loop): it creates sockets with
the sidecar's :class:`Limits`, polls them, and pairs each with a socket monitor when asked, so
the loop learns when a peer connects or goes away (liveness evidence, sidecar.liveness).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import zmq
from zmq.utils.monitor import recv_monitor_message


@dataclass(frozen=True)
class Limits:
    """Bounds on what a peer can make a sidecar hold.

    max_frame_bytes: largest frame (``ZMQ_MAXMSGSIZE``); a peer sending more is disconnected.
    max_message_bytes: largest multipart message; a larger one is dropped and counted.
    rcvhwm: messages ZMQ queues per peer before it stops reading from that peer (back
    pressure: the sender waits). max_queued_ops: chunk operations decoded but not written
    yet; past it the loop stops reading PUSH traffic until the queue drains. slice_ops: ops
    written per loop turn, so heartbeats and liveness are served between slices.
    """

    max_frame_bytes: int = 4 * 1024 * 1024
    max_message_bytes: int = 8 * 1024 * 1024
    rcvhwm: int = 1000
    max_queued_ops: int = 200_000
    slice_ops: int = 5_000


#: Socket monitor events a loop listens to.
CONNECTION_EVENTS = zmq.EVENT_ACCEPTED | zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED

#: ``on_event(event, fd, endpoint)`` for a monitored socket.
EventHandler = Callable[[int, int, str], None]


class SocketSet:
    """Sockets polled by one loop. ``add`` binds or connects; ``poll`` returns ready sockets.
    guard: called with (socket, address) before every bind (the peer allow-list)."""

    def __init__(self, ctx: zmq.Context, limits: Limits,
                 guard: Callable[[zmq.Socket, str], None] | None = None):
        self.ctx = ctx
        self.limits = limits
        self.guard = guard  # called before every bind (sidecar.admission.PeerGate.guard)
        self.poller = zmq.Poller()
        self.handlers: dict[zmq.Socket, Callable[[zmq.Socket], None]] = {}
        self.monitors: dict[zmq.Socket, zmq.Socket] = {}  # monitor PAIR -> its socket

    def add(self, kind: int, handler: Callable[[zmq.Socket], None], *, bind: str | None = None,
            connect: str | None = None, on_event: EventHandler | None = None,
            setup: Callable[[zmq.Socket], None] | None = None) -> zmq.Socket:
        """Create a socket, apply the limits (receiving kinds), bind or connect, and poll it;
        ``handler(sock)`` runs when it is readable, ``on_event`` on connection events."""
        sock = self.ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        if kind in (zmq.PULL, zmq.SUB, zmq.ROUTER):
            sock.setsockopt(zmq.RCVHWM, self.limits.rcvhwm)
            sock.setsockopt(zmq.MAXMSGSIZE, self.limits.max_frame_bytes)
        if setup is not None:
            setup(sock)
        if on_event is not None:
            mon = sock.get_monitor_socket(CONNECTION_EVENTS)
            self.monitors[mon] = sock
            self.poller.register(mon, zmq.POLLIN)
            self.handlers[mon] = functools.partial(_drain_events, on_event=on_event)
        if bind:
            if self.guard is not None:
                self.guard(sock, bind)
            sock.bind(bind)
        if connect:
            sock.connect(connect)
        self.poller.register(sock, zmq.POLLIN)
        self.handlers[sock] = handler
        return sock

    def remove(self, sock: zmq.Socket) -> None:
        """Stop polling and close a socket (and its monitor)."""
        for mon in [m for m, s in self.monitors.items() if s is sock]:
            sock.disable_monitor()
            self._drop(mon)
            del self.monitors[mon]
        self._drop(sock)

    def _drop(self, sock: zmq.Socket) -> None:
        self.poller.unregister(sock)
        self.handlers.pop(sock, None)
        sock.close(0)

    def poll(self, timeout_ms: int) -> list[zmq.Socket]:
        """Ready sockets, monitors first (a connection event is handled before its data)."""
        ready = [s for s, _ev in self.poller.poll(timeout_ms)]
        return sorted(ready, key=lambda s: s not in self.monitors)

    def close(self) -> None:
        for sock in [s for s in self.handlers if s not in self.monitors]:
            self.remove(sock)


def _drain_events(mon: zmq.Socket, on_event: EventHandler) -> None:
    while mon.poll(0):
        ev = recv_monitor_message(mon)
        on_event(int(ev["event"]), int(ev["value"]), ev["endpoint"].decode(errors="replace"))


def source_fd(frame: zmq.Frame) -> int | None:
    """The descriptor of the connection a received frame came over (``ZMQ_SRCFD``)."""
    try:
        return frame.get(zmq.SRCFD)
    except zmq.ZMQError:
        return None
