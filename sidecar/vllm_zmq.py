"""ZMQ plumbing for vLLM event streams: the replay DEALER and the SUB sockets of every DP rank.

vLLM's publisher (``ZmqEventPublisher``) has a PUB socket at ``endpoint`` and an optional
ROUTER at ``replay_endpoint``; data-parallel rank r uses both ports + r. A real vLLM given
``tcp://*:5557`` binds, so the sidecar connects its SUB (the default); given a concrete
address vLLM connects, so the sidecar binds (``bind=True``). The replay ROUTER is always
bound by vLLM, so the DEALER always connects.
"""

from __future__ import annotations

import logging
import threading
import time
import urllib.parse
from dataclasses import dataclass

import zmq

from kvlookup import metrics
from kvlookup.index.store import Store
from kvlookup.sidecar.admission import OwnershipGate
from kvlookup.sidecar.sockets import Limits, SocketSet
from kvlookup.sidecar.turns import run_turns
from kvlookup.sidecar.vllm_discovery import Discovered, DiscoveryError, RankSource, discover
from kvlookup.sidecar.vllm_ingest import VllmIngest
from kvlookup.wire.errors import WireError
from kvlookup.wire.vllm import REPLAY_END, parse_replay
from kvlookup.wire.zmqaddr import endpoint, with_port_offset

log = logging.getLogger(__name__)


#: A replay longer than this many batches is not vLLM's (it buffers ``buffer_steps`` = 10,000).
MAX_REPLAY_BATCHES = 10_000
#: Live messages of one rank read together (and written as one batch when consecutive): 32, not
#: 8, cut decode-shaped sidecar CPU per block by ~20% when behind (docs/benchmarks-notes.md).
MAX_BATCHES_PER_READ = 32
#: A whole replay may take this many per-reply timeouts.
TOTAL_TIMEOUTS = 5
#: When a SUB socket (re)connects, catch up after each of these delays (seconds).
CATCH_UP_DELAYS_S = (0.05, 1.0)
#: A discovered engine whose SUB connection dropped: read its URL again after this long, then
#: every REDISCOVER_EVERY_S for REDISCOVER_TRIES tries, then every REDISCOVER_SLOW_S until it
#: answers (an engine reloading its model takes minutes), each GET waiting at most the timeout.
REDISCOVER_AFTER_S = 1.0
REDISCOVER_EVERY_S = 2.0
REDISCOVER_TRIES = 30
REDISCOVER_SLOW_S = 10.0
REDISCOVER_TIMEOUT_S = 1.0


def ipv6(sock: zmq.Socket, url: str) -> None:
    """libzmq reaches an IPv6 literal (``tcp://[fd00::5]:5557``) only with ZMQ_IPV6 on."""
    if "[" in url:
        sock.setsockopt(zmq.IPV6, 1)


def subscribe(sock: zmq.Socket, url: str, topic: str) -> None:
    ipv6(sock, url)
    sock.setsockopt(zmq.SUBSCRIBE, topic.encode())


