"""Publishers: where a worker's events go besides its durable log.

A view outside the process is a fold of the committed log: the Redis publisher takes events
from the log's writer once they are committed (``EventLog.on_commit``), never from the engine,
so a crash cannot un-say what the shared registry already holds. Publishing never blocks the
engine: the writer only queues the committed batch, and a background thread applies batches
to the shared registry. When the queue overflows, Redis is unreachable, or Redis lost its data
(restart, flush), the publisher does not try to remember what it missed: the registry tells it
the last event id it applied for this worker, and the thread reads everything after that from
the worker's own log.

At start the publisher claims the worker id (one live owner per id, ``claims``) and checks the
registry against the log: where the registry is ahead of the log, or holds events the log does
not (a log restored from a backup, or deleted), or knows nothing of a long log, the worker's
entries are replaced by the log's fold (``SharedRegistry.reset``); otherwise what the registry
lacks is read back from the log.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

import redis

from kvledger.events import codec
from kvledger.events.log import Committed
from kvledger.events.log.replay import replay
from kvledger.events.shared.claims import ClaimLost, Holder, WorkerIdTaken
from kvledger.events.shared.client import REFUSALS
from kvledger.events.shared.registry import SharedRegistry, record_tip
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

BASELINE_AFTER = 100_000
"""A registry that knows nothing of a worker whose log holds more events than this gets the
log's fold (one call per shard) rather than every event read back (about 40k a second)."""


MAX_BATCH = 8192
"""The most events one apply takes from the queue (``batch_size`` is what a lingering batch
waits to fill)."""


class PublisherLog(Protocol):
    """What a publisher needs of the worker's durable log (``EventLog`` has it): its commits,
    and reads for catch-up and for the fold a reset writes."""

    def on_commit(
        self, sink: Callable[[Sequence[Committed]], object], *, worker_id: int | None = None
    ) -> None: ...

    def off_commit(self, sink: Callable[[Sequence[Committed]], object]) -> None: ...

    def last_event_id(self, worker_id: int) -> int: ...

    def flush(self) -> None: ...

    def read(
        self,
        *,
        worker_id: int | None = None,
        after_event_id: int = -1,
        until_event_id: int | None = None,
    ) -> Iterator[AnyEvent]: ...


