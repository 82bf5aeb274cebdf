"""What the threaded and the asyncio event log share, with no database I/O and no locking: the
backlog of uncommitted rows and the bound that makes ``append`` wait, the counters read from it,
each worker's next event id, how a writer rides out a database it lost (``Outage``), and the
errors an append or the writer ends in.

Each log holds this state under its own lock (a ``threading.Lock`` or an ``asyncio.Condition``)
and does the database work itself; ``LogCore`` keeps the counts and says what to do next.
"""

from __future__ import annotations

import logging
import os
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from operator import itemgetter
from time import monotonic
from typing import cast

import sqlalchemy as sa

from kvledger.events.log.database import Durability
from kvledger.events.log.rows import BatchItem, Row, to_row, to_row_without_tokens
from kvledger.events.log.schema import shown_url
from kvledger.events.types import LogRecord, lookup_stream

log = logging.getLogger(__name__)

RunOf = Callable[[object], tuple[int, int, int] | None]
Runs = tuple[tuple[int, int, int], ...]
"""Each worker's (worker, first id, last id) in a batch whose ids are runs."""
_compiled_run_of: RunOf | None
try:
    from kvledger.events.log._gather import RowBlock
    from kvledger.events.log._gather import run_of as _compiled_run_of
except ImportError:  # not built: the Python loop checks each batch
    _compiled_run_of = None
run_of = _compiled_run_of if os.environ.get("KVLEDGER_PYTHON_BUFFER", "") in ("", "0") else None
"""``_gather.run_of`` (events/log/_gather.c): a batch's ``(worker, first_id, last_id)`` when it
is a list of one worker's rows with consecutive ids (a block says so itself: ``RowBlock.runs``),
else None; None itself where the extension is not built or ``KVLEDGER_PYTHON_BUFFER=1`` turns
the buffer's compiled parts off (no block is made then)."""


class EventLogError(RuntimeError):
    """The writer failed; events appended since the last commit were not stored."""


def check_queue_sizes(batch_size: int, queue_size: int) -> None:
    """The writer wakes every ``batch_size`` events, so the queue must hold at least one batch."""
    if batch_size < 1 or queue_size < batch_size:
        raise ValueError(
            f"need 1 <= batch_size <= queue_size, got batch_size={batch_size}, "
            f"queue_size={queue_size}"
        )


LAG_BOUND = 1.0
"""With durability "batch" or "fsync", ``append`` waits once the oldest uncommitted row is older
than ``LAG_BOUND * max_delay``, so a crash loses at most what was appended within ``max_delay``.
The writer starts a commit ``max_delay / 4`` after a row is queued, which leaves the commit
three quarters of the delay before the producer feels it."""