class ReplayClient:
    """Asks vLLM's replay ROUTER for buffered batches, synchronously.

    ctx: the zmq context. url: ``tcp://host:port`` of rank 0 (rank r adds r), or urls: each
    rank's own (discovered). timeout_s: the longest wait for each reply; vLLM answers between
    queue polls (<= ~0.1 s).
    """

    def __init__(self, ctx: zmq.Context, url: str | None, timeout_s: float = 2.0,
                 urls: dict[int, str] | None = None):
        self.ctx = ctx
        self.url = endpoint(url) if url else None
        self.urls = {rank: endpoint(u) for rank, u in (urls or {}).items()}
        self.timeout_ms = int(timeout_s * 1000)
        self.socks: dict[int, zmq.Socket] = {}

    def __call__(self, rank: int, start: int) -> list[tuple[int, bytes]] | None:
        """Batches with seq >= start as a contiguous run (seq, payload).

        None when the replay fails: a reply takes longer than ``timeout_s``, the whole replay
        longer than ``TOTAL_TIMEOUTS`` times that, or it sends more than
        ``MAX_REPLAY_BATCHES`` batches (vLLM keeps ``buffer_steps`` = 10,000) without its end
        marker. The caller then resyncs the rank; the loop is never held longer than that.
        """
        sock = self._socket(rank)
        if sock is None:
            return None
        sock.send_multipart([b"", start.to_bytes(8, "big")])
        run: list[tuple[int, bytes]] = []
        broken = False
        deadline = time.monotonic() + self.timeout_ms * TOTAL_TIMEOUTS / 1000
        for _ in range(MAX_REPLAY_BATCHES + 1):
            left_ms = min(self.timeout_ms, int((deadline - time.monotonic()) * 1000))
            if left_ms <= 0 or not sock.poll(left_ms):
                break
            try:
                seq, payload = parse_replay(sock.recv_multipart())
            except WireError as exc:
                metrics.REJECTED.labels("vllm", exc.reason).inc()
                continue
            if seq == REPLAY_END:
                return run
            if run and seq != run[-1][0] + 1:
                broken = True
            if not broken:
                run.append((seq, payload))
        log.warning("replay from %s (rank %d, seq %d) gave up after %d batch(es)", self._url(rank), rank, start,
                    len(run))
        self._drop(rank)  # late replies must not reach the next request
        return None

    def _url(self, rank: int) -> str | None:
        return self.urls.get(rank) if self.urls else (with_port_offset(self.url, rank) if self.url else None)

    def _socket(self, rank: int) -> zmq.Socket | None:
        sock = self.socks.get(rank)
        if sock is None:
            url = self._url(rank)
            if url is None:
                return None
            sock = self.ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            ipv6(sock, url)
            sock.connect(url)
            self.socks[rank] = sock
        return sock

    def _drop(self, rank: int) -> None:
        sock = self.socks.pop(rank, None)
        if sock is not None:
            sock.close(0)

    def close(self) -> None:
        for rank in list(self.socks):
            self._drop(rank)


@dataclass
class VllmSource:
    """One vLLM instance's event endpoints, as given on the command line or in settings, or
    discovered from its HTTP API (``vllm_url``; kvlookup.sidecar.vllm_discovery): then
    ``ranks`` lists each data-parallel rank's endpoints, ``model`` the served model, and the
    loop reads them again when the engine restarts (its SUB connections drop)."""

    instance_id: str
    endpoint: str = ""
    replay_endpoint: str | None = None
    dp_size: int = 1
    bind: bool = False
    topic: str = ""
    replay_timeout_s: float = 2.0
    vllm_url: str | None = None
    ranks: tuple[RankSource, ...] = ()
    model: str | None = None
    #: leave each write in flight while the next batch decodes (``vllm_overlap_writes``)
    overlap_writes: bool = True

    def rank_sources(self) -> tuple[RankSource, ...]:
        """Every rank's endpoints: the discovered ones, or rank r of ``endpoint`` at port + r."""
        if self.ranks:
            return self.ranks
        return tuple(RankSource(r, with_port_offset(self.endpoint, r),
                                with_port_offset(self.replay_endpoint, r) if self.replay_endpoint else None,
                                self.topic, self.bind) for r in range(self.dp_size))

    @classmethod
    def discovered(cls, instance_id: str | None, vllm_url: str, found: Discovered,
                   replay_timeout_s: float = 2.0, overlap_writes: bool = True) -> VllmSource:
        """A source from :func:`discover`'s answer; instance_id defaults to the URL's host:port."""
        name = instance_id or urllib.parse.urlsplit(vllm_url).netloc
        first = found.ranks[0]
        return cls(name, first.endpoint, first.replay_endpoint, len(found.ranks), first.bind, first.topic,
                   replay_timeout_s, vllm_url, found.ranks, found.model, overlap_writes)


