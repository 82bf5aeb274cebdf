"""Batching in front of an ``EventLog`` for a producer that makes a few events at a time.

An engine's scheduler makes two or three events a step. Appending them step by step costs the
scheduler an encode per event and a locked hand-over per call, and both cost far less in bulk:
on the vLLM offload bench (bench/offload_bench.py) the log took 0.33 s of a 1.9 s run when
handed each step's events, 0.17 s when handed 256 at a time. Encoding one event between two
steps' work runs from cold caches, at two to three times its cost in a batch.

The price is a bounded delay. An event reaches the log at most ``max_hold`` seconds after it
was handed here (the log's own bound, ``core.Backlog``, applies from there), also when the
producer goes quiet: a timer thread appends whatever has waited that long. So a crash loses at
most what was handed here within ``max_hold`` plus what the log itself may lose.
"""

from __future__ import annotations

import atexit
import sys
import threading
import weakref
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
    that fails raises from the call that made it, or, when the timer made it, from the next
    call, and the message says how many events are not in the log: those the log refused
    (the others of the batch went in), or the whole batch when the log takes nothing more. A
    call that raises the timer's error takes none of its own events.
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
        self._changed = threading.Condition(self._lock)
        self._timer: threading.Thread | None = None
        self._closed = False
        # a failed append the timer made, and the events it cost: raised once, at the next call
        self._error: BaseException | None = None
        self._lost = 0
        self._failed = 0  # events the last failed append left out of the log
        _open_buffers.add(self)

    @property
    def waiting(self) -> int:
        """Events handed here and not yet appended to the log."""
        return len(self._events)

    def extend(self, events: Sequence[LogRecord]) -> None:
        """Queue ``events`` after every earlier one; appends the lot when the batch is full or
        the oldest has waited ``max_hold``."""
        if not events:
            return
        with self._lock:
            self._check_open()
            waiting = self._events
            now = monotonic()
            if not waiting:
                self._since = now
                if self._timer is None:
                    self._start_timer()
                else:
                    self._changed.notify()  # the timer waits without a deadline: give it one
            waiting.extend(events)
            if len(waiting) >= self.batch_size or now - self._since >= self.max_hold:
                self._append()

    def flush(self) -> None:
        """Append what waits now (``log.flush()`` then waits for its commit)."""
        with self._lock:
            self._check_open()
            if self._events:
                self._append()

    def close(self) -> None:
        """Append what waits and stop the timer; the log stays open. Safe to call twice."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._changed.notify()
            try:
                if self._events:
                    self._append()
            finally:
                _open_buffers.discard(self)
        if self._timer is not None:
            self._timer.join()
        self._raise_timer_error()

    def __enter__(self) -> AppendBuffer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _append(self) -> None:
        """Hand every waiting event to the log (lock held).

        The log refuses a batch whole when one event in it is bad (it cannot be encoded, or its
        id repeats one or leaves a gap); the events of the other calls batched with it are not
        to pay for that, so the batch is then appended event by event and the error names what
        the log refused. A log that is closed or whose writer failed takes nothing."""
        batch, self._events = self._events, []
        try:
            self.log.append_many(batch)
        except ValueError:
            self._append_one_by_one(batch)
        except BaseException:
            self._failed = len(batch)
            raise

    def _append_one_by_one(self, batch: list[LogRecord]) -> None:
        refused: list[tuple[LogRecord, ValueError]] = []
        for event in batch:
            try:
                self.log.append(event)
            except ValueError as exc:
                refused.append((event, exc))
            except BaseException:
                self._failed = len(batch)
                raise
        self._failed = len(refused)
        event, first = refused[0]
        raise ValueError(
            f"the log refused {len(refused)} of {len(batch)} buffered events, the first "
            f"(worker {event.worker_id}, event {event.event_id}) with: {first}"
        ) from first

    def _start_timer(self) -> None:
        self._timer = threading.Thread(target=self._run_timer, name="kvledger-log-buffer")
        self._timer.daemon = True  # appended at exit by _flush_open_buffers
        self._timer.start()

    def _run_timer(self) -> None:
        with self._lock:
            while not self._closed:
                if not self._events:
                    self._changed.wait()
                    continue
                wait = self._since + self.max_hold - monotonic()
                if wait > 0:
                    self._changed.wait(wait)
                    continue
                try:
                    self._append()
                except Exception as exc:  # for the producer's next call
                    self._error = self._error or exc
                    self._lost += self._failed

    def _check_open(self) -> None:
        self._raise_timer_error()
        if self._closed:
            raise EventLogError("the append buffer is closed")

    def _raise_timer_error(self) -> None:
        """Raise, once, what the timer's appends failed with since the last call."""
        error, lost = self._error, self._lost
        if error is not None:
            self._error, self._lost = None, 0
            raise EventLogError(
                f"a buffered append failed, {lost} events are not in the log: {error}"
            ) from error


_open_buffers: weakref.WeakSet[AppendBuffer] = weakref.WeakSet()


@atexit.register
def _flush_open_buffers() -> None:
    """Hand what waits to the log when the interpreter exits without ``close()``. Registered
    after the event log's own exit hook (this module imports that one), so it runs before it:
    the log then commits what it was handed."""
    for buffer in list(_open_buffers):
        try:
            buffer.close()
        except Exception as exc:
            print(f"kvledger: appending buffered events at exit: {exc}", file=sys.stderr)