class Backlog:
    """The rows appended and not yet committed, and the bound that makes ``append`` wait.

    The contract: the writer starts a commit at most ``max_delay / 4`` after a row is queued (or
    at once when ``batch_size`` rows are queued or an appender waits), so while it keeps up a row
    is committed within ``max_delay`` (measured p99 at the engine-on simulation's rate: see
    bench/eventlog_bench.py, "lag under load"). Whether or not it keeps up, the uncommitted
    tail (appended - committed, the batch being written included) never exceeds ``queue_size``
    rows, and with durability "batch" or "fsync" no row is queued while the oldest uncommitted
    one is older than ``max_lag`` (``LAG_BOUND * max_delay``): ``append`` waits instead
    (back-pressure, counted in ``backpressure_waits`` and ``backpressure_seconds``). A crash
    therefore loses at most ``queue_size`` rows, all queued within ``max_lag`` of the oldest
    of them. Durability "none" keeps only the row bound.

    Shared by ``EventLog`` and ``AsyncEventLog``; each holds it under its own lock, so it neither
    locks nor waits itself: it keeps the counts and says when to write and when to wait.
    """

    def __init__(
        self, *, batch_size: int, queue_size: int, max_delay: float, durability: Durability
    ) -> None:
        check_queue_sizes(batch_size, queue_size)
        if not max_delay > 0:
            raise ValueError(f"max_delay must be a positive number of seconds, got {max_delay}")
        self.batch_size = batch_size
        self.queue_size = queue_size
        self.commit_after = max_delay / 4
        self.max_lag: float | None = None if durability == "none" else LAG_BOUND * max_delay
        self.pending: list[BatchItem] = []
        """The queued rows, and blocks of them (an append buffer's batch, kept whole)."""
        self.pending_rows = 0
        self.appended = 0
        self.committed = 0
        self.waiters = 0  # appenders held back and flushes under way: commit at once
        self.backpressure_waits = 0
        self.backpressure_seconds = 0.0
        self.max_commit_lag = 0.0
        self.commit_times: deque[tuple[int, float]] = deque(maxlen=4096)
        """Recent commits as (rows committed so far, ``time.monotonic()``): what a lag
        measurement pairs with its own append times."""
        self._pending_since: float | None = None  # when the oldest queued row was appended
        self.writer_deadline: float | None = None
        """When the writer wakes by itself (``time.monotonic()``), 0.0 while it runs, None
        while it waits with no deadline (or does not say). ``add`` wakes it only when it would
        otherwise start the next commit too late: each wake of a thread that needs the GIL
        costs the producer a forced switch, which on a busy 2-core machine is ~0.2 ms."""
        self._writing_since: float | None = None  # the same for the batch being written

    def oldest(self) -> float | None:
        """When the oldest uncommitted row was appended (``time.monotonic()``)."""
        return self._pending_since if self._writing_since is None else self._writing_since

    def room(self, now: float) -> int:
        """Rows that may be queued now; 0 means the appender must wait."""
        if self.max_lag is not None:  # the hot path: oldest() inlined
            oldest = self._pending_since if self._writing_since is None else self._writing_since
            if oldest is not None and now - oldest > self.max_lag:
                return 0
        return self.queue_size - (self.appended - self.committed)

    def add(self, rows: Sequence[Row], now: float) -> bool:
        """Queue rows (the caller checked ``room``): a list's one by one, any other sequence
        (a block of rows) whole. True when the writer should be woken: a full batch, or the
        first rows while the writer would not start their commit within ``commit_after`` on
        its own."""
        if not rows:
            return False
        pending = self.pending
        was_empty = not pending
        if was_empty:
            self._pending_since = now
        if type(rows) is list:
            pending.extend(rows)
        else:
            pending.append(rows)
        self.appended += len(rows)
        self.pending_rows += len(rows)
        if self.pending_rows >= self.batch_size:
            return True
        return was_empty and self.wakes_too_late(now + self.commit_after)

    def add_one(self, row: Row, now: float) -> bool:
        """``add`` of one row (``EventLog.append``'s hot path, without building a list)."""
        pending = self.pending
        self.appended += 1
        self.pending_rows += 1
        if pending:
            pending.append(row)
            return self.pending_rows >= self.batch_size
        self._pending_since = now
        pending.append(row)
        return self.batch_size <= 1 or self.wakes_too_late(now + self.commit_after)

    def wakes_too_late(self, due: float) -> bool:
        """Whether the writer, left alone, would wake after ``due``."""
        deadline = self.writer_deadline
        return deadline is None or deadline > due

    def writer_wait(self, now: float) -> float | None:
        """Seconds the writer may sleep before its next commit (None: nothing is queued)."""
        if not self.pending:
            return None
        if self.waiters or self.pending_rows >= self.batch_size:
            return 0.0
        assert self._pending_since is not None
        return max(0.0, self._pending_since + self.commit_after - now)

    def take(self) -> tuple[list[BatchItem], int]:
        """Everything queued, as the batch the writer commits next, and its number of rows."""
        batch, self.pending = self.pending, []
        rows, self.pending_rows = self.pending_rows, 0
        if batch:
            self._writing_since, self._pending_since = self._pending_since, None
        return batch, rows

    def done(self, rows: int, now: float) -> None:
        """The batch taken last is committed."""
        self.committed += rows
        if self._writing_since is not None:
            self.max_commit_lag = max(self.max_commit_lag, now - self._writing_since)
            self._writing_since = None
        self.commit_times.append((self.committed, now))

    def hold(self) -> None:
        """An appender starts waiting: counted now, so metrics show a wait while it lasts."""
        self.waiters += 1
        self.backpressure_waits += 1

    def release(self, seconds: float) -> None:
        """An appender stops waiting, after ``seconds``."""
        self.waiters -= 1
        self.backpressure_seconds += seconds

    def commit_lag(self, now: float) -> float:
        """How long the oldest uncommitted row has waited (0 when everything is committed)."""
        oldest = self.oldest()
        return 0.0 if oldest is None else now - oldest


