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


#: How long a sidecar trusts what it read of an instance's claim (keys.claims_key).
CLAIM_CACHE_S = 1.0


class InstancePolicy:
    """Which instances a sidecar takes LMCache messages for. allowed: instance ids; empty = any.

    claims: ``() -> {instance: claiming sidecar}`` of the live claims (``Store.live_claims``)
    and ``me``, this sidecar's id: a message for an instance another sidecar claims (its
    ``allowed_instance_ids`` names it) is refused while that sidecar's lease holds, whatever
    this sidecar's own list says (issue 20 item 10: a sidecar with an empty list let any peer
    wipe, retire or take over another's instance). The claims are read again every
    CLAIM_CACHE_S; while Redis cannot answer, the last ones read stand.
    """

    def __init__(self, allowed: Iterable[str] = (), claims: Callable[[], dict[str, str]] | None = None,
                 me: str = "", clock: Callable[[], float] = time.monotonic):
        self.allowed = frozenset(allowed)
        self.claims, self.me, self.clock = claims, me, clock
        self._claims: dict[str, str] = {}
        self._read_at = float("-inf")
        self.quiet = QuietLog()

    def refuse(self, tag: str, msg: Any) -> str:
        """"" when ``msg`` (a decoded message with ``instance_id``) may be applied; otherwise
        counts it (``reason="instance_not_allowed"`` or ``"instance_claimed"``) and returns the
        reason, for an ErrorMsg. While Redis cannot answer, the last claim read stands."""
        instance_id = getattr(msg, "instance_id", None)
        if self.allowed and instance_id not in self.allowed:
            metrics.REJECTED.labels("lmcache", "instance_not_allowed").inc()
            reason = f"instance {instance_id!r} is not in this sidecar's allowed_instance_ids"
            self.quiet.warn(f"instance:{instance_id}", f"dropped {tag}: {reason}")
            return reason
        other = self._claimer(instance_id) if isinstance(instance_id, str) else ""
        if not other:
            return ""
        metrics.REJECTED.labels("lmcache", "instance_claimed").inc()
        reason = (f"instance {instance_id!r} belongs to sidecar {other!r} (its allowed_instance_ids names it); "
                  f"this sidecar takes no writes for it while that sidecar runs")
        self.quiet.warn(f"claimed:{instance_id}", f"dropped {tag}: {reason}")
        return reason

    def _claimer(self, instance_id: str) -> str:
        """The other live sidecar that claims the instance, or ""."""
        if self.claims is None or instance_id in self.allowed:
            return ""
        now = self.clock()
        if now - self._read_at >= CLAIM_CACHE_S:
            try:
                self._claims = self.claims()
            except redis.RedisError:  # Redis down: the last claims stand (a write could not land anyway)
                pass
            self._read_at = now
        who = self._claims.get(instance_id, "")
        return who if who != self.me else ""
