"""Who may talk to a sidecar: peer addresses (ZAP) and the instance ids messages name.

:class:`PeerGate` is pyzmq's ZAP authenticator in its own thread, admitting TCP connections
whose peer address is in ``allowed_peers``. LMCache speaks ZMQ's NULL mechanism, which
consults ZAP only on sockets with a ZAP domain, so :meth:`PeerGate.guard` sets one on each
bound socket. :class:`InstancePolicy` drops messages for instances outside
``allowed_instance_ids``. Denials are counted in ``kvlookup_rejected_frames_total`` and
logged at most once a minute per peer or instance.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from typing import Any

import redis
import zmq
from zmq.auth.thread import ThreadAuthenticator

from kvlookup import metrics
from kvlookup.index.store import OtherWriter
from kvlookup.netpolicy import LOOPBACK_NETWORKS, Networks, address_allowed

log = logging.getLogger(__name__)

ZAP_DOMAIN = b"kvlookup"


class QuietLog:
    """Warnings at most once per ``every_s`` per key; the next one says how many were skipped."""

    def __init__(self, every_s: float = 60.0, max_keys: int = 4096):
        self.every_s, self.max_keys = every_s, max_keys
        self._last: dict[str, float] = {}
        self._skipped: dict[str, int] = {}

    def warn(self, key: str, message: str) -> None:
        now = time.monotonic()
        if now - self._last.get(key, -self.every_s) < self.every_s:
            self._skipped[key] = self._skipped.get(key, 0) + 1
            return
        if len(self._last) >= self.max_keys:  # bounded: many distinct peers reset the memory
            self._last.clear()
            self._skipped.clear()
        skipped = self._skipped.pop(key, 0)
        self._last[key] = now
        log.warning("%s%s", message, f" ({skipped} more since the last warning)" if skipped else "")


class PeerGate(ThreadAuthenticator):
    """ZAP handler for one zmq Context: TCP peers outside ``networks`` are refused at handshake.

    ctx: the context whose bound sockets are guarded (libzmq allows one ZAP handler per
    context). networks: ``allowed_peers``; ``*`` sets no ZAP domain, so nothing is checked.
    Call :meth:`start` before binding and :meth:`stop` before terminating the context.
    """

    def __init__(self, ctx: zmq.Context, networks: Networks = LOOPBACK_NETWORKS):
        super().__init__(ctx, log=logging.getLogger(__name__ + ".zap"))
        self.networks = networks
        self.quiet = QuietLog()

    def guard(self, sock: zmq.Socket, bind: str) -> None:
        """Make every TCP connection to ``sock`` (bound at ``bind``, not yet bound) ask this gate.

        Non-TCP transports (ipc, inproc) are local and left alone.
        """
        if bind.startswith("tcp://") and not self.networks.any:
            sock.zap_domain = ZAP_DOMAIN

    async def handle_zap_message(self, msg: list[bytes]) -> None:
        """One ZAP request (RFC 27 frames): allowed peers go on to pyzmq's checks; others get 400."""
        if len(msg) >= 6:
            peer = msg[3].decode("utf-8", "replace")
            if not address_allowed(peer, self.networks):
                metrics.REJECTED.labels("zmq", "peer_not_allowed").inc()
                self.quiet.warn(peer, f"refused a ZMQ connection from {peer}: not in allowed_peers ({self.networks})")
                self._send_zap_reply(msg[1], b"400", b"peer not in allowed_peers")
                return
        await super().handle_zap_message(msg)


#: How long a sidecar trusts what it read of who writes for an instance (keys.claims_key,
#: keys.owners_key, keys.mp_held_key).
CLAIM_CACHE_S = 1.0
#: The most instances whose answer a gate remembers (bounded: a peer naming many ids resets it).
MAX_REMEMBERED = 65_536


class OwnershipGate:
    """Whether another writer holds an instance (issue 20 item 10), read from Redis at most
    once per CLAIM_CACHE_S per instance (``Store.other_writer``, one round trip).

    other_writer: ``(instance_id, me) -> ""`` or the FOREIGN script's answer
    (``claim:<sidecar>``, ``owner:<sidecar>``, ``mp``); me: this sidecar's id. While Redis cannot
    answer (``offline``, or a read fails) the last answer stands ("" for one never read: a write
    could not land anyway, and the write itself (Store.own) checks again atomically).
    """

    def __init__(self, other_writer: Callable[[str, str], str] | None = None, me: str = "",
                 clock: Callable[[], float] = time.monotonic):
        self.other_writer, self.me, self.clock = other_writer, me, clock
        self._seen: dict[str, tuple[float, str]] = {}
        self.offline = False

    def other(self, instance_id: str) -> str:
        """"" or who else writes for ``instance_id`` (the FOREIGN script's answer)."""
        if self.other_writer is None:
            return ""
        now = self.clock()
        at, who = self._seen.get(instance_id, (float("-inf"), ""))
        if now - at >= CLAIM_CACHE_S and not self.offline:
            try:
                who = self.other_writer(instance_id, self.me)
            except redis.RedisError:  # Redis down: the last answer stands
                pass
            if len(self._seen) >= MAX_REMEMBERED:
                self._seen.clear()
            self._seen[instance_id] = (self.clock(), who)  # after a read that waited out a socket timeout too
        return who

    def forget(self, instance_id: str) -> None:
        """Read the instance's answer again next time (after this sidecar took or lost it)."""
        self._seen.pop(instance_id, None)


class InstancePolicy:
    """Which instances a sidecar takes LMCache messages for. allowed: instance ids; empty = any.

    gate: an :class:`OwnershipGate`: a message for an instance another writer holds is refused
    whatever this sidecar's own list says (issue 20 item 10: a sidecar with an empty list let any
    peer wipe, retire or take over another's instance): one a live sidecar claims (its
    ``allowed_instance_ids`` names it), one the live sidecar that wrote for it first owns (unless
    ``shared_instance_ownership``), one registered through the LMCache MP coordinator. An
    instance in this sidecar's own list is never refused for another's ownership (its claim
    beats it), only for another's claim.
    """

    def __init__(self, allowed: Iterable[str] = (), gate: OwnershipGate | None = None):
        self.allowed = frozenset(allowed)
        self.gate = gate or OwnershipGate()
        self.quiet = QuietLog()

    @property
    def offline(self) -> bool:
        return self.gate.offline

    @offline.setter
    def offline(self, value: bool) -> None:  # set by the ingest while Redis does not answer
        self.gate.offline = value

    def refuse(self, tag: str, msg: Any) -> str:
        """"" when ``msg`` (a decoded message with ``instance_id``) may be applied; otherwise
        counts it (``reason="instance_not_allowed"``, ``"instance_claimed"``, ``"instance_owned"``
        or ``"instance_mp"``) and returns the reason, for an ErrorMsg. While Redis cannot answer,
        the last answer read stands."""
        instance_id = getattr(msg, "instance_id", None)
        if self.allowed and instance_id not in self.allowed:
            metrics.REJECTED.labels("lmcache", "instance_not_allowed").inc()
            reason = f"instance {instance_id!r} is not in this sidecar's allowed_instance_ids"
            self.quiet.warn(f"instance:{instance_id}", f"dropped {tag}: {reason}")
            return reason
        if not isinstance(instance_id, str):
            return ""
        who = self.gate.other(instance_id)
        if not who:
            return ""
        refused = OtherWriter(instance_id, who)
        metrics.REJECTED.labels("lmcache", refused.reason).inc()
        self.quiet.warn(f"{refused.reason}:{instance_id}", f"dropped {tag}: {refused}")
        return str(refused)