_DBAPI_ERRORS = frozenset(
    {
        "IntegrityError",
        "OperationalError",
        "DataError",
        "ProgrammingError",
        "InternalError",
        "NotSupportedError",
        "InterfaceError",
        "DatabaseError",
    }
)
"""PEP 249's error classes: each driver's errors derive from these (the first one in an
error's MRO is the most specific)."""


def _category(exc: BaseException) -> tuple[BaseException, str]:
    """The driver's own error and its PEP 249 category (the first such class in its MRO)."""
    cause = exc.orig if isinstance(exc, sa.exc.DBAPIError) and exc.orig is not None else exc
    category = next(
        (c.__name__ for c in type(cause).__mro__ if c.__name__ in _DBAPI_ERRORS),
        type(cause).__name__,
    )
    return cause, category


_LASTING = (
    "no such table",
    "no such column",
    "has no column",
    "readonly database",
    "disk i/o error",
    "disk is full",
    "no space left",
)
"""OperationalErrors that do not pass by waiting a minute (a missing table, a read-only file, a
full disk): reported at once, not retried."""


def _one_line(text: object) -> str:
    return "; ".join(line.strip() for line in str(text).splitlines() if line.strip())


def is_outage(exc: BaseException) -> bool:
    """Whether ``exc`` means the database is out of reach for now (a dropped connection, a
    server restarting, a locked SQLite file), so that the writer tries again: PEP 249's
    OperationalError and InterfaceError, less what waiting cannot mend (``_LASTING``)."""
    cause, category = _category(exc)
    if category not in ("OperationalError", "InterfaceError"):
        return False
    text = str(cause).lower()
    return not any(lasting in text for lasting in _LASTING)


def outage_failure(exc: BaseException, url: str, seconds: float) -> EventLogError:
    """The writer gave up on a database it lost: one line, the driver's words."""
    cause, category = _category(exc)
    text = _one_line(cause)
    return EventLogError(
        f"the event log {shown_url(url)} was unreachable for {seconds:.0f} s "
        f"({category}: {text}); giving up"
    )


RETRY_FOR = 60.0
"""Default of ``retry_for``: how long a writer keeps trying a database it lost."""
FIRST_PAUSE = 0.05
LAST_PAUSE = 2.0
"""A writer's pause between tries of a lost database: doubled from the first to the last."""


def check_retry_for(retry_for: float) -> float:
    if not retry_for >= 0:
        raise ValueError(f"retry_for must be 0 or more seconds, got {retry_for}")
    return retry_for


class Outage:
    """A writer's spell without its database, one policy for both writers: a lost database
    (``is_outage``) is tried again after a pause that doubles from ``FIRST_PAUSE`` to
    ``LAST_PAUSE``, for up to ``retry_for`` seconds, with one warning when it is lost and one
    when it is back; past the limit, ``outage_failure``'s one line."""

    def __init__(self, url: str, retry_for: float) -> None:
        self.url = url
        self.retry_for = retry_for
        self.since: float | None = None
        self._pause = FIRST_PAUSE

    def failed(self, exc: Exception) -> float:
        """The writer's try failed with ``exc``: the seconds to wait before the next one.
        Raises ``exc`` itself where it is no outage, and ``outage_failure`` past the limit."""
        if not is_outage(exc):
            raise exc
        now = monotonic()
        if self.since is None:
            self.since = now
            log.warning(
                "the event log %s is unreachable (%s); retrying for up to %g s, appends "
                "wait meanwhile",
                shown_url(self.url),
                _one_line(exc),
                self.retry_for,
            )
        if now - self.since >= self.retry_for:
            raise outage_failure(exc, self.url, now - self.since) from exc
        pause = min(self._pause, self.since + self.retry_for - now)
        self._pause = min(self._pause * 2, LAST_PAUSE)
        return pause

    def ended(self) -> bool:
        """The database answered again: True (and the warning saying so) when that ends an
        outage."""
        if self.since is None:
            return False
        log.warning(
            "the event log %s is reachable again after %.1f s; nothing was lost",
            shown_url(self.url),
            monotonic() - self.since,
        )
        self.since, self._pause = None, FIRST_PAUSE
        return True


def not_yet_committed(batch: Sequence[Row], newest: Mapping[int, int]) -> list[Row]:
    """The rows of ``batch`` a database does not hold, given each of its workers' newest
    committed id there (``newest``): a connection can drop after the server committed and
    before it said so. Each worker's rows in a batch are its next ids in order, so what the
    database holds of them is a prefix."""
    return [row for row in batch if row[1] > newest[row[0]]]