@dataclass(frozen=True)
class Reconciliation:
    """What a publisher found when it compared the shared registry with its log at start
    (``RedisPublisher.reconciled``)."""

    log_last: int
    """The log's last event of the worker (-1: none)."""
    applied: int
    """The furthest any shard had applied for the worker (-1: none)."""
    action: str
    """"in step", "catch up" (the registry is behind: read back from the log), or "reset"
    (the registry's entries were replaced by the log's fold)."""
    reason: str = ""
    blocks: int = 0
    """Blocks written by a reset."""

    def line(self, worker_id: int) -> str:
        """One line for an operator."""
        if self.action == "reset":
            return (
                f"worker {worker_id}: the shared registry {self.reason}; replaced its entries "
                f"with the log's fold at event {self.log_last} ({self.blocks} blocks)"
            )
        if self.action == "catch up":
            return (
                f"worker {worker_id}: the shared registry has events up to {self.applied}, "
                f"the log up to {self.log_last}; sending the rest from the log"
            )
        return f"worker {worker_id}: the shared registry is in step with the log"


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
    """Applies one worker's committed events to the shared registry from a background thread.

    With ``log`` (the worker's durable log; what every kvledger entry point gives it), the
    publisher is fed by the log's commits once started and must not be called as a sink.
    Without one, it is a sink called with each event, for a worker with no durable log, and a
    gap cannot be filled: the publisher then stops with ``error`` set.

    ``claim`` (default) claims the worker id at start (``WorkerIdTaken`` names the holder when
    a live process has it) and writes with its fencing token; once a newer claim fences it off,
    the publisher stops with ``error`` set to ``ClaimLost`` and says so in one line.
    """

    def __init__(
        self,
        registry: SharedRegistry,
        worker_id: int,
        *,
        log: PublisherLog | None,
        dp_rank: int = 0,
        batch_size: int = 512,
        max_pending: int = 100_000,
        heartbeat_s: float | None = None,
        retry_s: float = 0.2,
        linger_s: float = 0.0,
        claim: bool = True,
        baseline_after: int = BASELINE_AFTER,
    ) -> None:
        if batch_size < 1 or max_pending < batch_size:
            raise ValueError(
                f"need 1 <= batch_size <= max_pending, got {batch_size} and {max_pending}"
            )
        if not 0 <= linger_s < 60:
            raise ValueError(f"linger_s must be 0 or more and under 60 s, got {linger_s}")
        self.registry = registry
        self.worker_id = worker_id
        self.dp_rank = dp_rank
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
        self.claims = claim
        self.baseline_after = baseline_after
        self._oldest_pending_at = 0.0
        self._pending: deque[Committed] = deque()  # (event, its log record)
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._holder = Holder.this_process(dp_rank)
        self.token = 0
        """The fencing token of this publisher's claim (0: unclaimed)."""
        self.last_seen_id = -1  # newest event handed to this publisher
        self.applied_id = -1  # newest event the registry confirmed for this worker
        self.dropped = 0  # events left to catch-up because the queue was full
        self.caught_up = 0  # events read back from the log
        self.outages = 0  # Redis errors survived
        self.resets = 0  # times the registry's entries were replaced by the log's fold
        self.reconciled: Reconciliation | None = None
        """What the start found (None before ``start``, or without a log)."""
        self.error: BaseException | None = None

    # -- engine side ---------------------------------------------------------------------

    def __call__(self, event: AnyEvent) -> None:
        """Queue an event (a publisher without a log); never blocks, never raises for Redis
        trouble."""
        if self.log is not None:
            raise TypeError(
                "this publisher is fed by its log's commits (what other processes see must be "
                "committed first); append the event to the log instead"
            )
        if event.worker_id != self.worker_id:
            raise ValueError(
                f"publisher of worker {self.worker_id} got an event of worker {event.worker_id}"
            )
        self._queue(((event, codec.encode(event)),))

    def _committed(self, batch: Sequence[Committed]) -> None:
        """The log's writer, after a commit: queue the worker's newly committed events, each
        with the record the log stored (what the stream carries)."""
        self._queue(batch)

    def _queue(self, batch: Sequence[Committed]) -> None:
        pending = self._pending
        if not pending:
            self._oldest_pending_at = time.monotonic()
        room = self.max_pending - len(pending)
        if room >= len(batch):
            pending.extend(batch)
        else:
            pending.extend(batch[: max(room, 0)])
            self.dropped += len(batch) - max(room, 0)  # the log has them: caught up later
        self.last_seen_id = batch[-1][0].event_id
        self._wake.set()

    # -- lifecycle -----------------------------------------------------------------------

    def start(self) -> RedisPublisher:
        """Claim the worker id, bring the registry in step with the log, then publish what
        the log commits from now on. Raises ``WorkerIdTaken`` (and publishes nothing) when
        another live process holds the id. With Redis out of reach both wait for the thread,
        which retries; a claim refused then stops it (``error``)."""
        if self._thread is not None:
            return self
        if self.log is not None:
            self.log.on_commit(self._committed, worker_id=self.worker_id)
            self.last_seen_id = self.log.last_event_id(self.worker_id)
        with contextlib.suppress(*OUTAGES):  # else the thread does both once Redis answers
            self._claim()
            if self.log is not None:
                self.reconciled = self.reconcile()
        self._thread = threading.Thread(
            target=self._run, name=f"kvledger-publish-{self.worker_id}", daemon=True
        )
        self._thread.start()
        return self

    def _claim(self) -> None:
        """Claim the worker id (once), unless this publisher writes unclaimed."""
        if self.claims and not self.token:
            self.token = self.registry.claim(self.worker_id, self._holder)

    def reconcile(self) -> Reconciliation:
        """Compare what every shard applied for this worker with the log, and replace the
        worker's entries by the log's fold where the registry is ahead of the log, holds
        an event the log does not, or knows nothing of a long log. Returns what it did;
        a registry behind the log is left to catch-up."""
        assert self.log is not None
        self.log.flush()
        last = self.log.last_event_id(self.worker_id)
        tips = self.registry.tips(self.worker_id)
        furthest = max(applied for applied, _ in tips)
        behind = min(applied for applied, _ in tips)
        reason = ""
        if furthest > last:
            reason = f"had applied events up to {furthest}, beyond the log's last ({last})"
        else:
            for applied, tip in set(tips):
                if applied >= 0 and tip is not None and tip != self._log_tip(applied):
                    reason = f"holds an event {applied} that differs from the log's"
                    break
        if not reason and behind < 0 and last >= self.baseline_after:
            reason = f"knew nothing of this worker, whose log holds {last + 1} events"
        if reason:
            blocks = self._reset(last)
            self.applied_id = last
            found = Reconciliation(last, furthest, "reset", reason, blocks)
            log.warning("%s", found.line(self.worker_id))
            return found
        self.applied_id = behind
        if behind < last:
            return Reconciliation(last, furthest, "catch up")
        return Reconciliation(last, furthest, "in step")

    def _log_tip(self, event_id: int) -> int | None:
        """The tip the registry keeps for ``event_id`` as the log has it (None: not there)."""
        event = self._logged(event_id)
        return None if event is None else record_tip(codec.encode(event))

    def _logged(self, event_id: int) -> AnyEvent | None:
        assert self.log is not None
        for event in self.log.read(
            worker_id=self.worker_id, after_event_id=event_id - 1, until_event_id=event_id
        ):
            return event
        return None

    def _reset(self, last: int) -> int:
        """Replace the worker's entries with the log's fold at ``last``."""
        assert self.log is not None
        state = replay(self.log, until_event_id=last)  # type: ignore[arg-type]
        held = {
            tier: columns
            for (worker, tier), columns in state.iter_columns()
            if worker == self.worker_id
        }
        newest = self._logged(last) if last >= 0 else None
        blocks = self.registry.reset(
            self.worker_id,
            last_event_id=last,
            tip=0 if newest is None else record_tip(codec.encode(newest)),
            held=held,
            # the rank the worker's events carry: routers key blocks by (worker, dp rank)
            dp_rank=self.dp_rank if newest is None else newest.dp_rank,
            ts=time.time(),
            token=self.token,
        )
        self.resets += 1
        return blocks

    @property
    def behind(self) -> int:
        """Events committed to the worker's log that the shared registry has not applied yet
        (``kvbm_view_behind_events{view="redis"}``)."""
        return max(0, self.last_seen_id - self.applied_id)

    def wait_applied(self, timeout: float) -> bool:
        """Wait until every event so far is applied (with a log: every event appended to it
        so far, after flushing it); False on timeout."""
        deadline = time.monotonic() + timeout
        if self.log is not None and self._thread is not None:
            try:
                self.log.flush()
            except Exception as exc:  # a failed log: what it committed is all there is
                log.warning("worker %d: the event log failed: %s", self.worker_id, exc)
        while self.applied_id < self.last_seen_id:
            if self.error is not None or time.monotonic() > deadline:
                return False
            self._wake.set()
            time.sleep(0.01)
        return True

    def stop(self, *, drain_timeout: float = 10.0) -> bool:
        """Drain (up to ``drain_timeout``), stop the thread and give the worker id up; True
        when fully drained."""
        drained = self.wait_applied(drain_timeout)
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self.log is not None:
            self.log.off_commit(self._committed)
        if self.token and not isinstance(self.error, ClaimLost):
            try:
                self.registry.unclaim(self.worker_id, self.token)
            except (*OUTAGES, redis.RedisError) as exc:
                log.warning("worker %d: could not give its id up: %s", self.worker_id, exc)
        return drained

    # -- background thread ---------------------------------------------------------------

    def _run(self) -> None:
        next_beat = 0.0
        down_since: float | None = None  # an outage is reported when it starts and ends, once
        while not self._stop.is_set():
            try:
                now = time.monotonic()
                if now >= next_beat:
                    self._claim()  # when Redis was out of reach at start
                    if not self.registry.heartbeat(self.worker_id, self.token, self._holder):
                        raise ClaimLost(
                            f"worker {self.worker_id}: another process claimed this worker id"
                        )
                    self.registry.purge_expired()
                    next_beat = now + self.heartbeat_s
                    if self.log is not None and (
                        self.reconciled is None
                        or self.registry.applied_event_id(self.worker_id) < self.applied_id
                    ):
                        # not checked yet (Redis was down at start), or Redis lost what it had
                        # confirmed (a fail-over to a replica that had not received it, a
                        # restart): bring it in step with the log again
                        self.reconciled = self.reconcile()
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
            except (ClaimLost, WorkerIdTaken) as exc:
                self.error = exc
                log.error("%s; this process stopped publishing", exc)
                return
            except Exception as exc:  # a bug or a broken log: stop loudly, keep the engine going
                self.error = exc
                log.exception("worker %d: publisher stopped", self.worker_id)
                return

    def _publish_some(self) -> bool:
        """Send what is due; False when there was nothing to do."""
        pending = self._pending
        while pending and pending[0][0].event_id <= self.applied_id:
            pending.popleft()
        if not pending:
            if self.applied_id < self.last_seen_id:
                # everything queued went out but some events were dropped or came before the
                # publisher started: read them back
                self._catch_up(self.last_seen_id)
                return True
            return False
        if (
            len(pending) < self.batch_size
            and time.monotonic() - self._oldest_pending_at < self.linger_s
        ):
            return False  # let the batch fill up a little longer
        # All that waits, up to MAX_BATCH: one apply is several script calls in one pipeline,
        # and each round trip costs this thread a wait for the interpreter while the engine's
        # thread runs, so a publisher that fell behind catches up in fewer, larger ones.
        batch = [pending[i] for i in range(min(MAX_BATCH, len(pending)))]
        self._oldest_pending_at = 0.0  # what is left waited already: next round sends it
        result = self.registry.apply(
            self.worker_id,
            [event for event, _ in batch],
            records=[record for _, record in batch],
            token=self.token,
        )
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
        result = self.registry.apply(self.worker_id, chunk, token=self.token)
        self.applied_id = result.last_event_id
        self.caught_up += result.applied
        if result.gap_at is not None:
            raise RuntimeError(
                f"worker {self.worker_id}: the log skips from event {result.last_event_id} "
                f"to {result.gap_at}; it cannot rebuild the shared registry"
            )
