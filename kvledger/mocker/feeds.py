"""How a simulated cluster's router learns what the workers hold: its feeds.

- ``memory``: each event reaches the router's ``RouterIndex`` when the engine step that
  emitted it ends (the engine's own sink), as in Dynamo's offline replay;
- ``zmq``: each worker publishes its events with the real ``ZmqPublisher`` (vLLM's protocol,
  on a loopback port of its own) and the router reads every worker's stream with a
  ``ZmqSubscriber``, taking what has arrived whenever it routes a request;
- ``redis``: each worker's ``RedisPublisher`` applies its events to a ``SharedRegistry`` (a
  namespace of the run's own, deleted at the end) and the router reads the registry's event
  stream with a ``StreamSubscriber``.

With a real feed the router never waits: it routes with whatever the transport has delivered
by then, so the index lags as the transport does. The simulation runs faster than the wall
clock unless paced (``simulate --speedup X``), so an unpaced run shows the most staleness a
transport can cause at that pace. ``delay_ms`` adds a simulated delay on top of any feed: an
event emitted at simulated time t reaches the index at t + delay (Dynamo's
``kv_event_lag_ms``).

``worker_sink`` is the one place a worker's event log and its feed are wired together: with a
log (a worker from ``kvledger.builder.open_worker``), the real publishers take what the log
commits, so their lag includes the log's commit lag, as a deployed worker's does.
"""

from __future__ import annotations

import math
import os
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from kvledger.events.types import AnyEvent
from kvledger.mocker.routing import FEEDS
from kvledger.registry.index import RouterIndex

if TYPE_CHECKING:
    from kvledger.events.log import EventLog
    from kvledger.events.shared.registry import SharedRegistry
    from kvledger.events.shared.zmq_publish import ZmqPublisher
    from kvledger.events.shared.zmq_subscribe import ZmqSubscriber

Sink = Callable[[AnyEvent], None]


def worker_sink(log_sink: Sink | None, feed_sink: Sink | None) -> Sink | None:
    """The sink a worker's emitter calls, given its log's sink (``Worker.sink``) and what its
    feed gave it.

    The one place that decides how a worker's events reach its log and its feed. A real
    publisher (ZMQ, Redis) given the worker's log takes its events from the log's commits
    (``EventLog.on_commit``: what other processes see is committed first), so then the log
    alone is the sink and ``feed_sink`` is None; without a log the publisher is the sink. The
    memory feed stands for Dynamo's in-process replay: it takes events as they are emitted.
    """
    sinks: list[Sink] = ([log_sink] if log_sink is not None else []) + (
        [feed_sink] if feed_sink is not None else []
    )
    if not sinks:
        return None
    if len(sinks) == 1:
        return sinks[0]

    def fan_out(event: AnyEvent) -> None:
        for sink in sinks:
            sink(event)

    return fan_out


class _Holding:
    """Events that reached the router's side and wait until they are due: each is applied
    once simulated time reaches when it happened plus ``delay_ms``. Kept per worker, in the
    order each worker emitted them (the index needs that order, and a worker's events are
    due in that order too), in batches that fall due together."""

    def __init__(self, index: RouterIndex, delay_ms: float, epoch: Callable[[], float]) -> None:
        self.index = index
        self.delay_ms = delay_ms
        self._epoch = epoch  # Unix seconds at simulated time 0
        self._held: dict[int, deque[tuple[float, list[AnyEvent]]]] = {}

    def take(self, event: AnyEvent) -> None:
        """An event that happened at its ``ts``."""
        if self.delay_ms:
            due = (event.ts - self._epoch()) * 1e3 + self.delay_ms
            self._queue(event.worker_id).append((due, [event]))
        else:
            self.index.apply(event)

    def take_at(self, worker_id: int, events: list[AnyEvent], at_ms: float) -> None:
        """``worker_id``'s events that came out at simulated ``at_ms`` (the list is kept)."""
        self._queue(worker_id).append((at_ms + self.delay_ms, events))

    def _queue(self, worker_id: int) -> deque[tuple[float, list[AnyEvent]]]:
        queue = self._held.get(worker_id)
        if queue is None:
            queue = self._held[worker_id] = deque()
        return queue

    def release(self, now_ms: float) -> None:
        """Apply what is due by ``now_ms``."""
        apply = self.index.apply
        for held in self._held.values():
            while held and held[0][0] <= now_ms:
                for event in held.popleft()[1]:
                    apply(event)


