"""Publishing a worker's events over ZMQ the way vLLM's engines do (``ZmqEventPublisher``).

Routers users run (Dynamo's KV router and standalone indexer, vLLM-native routers) subscribe to
engines' ZMQ streams. Each message is three frames ``[topic, sequence number as a big-endian
u64, KVEventBatch msgpack]``; a ROUTER socket answers ``[b"", start_seq]`` with every batch
from ``start_seq`` on (``[b"", topic, seq, payload]`` each), then ``[b"", b"", -1, b""]``.

Where this differs from vLLM's publisher, on purpose:

- One event is one batch, and its sequence number is the event's id. Event ids are per worker,
  contiguous and continue across restarts (they come from the log), so the sequence numbers do
  too, and a batch is found in the durable log by its number alone.
- Only committed events are sent: the publisher of a worker with a log is fed by the log's
  writer after each commit (``EventLog.on_commit``), so a number once sent always names the same
  event, also after a crash (an event sent and then lost would have its id reused by another).
- Replay is served from the in-memory ring of the newest batches, and from the durable log for
  anything older, so a router that was down catches up on everything. Routers that start fresh
  (Dynamo's indexer asks for everything from 0 when the first number it sees is later) rebuild
  the whole worker.
- The engine's thread only appends to a queue: encoding, sending and replay happen on the
  publisher's thread. The PUB side is an XPUB socket with ``XPUB_NODROP``, sent to without
  blocking, so a subscriber that cannot keep up costs a dropped message, counted in
  ``dropped`` (and ``kvledger_zmq_dropped_messages_total``), which the subscriber sees as a
  gap and recovers by replay, instead of a silent drop.
- When a subscriber joins, the newest batch is sent again, so that one which missed batches
  (a restarted router, or one reconnecting to a restarted worker) sees its gap and asks for
  them at once, rather than at the worker's next event. Others skip it by its number.

What it exposes: ``BlockStored`` carries prompts' token ids. ``token_ids`` says where they go:
``keep`` (live and replayed batches), ``live_only`` (live batches only: the ring and the log
replay serve batches without them), ``drop`` (nowhere). With ``curve_secret_key`` (a zmq.auth
secret certificate) both sockets speak CurveZMQ: traffic is encrypted and only a subscriber that
knows the publisher's public key gets anything; ``curve_client_keys`` (a folder of public
certificates) further admits only those subscribers. A socket bound beyond loopback without
CurveZMQ is reported with a warning, once.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections import deque
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

from kvledger.events.log.replay import replay
from kvledger.events.types import AnyEvent, Tier, without_token_ids
from kvledger.events.vllm_events import VllmMapper, encode_events

log = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)
"""The sequence number that ends a replay (vLLM's ``ZmqEventPublisher.END_SEQ``)."""

TokenIds = Literal["keep", "live_only", "drop"]
TOKEN_ID_MODES: tuple[TokenIds, ...] = ("keep", "live_only", "drop")
_LOOPBACK_HOSTS = ("localhost", "::1", "[::1]", "ip6-localhost")


Mapped = tuple[int, bytes, bytes]
"""One event as a batch: (sequence number, payload sent live, payload kept for replay)."""


class BatchMapper:
    """Turns a worker's events into ZMQ batches: the vLLM mapping (which follows what each tier
    holds), the dp rank, and where token ids go (``token_ids``)."""

    def __init__(self, block_size: int, dp_rank: int, token_ids: TokenIds) -> None:
        self.mapper = VllmMapper(block_size)
        self.dp_rank = dp_rank
        self.token_ids = token_ids
        self.folded_up_to = -1
        """Events at or below it are in the mapper's seed already (skipped)."""

    def seed_from(self, log: Any, worker_id: int) -> None:
        """Start from the log's fold (a restart maps its ``Cleared`` against what was held)."""
        if log.last_event_id(worker_id) >= 0:
            log.flush()
            held, self.folded_up_to = logged_holdings(log, worker_id)
            self.mapper.seed(held)

    def mapped(self, event: AnyEvent) -> Mapped | None:
        """``event`` as a batch; None for one already in the seed."""
        if event.event_id <= self.folded_up_to:
            return None
        mapper, rank, keep = self.mapper, self.dp_rank, self.token_ids
        kept = event
        if keep != "keep":
            kept = without_token_ids(event)
            if keep == "drop":
                event = kept
        try:
            payload = mapper.payload(event, rank)
            # only a copy without token ids outlives the moment (live_only); mapping an
            # event twice is harmless: Stored and copies only add to the mapper's sets
            stored = payload if kept is event else mapper.payload(kept, rank)
        except Exception:
            log.exception("cannot map event %s for vLLM routers; sending an empty batch", event)
            payload = stored = encode_events([], mapper, ts=event.ts, dp_rank=rank)
        return event.event_id, payload, stored


class ZmqPublisher:
    """Publishes one worker's events on a ZMQ PUB socket.

    With ``log`` (the worker's durable event log), the publisher takes the events the log
    commits from now on (it must not be called as a sink then), serves replays older than the
    ring from the log, and maps a restart's ``Cleared`` against the log's fold. Without one it
    is a sink called with each event; ``held`` is then what the worker's tiers held before the
    first event it sees. ``subscribe=False``: the log (opened read-only) serves replays only, and
    the caller hands over batches mapped elsewhere (``send_mapped``: a publisher in a child
    process).
    """

    def __init__(
        self,
        endpoint: str,
        *,
        worker_id: int,
        block_size: int,
        replay_endpoint: str | None = None,
        topic: str = "",
        dp_rank: int = 0,
        log: Any = None,
        held: Mapping[Tier, Iterable[int]] | None = None,
        ring_size: int = 10_000,
        hwm: int = 100_000,
        collector: object | None = None,
        context: zmq.Context[Any] | None = None,
        token_ids: TokenIds = "keep",
        curve_secret_key: str | os.PathLike[str] | None = None,
        curve_client_keys: str | os.PathLike[str] | None = None,
        subscribe: bool = True,
    ) -> None:
        if ring_size < 1:
            raise ValueError(f"ring_size must be positive, got {ring_size}")
        if token_ids not in TOKEN_ID_MODES:
            raise ValueError(
                f"token_ids must be one of {', '.join(TOKEN_ID_MODES)}, got {token_ids!r}"
            )
        if curve_client_keys is not None and curve_secret_key is None:
            raise ValueError("curve_client_keys needs curve_secret_key")
        self.token_ids = token_ids
        self.worker_id = worker_id
        self.dp_rank = dp_rank
        self.block_size = block_size
        self._topic = topic.encode()
        self._log = log
        self._subscribed = subscribe
        self._mapper = BatchMapper(block_size, dp_rank, token_ids)
        self._ring: deque[tuple[int, bytes]] = deque(maxlen=ring_size)
        self._queue: deque[AnyEvent | Mapped | _Marker] = deque()
        self._wake = threading.Event()
        self._idle = False
        self._closing = False
        self.dropped = 0
        self.published = 0
        self.last_seen_id = -1
        """The newest committed event handed to this publisher."""
        self.sent_id = -1
        """The newest event sent, dropped or skipped (already in the seed)."""
        self.replays_abandoned = 0
        """Replays stopped because the subscriber that asked had stopped waiting."""
        self._next_seq: int | None = None  # the first live batch's number, once one is sent
        self._dropped_metric = dropped_counter(collector)
        curve = None if curve_secret_key is None else load_curve_secret(curve_secret_key)
        self.curve_public_key: bytes | None = None if curve is None else curve[0]
        # CurveZMQ's authenticator serves a whole context: a publisher that checks its
        # subscribers' keys gets a context of its own, so two of them never share one
        self._own_context: zmq.Context[Any] | None = None
        if context is None and curve_client_keys is not None:
            context = self._own_context = zmq.Context()
        ctx = context if context is not None else zmq.Context.instance()
        self._auth: ThreadAuthenticator | None = None
        self._pub = ctx.socket(zmq.XPUB)
        self._replay: zmq.Socket[Any] | None = None
        try:
            if curve_client_keys is not None:
                self._auth = _authenticator(ctx, curve_client_keys)
            self._pub.setsockopt(zmq.XPUB_NODROP, 1)
            self._pub.setsockopt(zmq.XPUB_VERBOSE, 1)  # every subscription, not only the first
            self._pub.setsockopt(zmq.SNDHWM, hwm)
            self._pub.setsockopt(zmq.LINGER, 500)
            if curve is not None:
                _serve_curve(self._pub, curve)
            self._pub.bind(endpoint)
            if replay_endpoint is not None:
                self._replay = ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.SNDHWM, 0)  # a replay is sent whole
                # a replay for a subscriber that stopped waiting (its socket is gone) fails
                # at its next batch instead of being built and sent whole to nobody
                self._replay.setsockopt(zmq.ROUTER_MANDATORY, 1)
                self._replay.setsockopt(zmq.LINGER, 500)
                if curve is not None:
                    _serve_curve(self._replay, curve)
                self._replay.bind(replay_endpoint)
        except zmq.ZMQError as exc:
            self._close_sockets()
            raise ValueError(f"cannot bind the ZMQ publisher: {exc}") from None
        except BaseException:  # the client keys' folder: nothing half-made stays open
            self._close_sockets()
            raise
        self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.replay_endpoint = (
            None if self._replay is None else self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
        )
        logger = logging.getLogger(__name__)  # ``log`` is the event log here
        logger.info(
            "publishing KV events on %s%s",
            self.endpoint,
            "" if self.replay_endpoint is None else f" (replay: {self.replay_endpoint})",
        )
        if curve is None:
            for bound in (self.endpoint, self.replay_endpoint):
                if bound is not None and not is_loopback(bound):
                    logger.warning(
                        "the ZMQ socket %s listens beyond this machine without CurveZMQ: "
                        "whoever reaches it reads every KV event%s; bind 127.0.0.1, or set "
                        "zmq_curve_secret_key (docs/security.md)",
                        bound,
                        "" if token_ids == "drop" else ", prompts' token ids included",
                    )
        if log is not None and subscribe:
            # subscribe first, then fold what is committed: an event committed in between is
            # both folded and handed over, and skipped by its id
            log.on_commit(self._committed, worker_id=worker_id)
            self._mapper.seed_from(log, worker_id)
        if held is not None:
            self._mapper.mapper.seed(held)
        self._thread = threading.Thread(target=self._run, name="kvledger-zmq-publisher")
        self._thread.daemon = True
        self._thread.start()

    # -- the engine's side: never blocks --------------------------------------------------------

    def __call__(self, event: AnyEvent) -> None:
        """Queue ``event`` (a publisher without a log; events of other workers are not this
        publisher's)."""
        if self._log is not None:
            raise TypeError(
                "this publisher is fed by its log's commits (what other processes see must be "
                "committed first); append the event to the log instead"
            )
        if event.worker_id == self.worker_id:
            self._queue.append(event)
            if self._idle:  # waking a busy thread would cost the engine a lock for nothing
                self._wake.set()

    def _committed(self, batch: Sequence[tuple[AnyEvent, bytes]]) -> None:
        """The log's writer, after a commit: queue the worker's newly committed events."""
        self._queue.extend(event for event, _record in batch)
        if batch:
            self.last_seen_id = batch[-1][0].event_id
        if self._idle:
            self._wake.set()

    def send_mapped(self, batches: Iterable[Mapped]) -> None:
        """Queue batches a ``BatchMapper`` made elsewhere (the engine's process, for a
        publisher in a child process: ``zmq_process``)."""
        self._queue.extend(batches)
        if self._idle:
            self._wake.set()

    def close(self, timeout: float = 5.0) -> None:
        """Send what is queued, then close the sockets."""
        if self._log is not None and self._subscribed:
            self._log.off_commit(self._committed)
        self._closing = True
        self._wake.set()
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.warning("ZMQ publisher did not finish within %.1f s", timeout)
            return
        self._close_sockets()

    def __enter__(self) -> ZmqPublisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def behind(self) -> int:
        """Events committed to the worker's log that this publisher has not sent (or dropped)
        yet (``kvbm_view_behind_events{view="zmq"}``)."""
        return max(0, self.last_seen_id - self.sent_id)

    def wait_sent(self, timeout: float = 5.0) -> bool:
        """Wait until every event so far has been sent (or dropped); False on timeout. With a
        log, that is every event appended to it so far: the log is flushed first."""
        if self._log is not None:
            self._log.flush()
        done = threading.Event()
        self._queue.append(_Marker(done))
        self._wake.set()
        return done.wait(timeout)

    # -- the publisher's thread -----------------------------------------------------------------

    def _run(self) -> None:
        queue, wake = self._queue, self._wake
        poller = zmq.Poller()
        poller.register(self._pub, zmq.POLLIN)
        if self._replay is not None:
            poller.register(self._replay, zmq.POLLIN)
        while True:
            if queue:
                self._send_queued()
            ready = dict(poller.poll(0))
            if self._pub in ready:
                self._drain_subscriptions()
            if self._replay is not None and self._replay in ready:
                try:
                    self._serve_replay()
                except zmq.ZMQError as exc:
                    if exc.errno == zmq.EHOSTUNREACH:
                        self.replays_abandoned += 1  # the subscriber left: it asks again
                    else:
                        log.exception("ZMQ replay failed")
                except Exception:
                    log.exception("ZMQ replay failed")
            if queue:
                continue
            if self._closing:
                return
            wake.clear()
            self._idle = True  # before the check: an event appended after it wakes the wait
            if not queue:
                wake.wait(0.05)
            self._idle = False

    def _send_queued(self) -> None:
        queue, ring, mapped = self._queue, self._ring, self._mapper.mapped
        send = self._pub.send
        topic = self._topic
        more = zmq.NOBLOCK | zmq.SNDMORE
        # a bounded pass, so that replay requests and subscriptions are served under load too
        for _ in range(min(len(queue), 4096)):
            item = queue.popleft()
            if isinstance(item, _Marker):
                item.done.set()
                continue
            batch = item if type(item) is tuple else mapped(item)  # type: ignore[arg-type]
            if batch is None:
                self.sent_id = item.event_id  # type: ignore[union-attr]
                continue
            seq, payload, stored = batch
            if self._next_seq is None:
                self._next_seq = seq
            ring.append((seq, stored))
            try:
                # the first frame either goes to every subscriber or fails; the rest follow it
                send(topic, more)
                send(seq.to_bytes(8, "big"), zmq.SNDMORE)
                send(payload)
                self.published += 1
            except zmq.Again:
                self.dropped += 1
                if self._dropped_metric is not None:
                    self._dropped_metric.inc()
            self.sent_id = seq  # a batch's sequence number is its event's id

    def _drain_subscriptions(self) -> None:
        """Read the subscriptions XPUB reports; on a new one, send the newest batch again.

        A subscriber learns it missed batches only from the next one it gets, so one that
        connects after a burst (a router restarting, or reconnecting to a restarted worker)
        would wait for the worker's next event to ask for them. The repeat tells it at once;
        subscribers that have it already skip it by its sequence number.
        """
        subscribed = False
        while True:
            try:
                message = self._pub.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
            subscribed = subscribed or message[:1] == b"\x01"
        if subscribed and self._ring:
            seq, payload = self._ring[-1]
            # a subscriber that is full now learns of the gap from the next batch instead
            with contextlib.suppress(zmq.Again):
                self._pub.send_multipart(
                    (self._topic, seq.to_bytes(8, "big"), payload), flags=zmq.NOBLOCK
                )

    def _serve_replay(self) -> None:
        assert self._replay is not None
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            log.warning("ignoring a replay request that is not [id, b'', u64 start]")
            return
        client, start = frames[0], int.from_bytes(frames[2], "big")
        send = self._replay.send_multipart
        topic = self._topic
        first_in_ring = self._ring[0][0] if self._ring else self._next_seq
        if self._log is not None and (first_in_ring is None or start < first_in_ring):
            for seq, payload in self._from_log(start, first_in_ring):
                send((client, b"", topic, seq.to_bytes(8, "big"), payload))
        for seq, payload in self._ring:
            if seq >= start:
                send((client, b"", topic, seq.to_bytes(8, "big"), payload))
        send((client, b"", b"", END_SEQ, b""))

    def _from_log(self, start: int, until: int | None) -> Iterator[tuple[int, bytes]]:
        """Batches ``start..until-1`` rebuilt from the durable log. The mapping of a
        ``Cleared`` depends on everything before it, so the worker's events are read from
        its first; copies get their tokens from the ``Stored`` events before them."""
        keep = self.token_ids == "keep"
        mapper = VllmMapper(self.block_size, remember_tokens=keep)
        last = None if until is None else until - 1
        # the ring holds committed events only, so everything older is in the log already
        for event in self._log.read(worker_id=self.worker_id, until_event_id=last):
            if not keep:  # a log written before token_ids was set may still hold some
                event = without_token_ids(event)
            payload = mapper.payload(event, self.dp_rank)
            if event.event_id >= start:
                yield event.event_id, payload

    def _close_sockets(self) -> None:
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close()
        if self._auth is not None:
            self._auth.stop()
            self._auth = None
        if self._own_context is not None:
            self._own_context.term()
            self._own_context = None