def writer_failure(exc: BaseException, lost: int) -> EventLogError:
    """One line naming the cause: the driver's message, never SQLAlchemy's, which carries the
    statement and its parameters (binary rows); named by its PEP 249 category (IntegrityError,
    OperationalError), the same on every database."""
    if isinstance(exc, EventLogError):
        return EventLogError(f"{exc}; {lost} appended events were not stored")
    cause, category = _category(exc)
    text = _one_line(cause)
    hint = ""
    if category == "IntegrityError":
        hint = " (is another process logging as the same worker id?)"
    return EventLogError(
        f"the event log writer failed ({category}: {text}){hint}; "
        f"{lost} appended events were not stored"
    )


def order_error(worker: int, event_id: int, expected: int) -> ValueError:
    """The error for an append out of order. ``worker`` is the row's ``worker`` column: a
    negative one is a worker's lookup-record stream (``lookup_stream``), named as that worker."""
    what = "repeats an id already logged" if event_id < expected else "leaves a gap"
    if worker < 0:
        owner = lookup_stream(worker)  # its own inverse
        return ValueError(
            f"worker {owner}: lookup record {event_id} {what}; the log expects record "
            f"{expected} next (is another process logging as worker {owner}?)"
        )
    return ValueError(
        f"worker {worker}: event {event_id} {what}; the log expects event {expected} next "
        f"(is another process logging as worker {worker}? A worker's emitter starts at "
        f"log.last_event_id({worker}) + 1)"
    )