class MemoryFeed:
    """Events from the workers' emitters into the index, as each engine step ends (after
    ``delay_ms`` more).

    A step's transitions are decided when it starts, but the engine publishes them with the
    step's output, so a router hears of them when the step ends: Dynamo's offline replay
    delivers a step's KV events to its router then too.
    """

    name = "memory"

    def __init__(
        self, index: RouterIndex, *, delay_ms: float = 0.0, epoch: Callable[[], float]
    ) -> None:
        self.index = index
        self._holding = _Holding(index, delay_ms, epoch)
        self._in_step: dict[int, list[AnyEvent]] = {}

    def publisher(self, worker_id: int, log: EventLog | None) -> Sink:
        return self._in_step.setdefault(worker_id, []).append

    def step_ended(self, worker_id: int, now_ms: float) -> None:
        events = self._in_step[worker_id]
        if events:
            self._holding.take_at(worker_id, events.copy(), now_ms)
            events.clear()

    def catch_up(self, now_ms: float) -> None:
        self._holding.release(now_ms)

    def settle(self, last_ids: dict[int, int]) -> None:
        for worker_id in last_ids:
            self.step_ended(worker_id, 0.0)
        self._holding.release(math.inf)

    def close(self) -> None:
        pass


class ZmqFeed:
    """Each worker's real ``ZmqPublisher`` on a loopback port; the router's subscribers."""

    name = "zmq"

    def __init__(
        self,
        index: RouterIndex,
        *,
        block_size: int,
        delay_ms: float = 0.0,
        epoch: Callable[[], float],
        host: str = "127.0.0.1",
    ) -> None:
        self.index = index
        self.block_size = block_size
        self.host = host
        self._holding = _Holding(index, delay_ms, epoch)
        self.publishers: list[ZmqPublisher] = []
        self._subscribers: list[tuple[int, ZmqSubscriber, list[int]]] = []

    def publisher(self, worker_id: int, log: EventLog | None) -> Sink | None:
        from kvledger.events.shared.zmq_publish import ZmqPublisher, open_publisher
        from kvledger.events.shared.zmq_subscribe import ZmqSubscriber

        endpoint = f"tcp://{self.host}:*"
        if log is not None:
            pub = open_publisher(
                endpoint,
                log=log,
                worker_id=worker_id,
                block_size=self.block_size,
                replay_endpoint=endpoint,
            )
        else:  # no log to replay from: a ring that holds a whole run's burst
            pub = ZmqPublisher(
                endpoint,
                worker_id=worker_id,
                block_size=self.block_size,
                replay_endpoint=endpoint,
                ring_size=1_000_000,
            )
        self.publishers.append(pub)
        sub = ZmqSubscriber(pub.endpoint, replay_endpoint=pub.replay_endpoint)
        self._subscribers.append((worker_id, sub, [0]))
        return None if log is not None else pub  # with a log, its commits feed the publisher

    def step_ended(self, worker_id: int, now_ms: float) -> None:
        pass  # the publisher sent them as they came

    def catch_up(self, now_ms: float) -> None:
        from kvledger.events.vllm_events import to_events

        take = self._holding.take
        for worker_id, sub, next_id in self._subscribers:
            for _seq, batch in sub.batches(timeout=0):
                events = to_events(worker_id, next_id[0], batch)
                next_id[0] += len(events)
                for event in events:
                    take(event)
        self._holding.release(now_ms)

    def settle(self, last_ids: dict[int, int]) -> None:
        _settle(self, self.index, last_ids)

    def close(self) -> None:
        for pub in self.publishers:
            pub.close()
        for _worker, sub, _next in self._subscribers:
            sub.close()


