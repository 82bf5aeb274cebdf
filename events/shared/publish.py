"""Publishers: where a worker's events go besides its durable log.

A publisher is an event sink the engine calls on its hot path, so it must never block: the Redis
publisher only queues the event and a background thread applies batches to the shared registry.
The durable log is the source of truth. When the queue overflows, Redis is unreachable, or Redis
lost its data (restart, flush), the publisher does not try to remember what it missed: the
registry tells it the last event id it applied for this worker, and the thread reads everything
after that from the worker's own log.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from typing import Protocol

import redis

from kvledger.events.shared.client import REFUSALS
from kvledger.events.shared.registry import SharedRegistry
from kvledger.events.types import AnyEvent

log = logging.getLogger(__name__)

OUTAGES = (
    redis.ConnectionError,
    redis.TimeoutError,
    redis.BusyLoadingError,
    redis.exceptions.ClusterError,  # a cluster client out of retries (a slot on the move)
    redis.exceptions.ClusterDownError,  # a fail-over in progress
    redis.exceptions.TryAgainError,
    redis.exceptions.SlotNotCoveredError,
)
"""Errors that mean Redis is (for now) out of reach: the publisher waits and catches up."""


class LogReader(Protocol):
    """What catch-up needs of the durable log (``kvledger.events.log.EventLog`` has it)."""

    def read(
        self,
        *,
        worker_id: int | None = None,
        after_event_id: int = -1,
        until_event_id: int | None = None,
    ) -> Iterator[AnyEvent]: ...


class FanOut:
    """A fan-out sink: hands every event to each callback, in order, synchronously.

    For consumers in the same process (a router index, a test recorder); a callback that raises
    stops the engine, on purpose, rather than letting a consumer silently miss an event.
    """

    def __init__(self, *callbacks: Callable[[AnyEvent], object]) -> None:
        self.callbacks = list(callbacks)

    def __call__(self, event: AnyEvent) -> None:
        for callback in self.callbacks:
            callback(event)


class RedisPublisher:
    """Applies one worker's events to the shared registry from a background thread.

    ``log`` must hold every event this publisher is given (append to the log first); without it
    a gap cannot be filled and the publisher stops with ``error`` set.
    """

    def __init__(
        self,
        registry: SharedRegistry,
        worker_id: int,
        *,
        log: LogReader | None,
        batch_size: int = 512,
        max_pending: int = 100_000,
        heartbeat_s: float | None = None,
        retry_s: float = 0.2,
        linger_s: float = 0.0,
    ) -> None:
        if batch_size < 1 or max_pending < batch_size:
            raise ValueError(
                f"need 1 <= batch_size <= max_pending, got {batch_size} and {max_pending}"
            )
        if not 0 <= linger_s < 60:
            raise ValueError(f"linger_s must be 0 or more and under 60 s, got {linger_s}")
        self.registry = registry
        self.worker_id = worker_id
        self.log = log
        self.batch_size = batch_size
        self.max_pending = max_pending
        self.heartbeat_s = registry.lease_ttl_ms / 3000 if heartbeat_s is None else heartbeat_s
        self.retry_s = retry_s
        self.linger_s = linger_s
        """How long a batch may wait to fill up to ``batch_size`` before it is sent (0: at
        once). Every batch costs each shard a script call besides its per-block work, so a
        worker publishing a few hundred events a second mostly pays per call unless its
        events wait for each other; a few tens of ms turn batches of 1-2 events into dozens."""
        self._oldest_pending_at = 0.0
        self._pending: deque[AnyEvent] = deque()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.last_seen_id = -1  # newest event handed to this publisher
        self.applied_id = -1  # newest event the registry confirmed for this worker
        self.dropped = 0  # events left to catch-up because the queue was full
        self.caught_up = 0  # events read back from the log
        self.outages = 0  # Redis errors survived
        self.error: BaseException | None = None

    # -- engine side ---------------------------------------------------------------------

    def __call__(self, event: AnyEvent) -> None:
        """Queue an event; never blocks, never raises for Redis trouble."""
        if event.worker_id != self.worker_id:
            raise ValueError(
                f"publisher of worker {self.worker_id} got an event of worker {event.worker_id}"
            )
        self.last_seen_id = event.event_id
        if not self._pending:
            self._oldest_pending_at = time.monotonic()
        if len(self._pending) < self.max_pending:
            self._pending.append(event)
        else:
            self.dropped += 1  # the log has it; catch-up will read it back
        self._wake.set()

    # -- lifecycle -----------------------------------------------------------------------

    def start(self) -> RedisPublisher:
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._run, name=f"kvledger-publish-{self.worker_id}", daemon=True
            )
            self._thread.start()
        return self

    def wait_applied(self, timeout: float) -> bool:
        """Wait until every event handed over so far is applied; False on timeout."""
        deadline = time.monotonic() + timeout
        while self.applied_id < self.last_seen_id:
            if self.error is not None or time.monotonic() > deadline:
                return False
            self._wake.set()
            time.sleep(0.01)
        return True

    def stop(self, *, drain_timeout: float = 10.0) -> bool:
        """Drain (up to ``drain_timeout``) and stop the thread; True when fully drained."""
        drained = self.wait_applied(drain_timeout)
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        return drained

    # -- background thread ---------------------------------------------------------------

    def _run(self) -> None:
        next_beat = 0.0
        down_since: float | None = None  # an outage is reported when it starts and ends, once
        while not self._stop.is_set():
            try:
                now = time.monotonic()
                if now >= next_beat:
                    self.registry.heartbeat(self.worker_id)
                    self.registry.purge_expired()
                    next_beat = now + self.heartbeat_s
                    if self.registry.applied_event_id(self.worker_id) < self.applied_id:
                        # Redis lost what it had confirmed (a fail-over to a replica that had
                        # not received it yet, a restart): send it again from the log
                        self._catch_up(self.applied_id)
                if down_since is not None:
                    log.warning(
                        "worker %d: Redis reachable again after %.1f s; catching up from the log",
                        self.worker_id,
                        now - down_since,
                    )
                    down_since = None
                if not self._publish_some():
                    self._wake.wait(min(self.heartbeat_s, 0.05, self.linger_s or 0.05))
                    self._wake.clear()
            except REFUSALS as exc:  # a wrong password or a missing ACL permission
                self.error = exc
                log.error(
                    "worker %d: Redis refused the publisher (%s); it stopped, and the events "
                    "stay in the log (docs/security.md lists what a worker's user needs)",
                    self.worker_id,
                    exc,
                )
                return
            except OUTAGES as exc:
                self.outages += 1
                if down_since is None:
                    down_since = time.monotonic()
                    log.warning(
                        "worker %d: Redis unreachable (%s); retrying every %g s, events wait "
                        "in the log",
                        self.worker_id,
                        exc,
                        self.retry_s,
                    )
                self._stop.wait(self.retry_s)
                next_beat = 0.0
            except Exception as exc:  # a bug or a broken log: stop loudly, keep the engine going
                self.error = exc
                log.exception("worker %d: publisher stopped", self.worker_id)
                return

    def _publish_some(self) -> bool:
        """Send what is due; False when there was nothing to do."""
        pending = self._pending
        while pending and pending[0].event_id <= self.applied_id:
            pending.popleft()
        if not pending:
            if self.applied_id < self.last_seen_id:
                # everything queued went out but some events were dropped: read them back
                self._catch_up(self.last_seen_id)
                return True
            return False
        if (
            len(pending) < self.batch_size
            and time.monotonic() - self._oldest_pending_at < self.linger_s
        ):
            return False  # let the batch fill up a little longer
        batch = [pending[i] for i in range(min(self.batch_size, len(pending)))]
        self._oldest_pending_at = 0.0  # what is left waited already: next round sends it
        result = self.registry.apply(self.worker_id, batch)
        self.applied_id = result.last_event_id
        if result.gap_at is not None:
            self._catch_up(result.gap_at - 1)
        return True

    def _catch_up(self, until_event_id: int) -> None:
        """Apply this worker's events ``applied_id+1 .. until_event_id`` from the log."""
        if self.log is None:
            raise RuntimeError(
                f"worker {self.worker_id}: events {self.applied_id + 1}..{until_event_id} are "
                "missing from the shared registry and there is no log to read them from"
            )
        # Ask the registry, not our memory: after a Redis restart it may know less than we do.
        self.applied_id = self.registry.applied_event_id(self.worker_id)
        chunk: list[AnyEvent] = []
        for event in self.log.read(
            worker_id=self.worker_id,
            after_event_id=self.applied_id,
            until_event_id=until_event_id,
        ):
            chunk.append(event)
            if len(chunk) >= self.batch_size:
                self._apply_read_back(chunk)
                chunk = []
        if chunk:
            self._apply_read_back(chunk)
        if self.applied_id < until_event_id:
            time.sleep(0.01)  # not committed to the log yet: the writer is behind; retry soon

    def _apply_read_back(self, chunk: Sequence[AnyEvent]) -> None:
        result = self.registry.apply(self.worker_id, chunk)
        self.applied_id = result.last_event_id
        self.caught_up += result.applied
        if result.gap_at is not None:
            raise RuntimeError(
                f"worker {self.worker_id}: the log skips from event {result.last_event_id} "
                f"to {result.gap_at}; it cannot rebuild the shared registry"
            )
