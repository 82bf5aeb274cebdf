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

import threading
from collections.abc import Sequence
from time import monotonic

from kvledger.events.log.core import EventLogError
from kvledger.events.log.event_log import EventLog
from kvledger.events.types import LogRecord

BATCH_SIZE = 256
"""Events gathered before they go to the log: enough that encoding them runs warm, few enough
that a batch fits one multi-row INSERT (``rows.STATEMENT_ROWS``)."""


class AppendBuffer:
    """Gathers events for ``log`` and appends them in order, ``batch_size`` at a time or once
    the oldest has waited ``max_hold`` seconds (default: a quarter of the log's ``max_delay``,
    the time its writer lets a row wait before it starts a commit).

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
        self._events: list[LogRecord] = []
        self._since = 0.0  # when the oldest waiting event came (monotonic)
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
        return len(self._events)

    @property
    def due(self) -> float | None:
        """When the oldest waiting event must be in the log (``time.monotonic()``); None when
        nothing waits. The log's writer reads it to know when to wake."""
        return self._since + self.max_hold if self._events else None

    def extend(self, events: Sequence[LogRecord]) -> None:
        """Queue ``events`` after every earlier one; appends the lot when the batch is full or
        the oldest has waited ``max_hold``."""
        if not events:
            return
        with self._lock:
            self._check_open()
            waiting = self._events
            now = monotonic()
            starts = not waiting
            if starts:
                self._since = now
            waiting.extend(events)
            if len(waiting) >= self.batch_size or now - self._since >= self.max_hold:
                self._append(wait=True)
            elif starts:
                try:
                    self.log._feed_due(now + self.max_hold)
                except BaseException:  # the log is closed or broken: it takes none of them
                    waiting.clear()
                    raise

    def flush(self) -> None:
        """Append what waits now (``log.flush()`` then waits for its commit)."""
        with self._lock:
            self._check_open()
            if self._events:
                self._append(wait=True)

    def close(self) -> None:
        """Append what waits and detach from the log, which stays open. Safe to call twice."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            try:
                if self._events:
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
        if not self._events or not self._lock.acquire(timeout=0.001):
            return  # (an unlocked look: events that come now are the producer's to announce)
        try:
            if self._events and not self._closed:
                try:
                    self._append(wait=False)
                except Exception as exc:  # for the producer's next call
                    self._error = self._error or exc
                    self._lost += self._failed
        finally:
            self._lock.release()

    def _append(self, *, wait: bool) -> None:
        """Hand every waiting event to the log (lock held).

        The log refuses a batch whole when one event in it is bad (it cannot be encoded, or its
        id repeats one or leaves a gap); the events of the other calls batched with it are not
        to pay for that, so the batch is then appended event by event and the error names what
        the log refused. A log that is closed or whose writer failed takes nothing."""
        batch, self._events = self._events, []
        try:
            self.log._append_many(batch, wait=wait)
        except ValueError:
            self._append_one_by_one(batch, wait)
        except BaseException:
            self._failed = len(batch)
            raise

    def _append_one_by_one(self, batch: list[LogRecord], wait: bool) -> None:
        refused: list[tuple[LogRecord, ValueError]] = []
        for i, event in enumerate(batch):
            try:
                self.log._append_many([event], wait=wait)
            except ValueError as exc:
                refused.append((event, exc))
            except BaseException:
                self._failed = len(refused) + len(batch) - i  # the earlier good ones went in
                raise
        self._failed = len(refused)
        event, first = refused[0]
        raise ValueError(
            f"the log refused {len(refused)} of {len(batch)} buffered events, the first "
            f"(worker {event.worker_id}, event {event.event_id}) with: {first}"
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