class RedisFeed:
    """Each worker's ``RedisPublisher`` into a namespace of this run's own; the router reads
    the registry's event stream. The namespace is deleted when the feed closes."""

    name = "redis"

    def __init__(
        self,
        index: RouterIndex,
        *,
        redis_url: str,
        delay_ms: float = 0.0,
        epoch: Callable[[], float],
        namespace: str | None = None,
    ) -> None:
        from kvledger.events.shared.client import connect
        from kvledger.events.shared.registry import SharedRegistry
        from kvledger.events.shared.subscribe import StreamSubscriber

        self.index = index
        self._holding = _Holding(index, delay_ms, epoch)
        # (os.urandom, not uuid: importing uuid took 1.6 ms of every cluster run's start-up)
        self.namespace = namespace or f"kvledger-simulate-{os.urandom(6).hex()}"
        self.registry: SharedRegistry = SharedRegistry(connect(redis_url), self.namespace)
        self.publishers: list[Any] = []
        try:
            self._subscriber = StreamSubscriber(
                self.registry,
                "router",
                "router-0",
                on_event=self._holding.take,
                on_purge=index.remove_worker,
                on_baseline=index.apply_baseline,
            )
        except BaseException:
            self.registry.delete_namespace()  # nothing of this run stays behind in Redis
            raise

    def publisher(self, worker_id: int, log: EventLog | None) -> Sink | None:
        from kvledger.events.shared.publish import RedisPublisher

        pub = RedisPublisher(self.registry, worker_id, log=log).start()
        self.publishers.append(pub)
        return None if log is not None else pub  # with a log, its commits feed the publisher

    def step_ended(self, worker_id: int, now_ms: float) -> None:
        pass  # the publisher sends them as they come

    def catch_up(self, now_ms: float) -> None:
        while self._subscriber.poll(count=10_000) >= 10_000:
            pass
        self._holding.release(now_ms)

    def settle(self, last_ids: dict[int, int]) -> None:
        _settle(self, self.index, last_ids)

    def close(self) -> None:
        try:
            for pub in self.publishers:
                pub.stop(drain_timeout=5.0)
        finally:
            self.registry.delete_namespace()


def _settle(
    feed: ZmqFeed | RedisFeed, index: RouterIndex, last_ids: dict[int, int], timeout: float = 30.0
) -> None:
    """Read ``feed`` until ``index`` has every worker's events up to ``last_ids``."""
    deadline = time.monotonic() + timeout
    applied = index.last_event_id
    while any(applied.get(w, -1) < last for w, last in last_ids.items()):
        if time.monotonic() > deadline:
            behind = {w: last - applied.get(w, -1) for w, last in last_ids.items()}
            raise TimeoutError(
                f"the {feed.name} feed did not deliver the workers' last events in "
                f"{timeout:g} s (events missing per worker: {behind})"
            )
        feed.catch_up(math.inf)
        time.sleep(0.005)
    feed.catch_up(math.inf)


def open_feed(
    name: str,
    index: RouterIndex,
    *,
    block_size: int,
    delay_ms: float,
    epoch: Callable[[], float],
    redis_url: str | None,
) -> MemoryFeed | ZmqFeed | RedisFeed:
    """The feed called ``name`` (one of ``FEEDS``) into ``index``."""
    if delay_ms < 0:
        raise ValueError(f"the feed delay must be >= 0 ms, got {delay_ms}")
    if name == "memory":
        return MemoryFeed(index, delay_ms=delay_ms, epoch=epoch)
    if name == "zmq":
        return ZmqFeed(index, block_size=block_size, delay_ms=delay_ms, epoch=epoch)
    if name == "redis":
        if redis_url is None:
            raise ValueError(
                "--router-feed redis needs a Redis server: give --redis-url or set "
                "KVLEDGER_REDIS_URL (e.g. redis://127.0.0.1:6379/0)"
            )
        return RedisFeed(index, redis_url=redis_url, delay_ms=delay_ms, epoch=epoch)
    raise ValueError(f"router feed must be one of {', '.join(FEEDS)}, got {name!r}")
