"""Batching in front of an ``EventLog`` for a producer that makes a few events at a time.

An engine's scheduler makes two or three events a step. Appending them step by step costs the
scheduler an encode per event and a locked hand-over per call, and both cost far less in bulk:
encoding one event between two steps' work runs from cold caches, at two to three times its
cost in a batch (on the vLLM offload bench, bench/offload_bench.py, the log took about twice
the scheduler's time when handed each step's events).

The price is a bounded delay. An event reaches the log at most ``max_hold`` seconds after it
was handed here (the log's own bound, ``core.Backlog``, applies from there), also when the
producer goes quiet: the log's writer thread, which wakes for its commits anyway, hands over
whatever has waited that long. So a crash loses at most what was handed here within
``max_hold`` plus what the log itself may lose. A second thread of our own would cost the
producer as much as the batching saves: every wake of a thread that needs the GIL forces the
producer to give it up.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from time import monotonic

from kvledger.events.log.core import EventLogError
from kvledger.events.log.event_log import EventLog
from kvledger.events.log.rows import Row, compiled_kinds
from kvledger.events.types import LogRecord, lookup_stream

try:
    from kvledger.events.log._gather import Gather
except ImportError:  # not built: the buffer's Python code serves
    COMPILED_GATHER = False
else:
    COMPILED_GATHER = os.environ.get("KVLEDGER_PYTHON_BUFFER", "") in ("", "0")
"""Whether buffers hand events over through ``_gather.Gather`` (events/log/_gather.c): built,
and ``KVLEDGER_PYTHON_BUFFER=1`` not in the environment (to measure it, or to rule it out)."""

BATCH_SIZE = 256
"""Events gathered before they go to the log: enough that the hand-over's locks and the log's
id checks are paid once for many events (and, without the compiled queue, that encoding them
runs warm), few enough that a batch fits one multi-row INSERT of the Python writer
(``rows.STATEMENT_ROWS``)."""


class AppendBuffer:
    """Gathers events for ``log`` and appends them in order, ``batch_size`` at a time or once
    the oldest has waited ``max_hold`` seconds (default: a quarter of the log's ``max_delay``,
    the time its writer lets a row wait before it starts a commit).

    ``add`` is the call for one event, an emitter's sink. Where ``_gather`` is built it is the
    compiled queue itself: the event joins the queue with the interpreter held, an atomic step
    for every other thread, so no lock is taken until a batch is full or starts (``_gather.c``
    says why). ``extend`` goes the same way.

    ``extend`` may be called from any thread; events keep the order of the calls. An append
    that fails raises from the call that made it, or, when the log's writer made it, from the
    next call, and the message says how many events are not in the log: those the log refused
    (the others of the batch went in), or the whole batch when the log takes nothing more. A
    call that raises the writer's error takes none of its own events. ``close`` (or the log's
    own ``close``, also at interpreter exit) hands over what waits.
    """

    def __init__(
        self, log: EventLog, *, batch_size: int = BATCH_SIZE, max_hold: float | None = None
    ) -> None:
        hold = log.max_delay / 4 if max_hold is None else max_hold
        if batch_size < 1:
            raise ValueError(f"batch_size must be at least 1, got {batch_size}")
        if not hold > 0:
            raise ValueError(f"max_hold must be a positive number of seconds, got {hold}")
        self.log = log
        self.batch_size = batch_size
        self.max_hold = hold
        self._events: list[LogRecord] = []  # the Python queue (unused with a Gather)
        self._since = 0.0  # when its oldest waiting event came (monotonic)
        self._gather: Gather | None = None
        self.add: Callable[[LogRecord], None] = self._add_one
        if COMPILED_GATHER:
            self._gather = Gather(
                compiled_kinds(log.token_ids),
                batch_size,
                hold,
                self._hand_over,
                self._started,
                self._extend_locked,
            )
            self.add = self._gather
        self._lock = threading.Lock()
        self._closed = False
        # a failed append the writer made, and the events it cost: raised once, at the next call
        self._error: BaseException | None = None
        self._lost = 0
        self._failed = 0  # events the last failed append left out of the log
        log._attach(self)

    @property
    def waiting(self) -> int:
        """Events handed here and not yet appended to the log."""
        return len(self._events) if self._gather is None else len(self._gather)

    @property
    def due(self) -> float | None:
        """When the oldest waiting event must be in the log (``time.monotonic()``); None when
        nothing waits. The log's writer reads it to know when to wake."""
        gather = self._gather
        if gather is None:
            return self._since + self.max_hold if self._events else None
        return gather.since + self.max_hold if len(gather) else None

    def extend(self, events: Sequence[LogRecord]) -> None:
        """Queue ``events`` after every earlier one; appends the lot when the batch is full or
        the oldest has waited ``max_hold``."""
        if self._gather is not None:
            self._gather.extend(events)
        else:
            self._extend_locked(events)

    def _add_one(self, event: LogRecord) -> None:
        """``add`` without the compiled queue."""
        self._extend_locked((event,))

    def _extend_locked(self, events: Sequence[LogRecord]) -> None:
        """``extend`` under the lock, with its checks: the whole path without the compiled
        queue, and the compiled queue's while it is blocked (the buffer is closed, or a failed
        hand-over is to be raised): the checks raise, or pass and unblock it."""
        if not events:
            return
        gather = self._gather
        with self._lock:
            self._check_open()
            if gather is not None:
                gather.blocked = False
            else:
                waiting = self._events
                now = monotonic()
                starts = not waiting
                if starts:
                    self._since = now
                waiting.extend(events)
                if len(waiting) >= self.batch_size or now - self._since >= self.max_hold:
                    self._append(wait=True)
                elif starts:
                    self._announce(now)
                return
        gather.extend(events)  # unblocked: the compiled queue's own path (it takes the lock)

    def _hand_over(self) -> None:
        """The compiled queue's batch is full or its oldest event is due: append what waits."""
        with self._lock:
            if self._closed:  # closed while the producer's call was on its way here
                self._check_open()
            if self.waiting:
                self._append(wait=True)

    def _started(self, now: float) -> None:
        """The compiled queue's first event of a batch came at ``now``."""
        with self._lock:
            self._announce(now)

    def _announce(self, now: float) -> None:
        """Tell the log when the batch that starts at ``now`` is due (lock held)."""
        try:
            self.log._feed_due(now + self.max_hold)
        except BaseException:  # the log is closed or broken: it takes none of them
            self._take()
            raise

    def flush(self) -> None:
        """Append what waits now (``log.flush()`` then waits for its commit)."""
        with self._lock:
            self._check_open()
            if self.waiting:
                self._append(wait=True)

    def close(self) -> None:
        """Append what waits and detach from the log, which stays open. Safe to call twice."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._block()
            try:
                if self.waiting:
                    self._append(wait=True)
            finally:
                self.log._detach(self)
            self._raise_writer_error()

    def __enter__(self) -> AppendBuffer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def hand_over_from_writer(self) -> None:
        """The log's writer, at a wake-up: append what waits, early or due (an event may go
        before its ``max_hold``, never after). Given up after a millisecond while a producer
        holds the buffer: it is appending itself, or waiting for room, which only the writer
        makes (the writer comes back once it has committed)."""
        if not self.waiting or not self._lock.acquire(timeout=0.001):
            return  # (an unlocked look: events that come now are the producer's to announce)
        try:
            if self.waiting and not self._closed:
                try:
                    self._append(wait=False)
                except Exception as exc:  # for the producer's next call
                    self._error = self._error or exc
                    self._lost += self._failed
                    self._block()
        finally:
            self._lock.release()

    def keep_events(self, keep: bool) -> None:
        """The log has commit sinks (``keep``) or no more: the compiled queue keeps each event
        beside its row only while it has. (The Python queue keeps the events themselves.)"""
        if self._gather is not None:
            self._gather.keep(keep)

    def _block(self) -> None:
        """Send the compiled queue's calls through ``_extend_locked``, whose checks raise what
        is to be raised (lock held)."""
        if self._gather is not None:
            self._gather.blocked = True

    def _take(self) -> tuple[Sequence[Row | LogRecord], list[LogRecord]]:
        """Every waiting item (a row, or an event still to encode), in order, and the events
        of the newest items (all of them in the Python queue, whose items they are); none
        waits after (lock held)."""
        if self._gather is not None:
            return self._gather.take()
        batch, self._events = self._events, []
        return batch, batch

    def _append(self, *, wait: bool) -> None:
        """Hand every waiting event to the log (lock held).

        The log refuses a batch whole when one event in it is bad (it cannot be encoded, or its
        id repeats one or leaves a gap); the events of the other calls batched with it are not
        to pay for that, so the batch is then appended event by event and the error names what
        the log refused. A log that is closed or whose writer failed takes nothing."""
        items, events = self._take()
        try:
            self.log._append_items(items, events, wait=wait)
        except ValueError:
            self._append_one_by_one(items, events, wait)
        except BaseException:
            self._failed = len(items)
            raise

    def _append_one_by_one(
        self, items: Sequence[Row | LogRecord], events: list[LogRecord], wait: bool
    ) -> None:
        refused: list[tuple[Row | LogRecord, ValueError]] = []
        without = len(items) - len(events)  # the oldest items have no event beside them
        for i, item in enumerate(items):
            j = i - without
            try:
                self.log._append_items([item], events[j : j + 1] if j >= 0 else [], wait=wait)
            except ValueError as exc:
                refused.append((item, exc))
            except BaseException:
                self._failed = len(refused) + len(items) - i  # the earlier good ones went in
                raise
        self._failed = len(refused)
        item, first = refused[0]
        worker, event_id = _ids_of(item)
        raise ValueError(
            f"the log refused {len(refused)} of {len(items)} buffered events, the first "
            f"(worker {worker}, event {event_id}) with: {first}"
        ) from first

    def _check_open(self) -> None:
        self._raise_writer_error()
        if self._closed:
            raise EventLogError("the append buffer is closed")

    def _raise_writer_error(self) -> None:
        """Raise, once, what the writer's hand-overs failed with since the last call."""
        error, lost = self._error, self._lost
        if error is not None:
            self._error, self._lost = None, 0
            raise EventLogError(
                f"a buffered append failed, {lost} events are not in the log: {error}"
            ) from error


def _ids_of(item: Row | LogRecord) -> tuple[int, int]:
    """(worker id, event id) of a queued item, for a message."""
    if isinstance(item, tuple):
        worker, event_id = item[0], item[1]
        return (lookup_stream(worker) if worker < 0 else worker), event_id  # its own inverse
    return item.worker_id, item.event_id