class VllmLoop:
    """The vLLM event streams of one sidecar, in a thread of their own: a replay waits for
    vLLM's answer (seconds when it is slow), and the LMCache loop, its heartbeat replies and the
    liveness leases never wait behind it.

    store: the index (this loop keeps its own holder cache). sources: the vLLM instances.
    sidecar_id: the owner of their instances. sockets: where to create the SUB sockets (the
    sidecar's context, limits and peer guard). grace_s: a rank whose SUB connection dropped and
    did not come back within this long is recorded as gone (``Store.suspect``; its engine
    stopped), unless it is not registered.
    """

    def __init__(self, store: Store, sources: tuple[VllmSource, ...], *, sidecar_id: str = "",
                 sockets: SocketSet | None = None, grace_s: float = 5.0):
        self.store = Store(store.r, instance_ttl_s=store.instance_ttl_ms / 1000,
                           worker_ttl_s=store.worker_ttl_ms / 1000, purge_grace_s=store.purge_grace_ms / 1000,
                           records=store.records)
        self.store.shared_ownership = store.shared_ownership
        self.ownership = OwnershipGate(self.store.other_writer, sidecar_id)  # this thread's own (issue 20 item 10)
        self.sockets = sockets or SocketSet(zmq.Context.instance(), Limits())
        self.grace_s = grace_s
        self.ingests: dict[str, VllmIngest] = {}
        self.replays: dict[str, ReplayClient] = {}
        self.down: dict[tuple[str, int], float] = {}  # (instance, rank) -> when to record it gone
        self.catchups: dict[tuple[str, int], list[float]] = {}  # (instance, rank) -> when to catch up
        self.sources: dict[str, VllmSource] = {}
        self.subs: dict[str, list[zmq.Socket]] = {}  # instance -> its SUB sockets
        self.rediscover: dict[str, tuple[float, int]] = {}  # instance -> (when, tries) to read its URL again
        self.disconnected: set[tuple[str, int]] = set()  # (instance, rank) whose SUB connection is away
        self.sidecar_id = sidecar_id
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self.run, name="kvlookup-vllm", daemon=True)
        for source in sources:
            self._attach(source)

    def _attach(self, source: VllmSource) -> VllmIngest:
        iid = source.instance_id
        ranks = source.rank_sources()
        urls = {rs.rank: rs.replay_endpoint for rs in ranks if rs.replay_endpoint}
        replay = ReplayClient(self.sockets.ctx, None, source.replay_timeout_s, urls=urls) if urls else None
        if replay is not None:
            self.replays[iid] = replay
        ingest = self.ingests.get(iid)
        if ingest is None:
            ingest = self.ingests[iid] = VllmIngest(self.store, iid, replay, owner=self.sidecar_id,
                                                         gate=self.ownership, overlap=source.overlap_writes)
        ingest.replay = replay
        ingest.set_model(source.model)
        self.sources[iid] = source
        self.subs[iid] = [self._subscribe(ingest, rs) for rs in ranks]
        log.info("vLLM instance %s%s: %s; model %s", iid, f" ({source.vllm_url})" if source.vllm_url else "",
                 ", ".join(f"rank {rs.rank} {'bind' if rs.bind else 'connect'} {rs.endpoint} replay "
                           f"{rs.replay_endpoint or '-'}" for rs in ranks), source.model or "-")
        return ingest

    def _subscribe(self, ingest: VllmIngest, rs: RankSource) -> zmq.Socket:
        key = (ingest.instance_id, rs.rank)

        def handler(sock: zmq.Socket) -> None:
            self.down.pop(key, None)
            msgs = [sock.recv_multipart(copy=True)]
            while len(msgs) < MAX_BATCHES_PER_READ and sock.poll(0):
                msgs.append(sock.recv_multipart(copy=True))
            ingest.handle_live_many(rs.rank, msgs)  # consecutive batches: one write

        def on_event(event: int, _fd: int, _endpoint: str) -> None:
            if event == zmq.EVENT_DISCONNECTED:
                self.disconnected.add(key)
                self.down.setdefault(key, time.monotonic() + self.grace_s)
                if self.sources[key[0]].vllm_url and key[0] not in self.rediscover:
                    self.rediscover[key[0]] = (time.monotonic() + REDISCOVER_AFTER_S, 0)
            elif event in (zmq.EVENT_CONNECTED, zmq.EVENT_ACCEPTED):
                self.disconnected.discard(key)
                self.down.pop(key, None)
                self._schedule_catch_up(key)

        sock = self.sockets.add(zmq.SUB, handler, bind=rs.endpoint if rs.bind else None,
                                connect=None if rs.bind else rs.endpoint, on_event=on_event,
                                setup=lambda s: subscribe(s, rs.endpoint, rs.topic))
        if rs.replay_endpoint:
            self.catchups[key] = [0.0]  # at start: whatever was published while no sidecar listened
        return sock

    def _detach(self, instance_id: str) -> None:
        for sock in self.subs.pop(instance_id, []):
            self.sockets.remove(sock)
        replay = self.replays.pop(instance_id, None)
        if replay is not None:
            replay.close()
        for key in [k for k in self.catchups if k[0] == instance_id]:
            del self.catchups[key]
        self.disconnected = {k for k in self.disconnected if k[0] != instance_id}  # new sockets say anew

    def _rediscover(self) -> None:
        """Read the URL of each restarted engine again; re-subscribe when its endpoints moved."""
        now = time.monotonic()
        for iid, (due, tries) in list(self.rediscover.items()):
            if due > now:
                continue
            source = self.sources[iid]
            url = source.vllm_url or ""
            known = {rs.endpoint: rs.bind for rs in source.ranks}
            try:
                found = discover(url, timeout_s=REDISCOVER_TIMEOUT_S, known=known)
            except DiscoveryError as exc:
                if not exc.transient:  # it answered, and not with its endpoints
                    log.warning("vLLM %s: %s; keeping its last endpoints", iid, exc)
                    del self.rediscover[iid]
                    continue
                if tries + 1 == REDISCOVER_TRIES:
                    log.warning("vLLM %s: %s; asking again every %.0fs", iid, exc, REDISCOVER_SLOW_S)
                slow = tries + 1 >= REDISCOVER_TRIES
                self.rediscover[iid] = (now + (REDISCOVER_SLOW_S if slow else REDISCOVER_EVERY_S), tries + 1)
                continue
            new = VllmSource.discovered(iid, url, found, source.replay_timeout_s, source.overlap_writes)
            if new.ranks == source.ranks and any(k[0] == iid for k in self.disconnected):
                # the same endpoints while a rank is still away: maybe the server's old answer
                # (its engine restarting); ask again until the ranks are back or the answer moves
                self.sources[iid] = new
                self.rediscover[iid] = (now + (REDISCOVER_SLOW_S if tries + 1 >= REDISCOVER_TRIES
                                               else REDISCOVER_EVERY_S), tries + 1)
                continue
            del self.rediscover[iid]
            if new.ranks != source.ranks:
                log.warning("vLLM %s: endpoints changed on restart; subscribing again", iid)
                self._detach(iid)
                self._attach(new)
            else:
                self.sources[iid] = new
                self.ingests[iid].set_model(new.model)

    def start(self) -> None:
        self.thread.start()

    def run(self) -> None:
        """Serve until :meth:`stop`. Redis outages pause the loop; a lost message is a seq gap."""
        run_turns(self._turn, self._stop, "vllm")
        for ingest in self.ingests.values():
            ingest.close()
        for replay in self.replays.values():
            replay.close()
        self.sockets.close()

    def _turn(self) -> None:
        writing = any(ingest.writer.in_flight for ingest in self.ingests.values())
        ready = self.sockets.poll(0 if writing else 200 if not self.catchups else 50)
        for sock in ready:
            self.sockets.handlers[sock](sock)
        if not ready:  # nothing waits: no write is left in flight (sidecar.vllm_writer)
            for ingest in self.ingests.values():
                ingest.settle()
        for iid, ingest in self.ingests.items():
            while ingest.replay_due:  # a write failed: replay heals the rank without waiting
                self._schedule_catch_up((iid, ingest.replay_due.pop()))
        self._catch_up()
        if self.rediscover:
            self._rediscover()
        self._record_gone()

    def _schedule_catch_up(self, key: tuple[str, int]) -> None:
        """Catch up shortly after a (re)connect, and once more after the slow-joiner window (a
        batch published while the subscription was still on its way is in the replay buffer by
        then). At most :data:`CATCH_UP_DELAYS_S` per connection event."""
        if self.ingests[key[0]].replay is None:
            return
        now = time.monotonic()
        self.catchups[key] = sorted({*self.catchups.get(key, []), *(now + d for d in CATCH_UP_DELAYS_S)})

    def _catch_up(self) -> None:
        now = time.monotonic()
        for key in [k for k, due in self.catchups.items() if due and due[0] <= now]:
            due = [t for t in self.catchups[key] if t > now]
            if due:
                self.catchups[key] = due
            else:
                del self.catchups[key]
            self.ingests[key[0]].catch_up(key[1])

    def _record_gone(self) -> None:
        now = time.monotonic()
        for key in [k for k, at in self.down.items() if at <= now]:
            del self.down[key]
            if self.store.is_registered(*key) and not self.ownership.other(key[0]):  # never another's rank
                log.warning("vLLM %s rank %d: its event stream stayed disconnected %.0fs; recording it gone",
                            key[0], key[1], self.grace_s)
                self.store.suspect(*key, self.store.clock.now_ms())

    def stop(self) -> None:
        self._stop.set()

    def join(self, timeout: float | None = None) -> None:
        if self.thread.is_alive():
            self.thread.join(timeout)
