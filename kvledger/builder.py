"""One builder under every entry point: ``open_worker(settings)`` assembles what runs beside an
engine instance, and every entry point (``BlockManager``, ``kvledger worker``, ``kvledger
simulate``, the vLLM integration, the SGLang backend) takes its parts from it.

A *worker* here is one engine instance as kvledger sees it: a worker id, and around the blocks
the engine keeps (the entry point's own business: a ``TieredPools`` with tiers, a mock
engine's pool, vLLM's CPU tier) the same plumbing everywhere:

- the durable event log, with the settings' durability, bounds, retry and token-id rule, and an
  ``AppendBuffer`` in front of it: producers hand it their events (``worker.sink``), which
  reach the log in batches within ``max_delay/4`` (encoding a few events between two steps'
  work runs from cold caches, and each append is a locked hand-over);
- the restart rule: a worker whose log already holds events continues their ids
  (``last_event_id``), and says with a ``Cleared`` that each tier it did not recover starts
  empty (``resume``), so the log replays to this run;
- what a restart recovers from the log: the fold of this worker's blocks on a tier
  (``logged``, read once) and the token ids its ``Stored`` events kept (``logged_tokens``);
- the views other processes read, fed by the log's commits: the shared registry's publisher
  (which claims the worker id and reconciles the registry with the log at start) and the ZMQ
  publisher;
- Prometheus metrics (``kvbm_*``): every event the worker hands its log is counted, and the
  log's backlog, commit lag and back-pressure are read at each scrape; served on
  ``metrics_addr:metrics_port`` when that is set.

Each setting is read here and nowhere else. Nothing here holds KV bytes, so importing it loads
no torch: the G3 recovery that opens a slot file lives in ``kvledger.recovery``.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Collection, Iterable, Sequence
from wsgiref.simple_server import WSGIServer

from kvledger.config import Settings
from kvledger.events.log import AppendBuffer, EventLog
from kvledger.events.log.replay import replay
from kvledger.events.shared.client import connect
from kvledger.events.shared.publish import RedisPublisher
from kvledger.events.shared.registry import SharedRegistry
from kvledger.events.shared.zmq_process import ZmqPublisherProcess
from kvledger.events.shared.zmq_publish import ZmqPublisher, open_publisher
from kvledger.events.types import LogRecord, Lookup, Released, RunInfo, Stored, Tier
from kvledger.metrics import Metrics
from kvledger.registry.emitter import LOCAL_TIERS, EventEmitter
from kvledger.registry.hashing import names_plain_block
from kvledger.registry.pool import token_bytes
from kvledger.registry.state import RegistryState

__all__ = ["LOCAL_TIERS", "KnownBlocks", "Worker", "open_worker"]

log = logging.getLogger(__name__)

_LOOKUP_TYPES = (Lookup, Released, RunInfo)

KnownBlocks = dict[int, tuple[int, int | None]]
"""A tier's blocks by the log's fold: sequence hash -> (local hash, parent hash)."""


class Worker:
    """What ``open_worker`` assembled for one engine instance; ``close`` takes it down in the
    order that loses nothing (the buffer into the log, the log's commits into the views, then
    the log)."""

    def __init__(
        self,
        settings: Settings,
        *,
        event_log: EventLog | None,
        own_log: bool,
        metrics: Metrics | None,
    ) -> None:
        self.settings = settings
        self.worker_id = settings.worker_id
        self.dp_rank = settings.dp_rank
        self.event_log = event_log
        self._own_log = own_log
        self.metrics = metrics
        self.last_event_id = -1 if event_log is None else event_log.last_event_id(self.worker_id)
        """This worker's last event in the log before this run (-1: a first run)."""
        self.buffer: AppendBuffer | None = None
        self._observe = None if metrics is None else metrics.observe_event
        self._server: WSGIServer | None = None
        self.publisher: RedisPublisher | None = None
        self.zmq: ZmqPublisher | ZmqPublisherProcess | None = None
        self._folded: RegistryState | None = None
        self._fold_failed = False
        self._closed = False

    @property
    def restarted(self) -> bool:
        """Whether the log holds an earlier run of this worker."""
        return self.last_event_id >= 0

    @property
    def shared(self) -> SharedRegistry | None:
        """The shared registry the publisher writes to (None without ``redis_url``)."""
        return None if self.publisher is None else self.publisher.registry

    # -- events ------------------------------------------------------------------------------

    def sink(self, event: LogRecord) -> None:
        """Hand one event (or lookup record) to the log, in order, and count it in the
        metrics: what an emitter calls."""
        buffer = self.buffer
        if buffer is not None:
            buffer.add(event)
        if self._observe is not None and not isinstance(event, _LOOKUP_TYPES):
            self._observe(event)

    def extend(self, events: Sequence[LogRecord]) -> None:
        """``sink`` for several events (a scheduler step's)."""
        if self.buffer is not None and events:
            self.buffer.extend(events)
        if self._observe is not None:
            for event in events:
                if not isinstance(event, _LOOKUP_TYPES):
                    self._observe(event)

    def emitter(self, sink: object = None) -> EventEmitter:
        """An emitter that numbers this worker's events on from its log; events go to
        ``sink`` (default: ``self.sink``)."""
        return EventEmitter(
            self.sink if sink is None else sink,  # type: ignore[arg-type]
            worker_id=self.worker_id,
            dp_rank=self.dp_rank,
            first_event_id=self.last_event_id + 1,
        )

    def resume(self, emitter: EventEmitter, *, recovered: Collection[Tier] = ()) -> None:
        """The restart rule, once for every entry point: ``emitter`` continues this worker's
        ids, and after an earlier run each local tier it did not recover (``recovered``, a G3
        whose file the log vouched for) gets a ``Cleared``."""
        emitter.resume(
            self.last_event_id, clear=[tier for tier in LOCAL_TIERS if tier not in recovered]
        )

    # -- what a restart recovers -------------------------------------------------------------

    def logged(self, tier: Tier) -> KnownBlocks | None:
        """This worker's blocks on ``tier`` by the log's fold before this run (read once, and
        only after an earlier run); None when there is no log or it cannot be folded (a tier
        then starts empty rather than trust what the log cannot vouch for)."""
        if self.event_log is None or self._fold_failed:
            return None
        if not self.restarted:
            return {}
        if self._folded is None:
            try:
                self._folded = replay(self.event_log, until_event_id=self.last_event_id)
            except Exception as exc:
                self._fold_failed = True
                log.warning("worker %d: the event log cannot be folded (%s)", self.worker_id, exc)
                return None
        for key, columns in self._folded.iter_columns():
            if key == (self.worker_id, tier):
                return columns.to_dict()
        return {}

    def logged_tokens(self, wanted: Iterable[int]) -> dict[int, bytes]:
        """Token ids of ``wanted`` blocks, from the ``Stored`` events the log kept of them (a
        recovered block is named to routers with its tokens, as before the restart)."""
        wanted = set(wanted)
        if self.event_log is None or not wanted:
            return {}
        found: dict[int, bytes] = {}
        for event in self.event_log.read(worker_id=self.worker_id):
            if isinstance(event, Stored) and event.token_ids is not None:
                for (seq, local), ids in zip(event.blocks, event.token_ids, strict=True):
                    if seq in wanted:
                        packed = token_bytes(ids)
                        # a LoRA or salted block's tokens would name another block to routers
                        if names_plain_block(packed, local):
                            found[seq] = packed
        return found

    # -- lifecycle ---------------------------------------------------------------------------

    def flush(self) -> None:
        """Return once every event handed over so far is committed (and so with the views)."""
        if self.buffer is not None:
            self.buffer.flush()
        if self.event_log is not None:
            self.event_log.flush()

    def close(self, *, drain_timeout: float = 10.0) -> None:
        """Commit what waits, let the views take it, give the worker id up, and close the log
        when this worker opened it. Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        try:
            if self.buffer is not None:
                buffer, self.buffer = self.buffer, None  # events after this go nowhere
                buffer.close()
            if self.event_log is not None:
                self.event_log.flush()
        finally:
            if self.publisher is not None:
                self.publisher.stop(drain_timeout=drain_timeout)
            try:
                if self._own_log and self.event_log is not None:
                    self.event_log.close()
            finally:
                if self.zmq is not None:
                    self.zmq.close()
                if self._server is not None:
                    self._server.shutdown()
                    self._server.server_close()


def open_worker(
    settings: Settings,
    *,
    event_log: EventLog | None = None,
    log_events: bool = True,
    metrics: Metrics | None = None,
    redis: bool = True,
    zmq: bool = True,
) -> Worker:
    """Assemble worker ``settings.worker_id``: its log (``event_log`` when the caller has one,
    else the settings' own, unless ``log_events`` is False), the views other processes read
    (``redis_url``, ``zmq_endpoint``; ``redis`` or ``zmq`` False leaves one out, for an entry
    point whose views are its own business), and ``metrics``.

    Raises what stops a worker from starting, having closed what it opened: a bad setting, a
    worker id another live process holds (``WorkerIdTaken``), a socket it cannot bind.
    """
    if settings.switch_interval_s is not None:  # the process's, set only when asked for
        sys.setswitchinterval(settings.switch_interval_s)
    own_log = event_log is None and log_events
    if own_log:
        settings.prepare_log_folder()  # a first run in an empty folder makes kvledger-data/
        event_log = EventLog(settings.log_url, **settings.event_log_options())
    served = metrics is None and settings.metrics_port is not None
    if served:
        metrics = Metrics(bytes_per_block=settings.bytes_per_block)
    worker = Worker(settings, event_log=event_log, own_log=own_log, metrics=metrics)
    try:
        if event_log is not None:
            worker.buffer = AppendBuffer(event_log)
            if metrics is not None:
                metrics.watch_log(event_log)
        if served:
            assert metrics is not None and settings.metrics_port is not None
            worker._server, _thread = metrics.serve(settings.metrics_port, settings.metrics_addr)
            log.info(
                "worker %d serves kvbm_* metrics on http://%s:%d/metrics",
                settings.worker_id,
                settings.metrics_addr,
                worker._server.server_port,
            )
        if redis and settings.redis_url is not None:
            worker.publisher = _redis_publisher(settings, event_log)
            if metrics is not None:
                metrics.watch_view("redis", worker.publisher)
        if zmq and settings.zmq_endpoint is not None:
            worker.zmq = _zmq_publisher(settings, event_log, metrics)
            if metrics is not None:
                metrics.watch_view("zmq", worker.zmq)
    except BaseException:
        worker.close(drain_timeout=0)
        raise
    return worker


def _redis_publisher(settings: Settings, event_log: EventLog | None) -> RedisPublisher:
    """Publish to the shared registry at ``redis_url``, fed by the log's commits; the start
    claims the worker id and brings the registry in step with the log."""
    if event_log is None or settings.redis_url is None:
        raise ValueError("redis_url needs the event log: the publisher catches up from it")
    if "worker_id" not in settings.fields_set:
        log.warning(
            "redis_url is set but worker_id is not (KVLEDGER_WORKER_ID): this worker publishes "
            "as worker 0, and a second one that also forgets it is refused"
        )
    shared = SharedRegistry(
        connect(settings.redis_url),
        settings.redis_namespace,
        shards=settings.redis_shards,
        lease_ttl_s=settings.redis_lease_s,
        token_ids=settings.persist_token_ids,
    )
    return RedisPublisher(
        shared,
        settings.worker_id,
        log=event_log,
        dp_rank=settings.dp_rank,
        linger_s=settings.redis_linger_s,
    ).start()


def _zmq_publisher(
    settings: Settings, event_log: EventLog | None, metrics: Metrics | None
) -> ZmqPublisher | ZmqPublisherProcess:
    """Publish to vLLM-compatible routers on ``zmq_endpoint``, fed by the log's commits;
    replay reads the log."""
    if event_log is None:
        raise ValueError("zmq_endpoint needs the event log: replay and restarts read it")
    assert settings.zmq_endpoint is not None
    start: Callable[..., ZmqPublisher | ZmqPublisherProcess] = (
        ZmqPublisherProcess if settings.zmq_process else open_publisher
    )
    return start(
        settings.zmq_endpoint,
        log=event_log,
        worker_id=settings.worker_id,
        collector=metrics.collector if metrics is not None else None,
        **settings.zmq_options(),
    )