class LogCore:
    """The state both logs keep, and the checks both make, with neither I/O nor locking.

    ``next_ids`` holds each worker's next event id once the log has seen the worker (learned
    from the database on its first append); appends are checked against it so a log only ever
    holds what replay can fold. Subclasses hold ``_lock`` (or their condition) around every
    call that changes state.
    """

    url: str

    def __init__(
        self,
        *,
        batch_size: int,
        queue_size: int,
        max_delay: float,
        durability: Durability,
        token_ids: bool = True,
        retry_for: float = RETRY_FOR,
    ) -> None:
        self.retry_for = check_retry_for(retry_for)
        """How long the writer keeps trying a database it lost (a dropped connection, a
        restarting server, a locked file) before it gives up; appends wait meanwhile."""
        self.outages = 0
        """Times the writer lost the database and got it back."""
        self.token_ids = token_ids
        """False: ``Stored`` events are stored without their token ids (prompts stay out)."""
        self._to_row = to_row if token_ids else to_row_without_tokens
        self._backlog = Backlog(
            batch_size=batch_size, queue_size=queue_size, max_delay=max_delay, durability=durability
        )
        self.batch_size = batch_size
        self.queue_size = queue_size
        self.max_delay = max_delay
        self.max_lag = self._backlog.max_lag
        self._next_ids: dict[int, int] = {}
        self._closing = False
        self._closed = False
        self._error: BaseException | None = None
        self.read_only = False

    # -- event ids -----------------------------------------------------------------------------

    def _known_last_id(self, worker: int) -> int | None:
        """The worker's newest accepted event id, None until the log has seen the worker."""
        expected = self._next_ids.get(worker)
        return None if expected is None else expected - 1

    def _accept_next(self, worker: int, event_id: int) -> bool:
        """The hot path of a single append: True when ``event_id`` is the next id of a worker
        the log knows (and is taken); False sends the caller through ``_accept_ids``."""
        next_ids = self._next_ids
        if next_ids.get(worker) == event_id:
            next_ids[worker] = event_id + 1
            return True
        return False

    def _rows_of(self, items: Sequence[Row | LogRecord]) -> tuple[Sequence[Row], Runs | None]:
        """An append buffer's batch as rows, and each worker's run in it where they are known
        in one pass: each item an event's row, or an event no compiled encoder took, encoded
        here (which refuses a bad one with its error). A block of rows (``_gather.RowBlock``)
        stays one: its events are encoded into it and its runs read off its arrays (a step's
        transitions and its lookup records are two workers' runs); only a block whose ids
        are not runs has its rows made one by one, for the general checks. None for the runs:
        ``_accept_run`` and the general checks decide."""
        to_row = self._to_row
        if run_of is not None and type(items) is RowBlock:
            if items.objects_left:
                items.encode_objects(to_row)
            runs = items.runs()
            if runs is not None:
                return cast(Sequence[Row], items), runs
        else:
            run = None if run_of is None else run_of(items)
            if run is not None:
                return cast(Sequence[Row], items), (run,)
        return [item if isinstance(item, tuple) else to_row(item) for item in items], None

    def _accept_runs(self, runs: Runs) -> bool:
        """True when each run's worker is known and its run starts at the worker's next id
        (then all are taken); False takes nothing, for the general checks."""
        next_ids = self._next_ids
        for worker, first, _ in runs:
            if next_ids.get(worker) != first:
                return False
        for worker, _, last in runs:
            next_ids[worker] = last + 1
        return True

    def _accept_run(self, rows: Sequence[Row], run: tuple[int, int, int] | None = None) -> bool:
        """The hot path of ``append_many``: True when ``rows`` are one known worker's next ids
        in order (then taken), as an emitter's batch is; False takes nothing and sends the
        caller through ``_unknown_workers`` and ``_accept_ids``, which check any batch.
        ``run``: ``run_of(rows)`` where the caller has it already."""
        if run is None and run_of is not None:
            run = run_of(rows)
        if run is not None:  # one worker's consecutive ids: only the first one to check
            worker, first, last = run
            if self._next_ids.get(worker) != first:
                return False
            self._next_ids[worker] = last + 1
            return True
        if run_of is not None:  # not that shape: the general check decides
            return False
        worker = rows[0][0]
        expected = self._next_ids.get(worker)
        if expected is None:
            return False
        for row in rows:
            if row[1] != expected or row[0] != worker:
                return False
            expected += 1
        self._next_ids[worker] = expected
        return True

    def _unknown_workers(self, rows: Sequence[Row]) -> set[int]:
        """Workers of ``rows`` whose next id must be read from the database first."""
        return set(map(itemgetter(0), rows)).difference(self._next_ids)

    def _accept_ids(self, rows: Sequence[Row], committed: Mapping[int, int]) -> None:
        """Check that each worker's ids in ``rows`` go on from the last one accepted (or from
        ``committed``, its newest committed id, for a worker not seen yet) without a gap or a
        repeat, then take them as accepted; nothing is taken when any is out of order."""
        known = self._next_ids
        next_ids: dict[int, int] = {}
        for worker, event_id, *_ in rows:
            expected = next_ids.get(worker)
            if expected is None:
                expected = known.get(worker)
            if expected is None:
                expected = committed[worker] + 1
            if event_id != expected:
                raise order_error(worker, event_id, expected)
            next_ids[worker] = expected + 1
        known.update(next_ids)

    # -- errors --------------------------------------------------------------------------------

    def _check_open(self) -> None:
        """Raise what stops an append: the writer's failure, a closed or a read-only log."""
        if self._error is not None:
            raise writer_failure(self._error, self.queue_depth) from self._error
        if self._closing or self._closed:
            raise EventLogError("the event log is closed")
        if self.read_only:
            raise EventLogError(f"{shown_url(self.url)} was opened read-only")

    def _raise_writer_failure(self) -> None:
        if self._error is not None:
            raise writer_failure(self._error, self.queue_depth) from self._error

    # -- counters ------------------------------------------------------------------------------

    @property
    def queue_depth(self) -> int:
        """Events appended and not yet committed (what a crash now would lose)."""
        return self._backlog.appended - self._backlog.committed

    @property
    def appended(self) -> int:
        """Events appended since this log was opened."""
        return self._backlog.appended

    @property
    def committed(self) -> int:
        """Events this log has committed since it was opened."""
        return self._backlog.committed

    @property
    def commit_lag(self) -> float:
        """Seconds the oldest uncommitted event has waited (0 when all is committed)."""
        return self._backlog.commit_lag(monotonic())

    @property
    def max_commit_lag(self) -> float:
        """The longest an event waited for its commit so far (append to commit), in seconds."""
        return self._backlog.max_commit_lag

    @property
    def backpressure_waits(self) -> int:
        """Appends that had to wait for the writer (the backlog was at its bound)."""
        return self._backlog.backpressure_waits

    @property
    def backpressure_seconds(self) -> float:
        """Time appenders spent waiting for the writer, in total."""
        return self._backlog.backpressure_seconds

    @property
    def commit_times(self) -> deque[tuple[int, float]]:
        """Recent commits as (events committed so far, ``time.monotonic()``)."""
        return self._backlog.commit_times