class _Marker:
    """A place in the queue (``wait_sent``)."""

    __slots__ = ("done",)

    def __init__(self, done: threading.Event) -> None:
        self.done = done


def is_loopback(endpoint: str) -> bool:
    """Whether a bound ZMQ endpoint is reachable from this machine only (``ipc://`` and
    ``inproc://`` are; ``tcp://`` on a 127.x or ::1 address is)."""
    transport, _, rest = endpoint.partition("://")
    if transport in ("ipc", "inproc"):
        return True
    host = rest.rpartition(":")[0]
    return host.startswith("127.") or host in _LOOPBACK_HOSTS


def load_curve_secret(path: str | os.PathLike[str]) -> tuple[bytes, bytes]:
    """(public, secret) key of a zmq.auth secret certificate (``NAME.key_secret``, made by
    ``zmq.auth.create_certificates``); a file that is not one is refused by name."""
    try:
        public, secret = zmq.auth.load_certificate(os.fspath(path))
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read the CurveZMQ certificate {path}: {exc}") from None
    if secret is None:
        raise ValueError(
            f"{path} is a public certificate; CurveZMQ needs the secret one (NAME.key_secret)"
        )
    return public, secret


def _serve_curve(sock: zmq.Socket[Any], keys: tuple[bytes, bytes]) -> None:
    sock.curve_server = True
    sock.curve_publickey, sock.curve_secretkey = keys


def _authenticator(
    ctx: zmq.Context[Any], client_keys: str | os.PathLike[str]
) -> ThreadAuthenticator:
    """A ZAP handler admitting the CurveZMQ clients whose public certificates lie in
    ``client_keys``."""
    folder = Path(client_keys)
    if not folder.is_dir():
        raise ValueError(f"no folder of CurveZMQ client certificates at {folder}")
    auth = ThreadAuthenticator(ctx, log=logging.getLogger(__name__ + ".auth"))
    auth.start()
    auth.configure_curve(domain="*", location=str(folder))
    return auth


def dropped_counter(collector: object | None) -> Any:
    if collector is None:
        return None
    from prometheus_client import CollectorRegistry
    from prometheus_client import Counter as PromCounter

    if not isinstance(collector, CollectorRegistry):
        raise TypeError(f"collector must be a prometheus CollectorRegistry, got {collector!r}")
    return PromCounter(
        "kvledger_zmq_dropped_messages",
        "ZMQ event batches not sent because a subscriber was too slow (replay recovers them)",
        registry=collector,
    )


def logged_holdings(log: Any, worker_id: int) -> tuple[dict[Tier, list[int]], int]:
    """What ``worker_id``'s tiers held by ``log``'s fold, and the last event folded: the
    state a restarted worker's publisher maps its first ``Cleared`` events against."""
    state = replay(log)
    held: dict[Tier, list[int]] = {}
    for (worker, tier), columns in state.iter_columns():
        if worker == worker_id:
            held[tier] = columns.seq.tolist()
    return held, state.last_event_id.get(worker_id, -1)


def open_publisher(
    endpoint: str,
    *,
    log: Any,
    worker_id: int,
    block_size: int,
    replay_endpoint: str | None = None,
    topic: str = "",
    dp_rank: int = 0,
    ring_size: int = 10_000,
    collector: object | None = None,
    token_ids: TokenIds = "keep",
    curve_secret_key: str | os.PathLike[str] | None = None,
    curve_client_keys: str | os.PathLike[str] | None = None,
) -> ZmqPublisher:
    """A publisher for a worker that writes ``log``: it sends what the log commits, replay
    reaches back through the log, and a restart's ``Cleared`` events are mapped against what
    the log says was held."""
    return ZmqPublisher(
        endpoint,
        worker_id=worker_id,
        block_size=block_size,
        replay_endpoint=replay_endpoint,
        topic=topic,
        dp_rank=dp_rank,
        log=log,
        ring_size=ring_size,
        collector=collector,
        token_ids=token_ids,
        curve_secret_key=curve_secret_key,
        curve_client_keys=curve_client_keys,
    )
