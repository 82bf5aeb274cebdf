"""The durable event log: group-committed appends, ordered reads, checkpoints.

Appends cost the caller an encode and a list append; a writer thread takes what is queued and
commits it in one transaction (group commit), so the engine's hot path never waits for the disk
while the writer keeps up. When it does not, ``append`` waits (back-pressure, see ``Backlog``)
rather than let the uncommitted tail, which a crash would lose, grow without bound.

The writer inserts rows with multi-row ``INSERT ... VALUES (...), (...)`` statements, not
``executemany``: Python's sqlite3 releases the GIL around every row's ``sqlite3_step`` and takes
it back to bind the next row, and with a busy producer thread each take can wait for the
interpreter's switch interval (5 ms), which made a 5,000-row batch take seconds. One statement
per few hundred rows hands the GIL over a few times per batch instead of once per row.

Reads stream rows in append order (the row id) and decode them. Each worker's event ids are
checked on append to be contiguous, so a log only ever holds what replay can fold.
"""

from __future__ import annotations

import atexit
import os
import sqlite3
import sys
import threading
import time
import weakref
from collections import deque
from collections.abc import Generator, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from itertools import chain
from pathlib import Path
from time import monotonic
from typing import Any, Literal
from urllib.parse import quote

import sqlalchemy as sa

from kvledger.events.codec import KIND_NAMES, decode, decode_state, encode, encode_state
from kvledger.events.schema import (
    DEFAULT_URL,
    SchemaError,
    check_schema,
    checkpoints,
    database_url,
    events,
    shown_url,
)
from kvledger.events.types import AnyEvent, Tier
from kvledger.registry.state import RegistryState

Durability = Literal["batch", "fsync", "none"]
DURABILITY_MODES: tuple[Durability, ...] = ("batch", "fsync", "none")
_SQLITE_SYNC = {"batch": "NORMAL", "fsync": "FULL", "none": "OFF"}
_PG_SYNC = {"batch": "on", "fsync": "on", "none": "off"}
Row = tuple[int, int, str, int, float, bytes]
READ_CHUNK = 10_000


class EventLogError(RuntimeError):
    """The writer failed; events appended since the last commit were not stored."""


@dataclass(frozen=True)
class Checkpoint:
    position: int
    max_event_id: int
    max_ts: float
    state: RegistryState


@dataclass
class LogSummary:
    rows: int = 0
    first_position: int | None = None
    last_position: int | None = None
    first_ts: float | None = None
    last_ts: float | None = None
    by_kind_tier: dict[tuple[str, Tier], int] = field(default_factory=dict)
    workers: dict[int, tuple[int, int, int]] = field(default_factory=dict)  # count, first, last id
    checkpoints: list[int] = field(default_factory=list)


def engine_args(url: str, durability: Durability) -> tuple[sa.URL, dict[str, Any], str | None]:
    """(URL, create_engine keyword arguments, SQLite ``synchronous`` pragma or None).

    Shared by the threaded and the asyncio log so both honour ``durability`` the same way.
    """
    if durability not in DURABILITY_MODES:
        raise ValueError(
            f"unknown durability {durability!r}; expected one of {', '.join(DURABILITY_MODES)}"
        )
    parsed = sa.make_url(url)
    backend = parsed.get_backend_name()
    if backend == "sqlite":
        if parsed.database in (None, "", ":memory:"):
            raise ValueError(
                "an in-memory SQLite event log cannot be shared by its writer and readers; "
                "give a file path"
            )
        return (
            parsed,
            {"connect_args": {"timeout": 30}, "hide_parameters": True},
            _SQLITE_SYNC[durability],
        )
    if backend == "postgresql":
        # libpq options from the URL (e.g. a search_path) are kept, with ours after them.
        given = parsed.query.get("options", "")
        given = given if isinstance(given, str) else " ".join(given)
        options = f"{given} -c synchronous_commit={_PG_SYNC[durability]}".strip()
        return (
            parsed.difference_update_query(["options"]),
            {"connect_args": {"options": options}, "hide_parameters": True},
            None,
        )
    return parsed, {"hide_parameters": True}, None


def install_sqlite_pragmas(engine: sa.Engine, synchronous: str) -> None:
    """WAL (readers never block the writer) and the durability's ``synchronous`` level."""

    @sa.event.listens_for(engine, "connect")
    def _pragmas(dbapi_conn: Any, _record: Any) -> None:
        cur = dbapi_conn.cursor()
        cur.execute("PRAGMA journal_mode=WAL")
        cur.execute(f"PRAGMA synchronous={synchronous}")
        cur.close()


def make_engine(url: str, durability: Durability = "batch") -> sa.Engine:
    """An engine with the settings that ``durability`` asks for."""
    parsed, kwargs, synchronous = engine_args(url, durability)
    engine = sa.create_engine(parsed, **kwargs)
    if synchronous is not None:
        install_sqlite_pragmas(engine, synchronous)
    return engine


def open_read_only(url: str) -> tuple[sa.Engine, bool]:
    """An engine that reads a SQLite log wherever it lies, and whether it may store checkpoints.

    Reading a WAL database takes its -shm (and -wal) file, which SQLite creates next to it;
    where it cannot (a read-only mount, a folder the user may not write) a plain open fails with
    "unable to open database file". Then the file is opened through SQLite's URI as
    ``mode=ro``, which reads existing -shm/-wal files without writing them, and failing that as
    ``immutable=1``: no writer is running then (it would have created those files), so the file
    cannot change while it is read. Only the plain open may store checkpoints.
    """
    parsed = sa.make_url(url)
    path = Path(parsed.database or "").resolve()
    failure: sa.exc.OperationalError | None = None
    for query in ("", "mode=ro", "mode=ro&immutable=1"):
        target = f"file:{quote(str(path))}?{query}" if query else str(path)

        def connect(target: str = target, uri: bool = bool(query)) -> sqlite3.Connection:
            return sqlite3.connect(target, uri=uri, timeout=30, check_same_thread=False)

        engine = sa.create_engine(parsed, creator=connect, hide_parameters=True)
        try:
            with engine.connect() as conn:
                conn.exec_driver_sql("SELECT count(*) FROM sqlite_master").scalar()
        except sa.exc.OperationalError as exc:
            engine.dispose()
            failure = exc
            continue
        return engine, not query and os.access(path, os.W_OK)
    assert failure is not None
    raise failure


def to_row(event: AnyEvent) -> Row:
    """The event as the columns of its log row (the record is encoded, hence validated)."""
    payload = encode(event)
    return (
        event.worker_id,
        event.event_id,
        KIND_NAMES[type(event)],
        int(event.tier),
        event.ts,
        payload,
    )


COLUMNS = ("worker", "event_id", "kind", "tier", "ts", "payload")
STATEMENT_ROWS = 512
"""Rows per full INSERT statement: 3,072 parameters, within SQLite's limit since 3.32 (32,766)
and PostgreSQL's (65,535)."""


def insert_sql(paramstyle: str, rows: int = 1) -> str:
    """The positional INSERT of ``rows`` rows, in the driver's own parameter style."""
    ph = _placeholder(paramstyle)
    values = "(" + ", ".join([ph] * len(COLUMNS)) + ")"
    return f"INSERT INTO {events.name} ({', '.join(COLUMNS)}) VALUES " + ", ".join([values] * rows)


class InsertStatements:
    """Splits a batch of rows into multi-row INSERTs: ``for sql, params in statements(batch)``.

    Why not ``executemany``: see the module docstring. Every statement costs the writer one GIL
    hand-off to step it, and while a producer thread runs flat out each hand-off can wait a
    whole switch interval (5 ms), so a batch goes out in as few statements as it can: full
    ``STATEMENT_ROWS`` statements, prepared once and reused from the driver's statement cache,
    then one statement of exactly the remainder (preparing it costs ~1 ms and one more hand-off,
    where splitting the remainder into cached sizes would cost up to eight). SQLite builds
    before 3.32 allow 999 parameters, so there statements are smaller.
    """

    def __init__(self, paramstyle: str, max_params: int) -> None:
        self._paramstyle = paramstyle
        self._full = min(STATEMENT_ROWS, max_params // len(COLUMNS))
        self._full_sql = insert_sql(paramstyle, self._full)

    def __call__(self, batch: list[Row]) -> Iterator[tuple[str, tuple[Any, ...]]]:
        full = self._full
        whole = len(batch) - len(batch) % full
        for start in range(0, whole, full):
            yield self._full_sql, tuple(chain.from_iterable(batch[start : start + full]))
        if whole < len(batch):
            rest = batch[whole:]
            yield insert_sql(self._paramstyle, len(rest)), tuple(chain.from_iterable(rest))


def max_params(dialect: str) -> int:
    """Bound parameters one statement may hold on this database."""
    if dialect == "sqlite":
        return 32_766 if sqlite3.sqlite_version_info >= (3, 32, 0) else 999
    return 65_535


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
        self.pending: list[Row] = []
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

    def add(self, rows: list[Row], now: float) -> bool:
        """Queue rows (the caller checked ``room``); True when the writer should be woken."""
        pending = self.pending
        was_empty = not pending
        if was_empty:
            self._pending_since = now
        pending.extend(rows)
        self.appended += len(rows)
        return was_empty or len(pending) >= self.batch_size

    def writer_wait(self, now: float) -> float | None:
        """Seconds the writer may sleep before its next commit (None: nothing is queued)."""
        if not self.pending:
            return None
        if self.waiters or len(self.pending) >= self.batch_size:
            return 0.0
        assert self._pending_since is not None
        return max(0.0, self._pending_since + self.commit_after - now)

    def take(self) -> list[Row]:
        """Everything queued, as the batch the writer commits next."""
        batch, self.pending = self.pending, []
        if batch:
            self._writing_since, self._pending_since = self._pending_since, None
        return batch

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


def writer_failure(exc: BaseException, lost: int) -> EventLogError:
    """One line naming the cause: the driver's message, never SQLAlchemy's, which carries the
    statement and its parameters (binary rows); named by its PEP 249 category (IntegrityError,
    OperationalError), the same on every database."""
    cause = exc.orig if isinstance(exc, sa.exc.DBAPIError) and exc.orig is not None else exc
    text = "; ".join(line.strip() for line in str(cause).splitlines() if line.strip())
    category = next(
        (c.__name__ for c in type(cause).__mro__ if c.__name__ in _DBAPI_ERRORS),
        type(cause).__name__,
    )
    hint = ""
    if category == "IntegrityError":
        hint = " (is another process logging as the same worker id?)"
    return EventLogError(
        f"the event log writer failed ({category}: {text}){hint}; "
        f"{lost} appended events were not stored"
    )


def order_error(worker: int, event_id: int, expected: int) -> ValueError:
    what = "repeats an id already logged" if event_id < expected else "leaves a gap"
    return ValueError(
        f"worker {worker}: event {event_id} {what}; the log expects event {expected} next "
        f"(start the worker's emitter at log.last_event_id({worker}) + 1)"
    )


def _placeholder(paramstyle: str) -> str:
    if paramstyle == "qmark":
        return "?"
    if paramstyle in ("format", "pyformat"):
        return "%s"
    raise ValueError(f"database driver paramstyle {paramstyle!r} is not supported")


class EventLog:
    """An append-only event log in a SQL database (SQLite file by default).

    ``batch_size``: queued events that wake the writer at once; ``queue_size``: most events
    appended and not yet committed; ``max_delay``: longest an appended event waits for its
    commit while the writer keeps up; ``durability``: "batch" (a committed batch survives the
    process dying), "fsync" (also survives the machine dying), "none". ``Backlog`` states the
    bound on what a crash loses and the back-pressure that keeps it. ``read_only`` opens an
    existing log without a writer, also where it cannot be written (see ``open_read_only``).
    """

    def __init__(
        self,
        url: str = DEFAULT_URL,
        *,
        batch_size: int = 10_000,
        queue_size: int = 100_000,
        durability: Durability = "batch",
        max_delay: float = 0.05,
        read_only: bool = False,
        create: bool = True,
    ) -> None:
        self._backlog = Backlog(
            batch_size=batch_size, queue_size=queue_size, max_delay=max_delay, durability=durability
        )
        self.url = database_url(url)
        parsed = sa.make_url(self.url)
        if parsed.get_backend_name() == "sqlite" and (read_only or not create):
            path = Path(parsed.database or "")
            if not path.is_file():
                raise FileNotFoundError(f"no event log at {path}")
        self.read_only = read_only
        self.batch_size = batch_size
        self.queue_size = queue_size
        self.max_delay = max_delay
        self.max_lag = self._backlog.max_lag
        self.writable = True
        """False when a read-only log lies where it cannot be written (no checkpoints then)."""
        if read_only and parsed.get_backend_name() == "sqlite":
            self._engine, self.writable = open_read_only(self.url)
        else:
            self._engine = make_engine(self.url, durability)
        try:
            self._open_schema(create and not read_only)
        except BaseException:
            self._engine.dispose()
            raise
        self._lock = threading.Lock()
        self._wake_writer = threading.Condition(self._lock)
        self._committed_cv = threading.Condition(self._lock)
        self._next_ids: dict[int, int] = {}
        self._closing = False
        self._closed = False
        self._error: BaseException | None = None
        self._writer: threading.Thread | None = None
        if not read_only:
            self._writer = threading.Thread(target=self._run_writer, name="kvledger-log-writer")
            self._writer.daemon = True  # closed at exit by _close_open_logs, not by join order
            self._writer.start()
            _open_logs.add(self)

    # -- schema -------------------------------------------------------------------------------

    def _open_schema(self, create: bool) -> None:
        with self._engine.connect() as conn:
            if check_schema(conn, self.url):
                return
            if not create:
                raise SchemaError(
                    f"{shown_url(self.url)} holds no event log; run "
                    f"`kvledger db upgrade --url '{shown_url(self.url)}'` or open it for writing"
                )
            from kvledger.migrations.runner import upgrade

            upgrade(self.url, connection=conn)
            conn.commit()
            check_schema(conn, self.url)

    # -- appending ----------------------------------------------------------------------------

    def append(self, event: AnyEvent) -> None:
        """Queue one event; waits while the backlog is at its bound. Usable as an emitter's sink."""
        row = [to_row(event)]
        backlog = self._backlog
        with self._lock:
            self._check_open()
            now = monotonic()
            if backlog.room(now) < 1:
                now = self._wait_for_room()
            expected = self._next_ids.get(event.worker_id)
            if expected is None:
                expected = self._last_committed_id(event.worker_id) + 1
            if event.event_id != expected:
                raise order_error(event.worker_id, event.event_id, expected)
            self._next_ids[event.worker_id] = expected + 1
            if backlog.add(row, now):
                self._wake_writer.notify()

    def append_many(self, batch: Iterable[AnyEvent]) -> None:
        """Queue several events (checked as a whole before any is queued)."""
        rows = [to_row(e) for e in batch]
        backlog = self._backlog
        with self._lock:
            self._check_open()
            next_ids: dict[int, int] = {}
            for worker, event_id, *_ in rows:
                expected = next_ids.get(worker)
                if expected is None:
                    expected = self._next_ids.get(worker)
                if expected is None:
                    expected = self._last_committed_id(worker) + 1
                if event_id != expected:
                    raise order_error(worker, event_id, expected)
                next_ids[worker] = expected + 1
            self._next_ids.update(next_ids)
            start = 0
            while start < len(rows):
                now = monotonic()
                room = backlog.room(now)
                if room < 1:
                    now = self._wait_for_room()
                    room = backlog.room(now)
                chunk = rows[start : start + room]
                start += len(chunk)
                if backlog.add(chunk, now):
                    self._wake_writer.notify()

    def _wait_for_room(self) -> float:
        """Back-pressure: hold the appender (lock held on entry and exit) until the backlog has
        room; returns the time it ends. The writer commits at once while someone waits."""
        backlog = self._backlog
        started = now = monotonic()
        backlog.hold()
        try:
            while backlog.room(now) < 1:
                self._wake_writer.notify()
                self._committed_cv.wait(self.max_delay)
                self._check_open()
                now = monotonic()
        finally:
            backlog.release(now - started)
        return now

    def _last_committed_id(self, worker: int) -> int:
        with self._engine.connect() as conn:
            value = conn.execute(
                sa.select(sa.func.max(events.c.event_id)).where(events.c.worker == worker)
            ).scalar()
        return -1 if value is None else int(value)

    def _check_open(self) -> None:
        if self._error is not None:
            raise writer_failure(self._error, self.queue_depth) from self._error
        if self._closing or self._closed:
            raise EventLogError("the event log is closed")
        if self.read_only:
            raise EventLogError(f"{shown_url(self.url)} was opened read-only")

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

    def flush(self) -> None:
        """Return once everything appended so far is committed."""
        if self._writer is None:
            return
        with self._lock:
            backlog = self._backlog
            target = backlog.appended
            backlog.waiters += 1
            try:
                while backlog.committed < target:
                    if self._error is not None:
                        self._check_open()
                    self._wake_writer.notify()
                    self._committed_cv.wait(0.1)
            finally:
                backlog.waiters -= 1

    def close(self) -> None:
        """Flush, stop the writer and release the database. Safe to call twice."""
        if self._closed:
            return
        if self._writer is not None:
            with self._lock:
                self._closing = True
                self._wake_writer.notify()
            self._writer.join()
            _open_logs.discard(self)
        self._closed = True
        self._engine.dispose()
        if self._error is not None:
            raise writer_failure(self._error, self.queue_depth) from self._error

    def __enter__(self) -> EventLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _run_writer(self) -> None:
        backlog = self._backlog
        try:
            with self._engine.connect() as conn:
                statements = InsertStatements(
                    conn.dialect.paramstyle, max_params(conn.dialect.name)
                )
                # The driver's own connection, and one cursor for the writer's life: every call
                # that releases the GIL costs a hand-off (see InsertStatements), and SQLAlchemy
                # opens and closes a cursor per statement.
                dbapi = conn.connection.dbapi_connection
                assert dbapi is not None
                cursor = dbapi.cursor()
                while True:
                    with self._lock:
                        while not self._closing:
                            wait = backlog.writer_wait(monotonic())
                            if wait == 0.0:
                                break
                            self._wake_writer.wait(wait)
                        batch = backlog.take()
                        closing = self._closing
                    if batch:
                        for sql, params in statements(batch):
                            cursor.execute(sql, params)
                        dbapi.commit()
                        with self._lock:
                            backlog.done(len(batch), monotonic())
                            self._committed_cv.notify_all()
                    elif closing:
                        return
        except BaseException as exc:
            with self._lock:
                self._error = exc
                self._committed_cv.notify_all()

    # -- reading ------------------------------------------------------------------------------

    def read(
        self,
        *,
        worker_id: int | None = None,
        after_event_id: int = -1,
        until_event_id: int | None = None,
        until_ts: float | None = None,
    ) -> Iterator[AnyEvent]:
        """Committed events in append order.

        The event-id bounds apply to each worker's own ids, so without ``worker_id`` they select
        every worker's events ``after_event_id < id <= until_event_id``. ``until_ts`` stops at
        the first event stamped later than it (a prefix of the log, not a filter).
        """
        for _position, event in self.read_positions(
            worker_id=worker_id,
            after_event_id=after_event_id,
            until_event_id=until_event_id,
            until_ts=until_ts,
        ):
            yield event

    def read_positions(
        self,
        *,
        worker_id: int | None = None,
        after_event_id: int = -1,
        until_event_id: int | None = None,
        until_ts: float | None = None,
        after_position: int = 0,
        until_position: int | None = None,
    ) -> Iterator[tuple[int, AnyEvent]]:
        """Like ``read``, with each event's position (its row id) and position bounds."""
        for position, ts, payload in self.read_rows(
            worker_id=worker_id,
            after_event_id=after_event_id,
            until_event_id=until_event_id,
            after_position=after_position,
            until_position=until_position,
        ):
            if until_ts is not None and ts > until_ts:
                return
            yield position, decode(payload, position)

    def read_rows(
        self,
        *,
        worker_id: int | None = None,
        after_event_id: int = -1,
        until_event_id: int | None = None,
        after_position: int = 0,
        until_position: int | None = None,
    ) -> Iterator[tuple[int, float, bytes]]:
        """Raw (position, ts, payload) rows in append order."""
        for chunk in self.read_chunks(
            worker_id=worker_id,
            after_event_id=after_event_id,
            until_event_id=until_event_id,
            after_position=after_position,
            until_position=until_position,
        ):
            yield from chunk

    def read_chunks(
        self,
        *,
        worker_id: int | None = None,
        after_event_id: int = -1,
        until_event_id: int | None = None,
        after_position: int = 0,
        until_position: int | None = None,
        chunk_size: int = READ_CHUNK,
        columns: Sequence[str] = ("id", "ts", "payload"),
    ) -> Generator[list[tuple[Any, ...]], None, None]:
        """Raw rows in lists of up to ``chunk_size``: what replay folds a list at a time.
        ``columns`` names what each row holds (``kvledger inspect --check`` reads them all).

        On SQLite the Core statement runs on the connection's own sqlite3 cursor and yields
        plain tuples: wrapping each row in a ``Row`` would cost replay half its speed. Other
        databases stream through a server-side cursor, so a long log is never loaded whole.
        """
        c = events.c
        stmt = sa.select(*(c[name] for name in columns)).order_by(c.id)
        if worker_id is not None:
            stmt = stmt.where(c.worker == worker_id)
        if after_event_id >= 0:
            stmt = stmt.where(c.event_id > after_event_id)
        if until_event_id is not None:
            stmt = stmt.where(c.event_id <= until_event_id)
        if after_position > 0:
            stmt = stmt.where(c.id > after_position)
        if until_position is not None:
            stmt = stmt.where(c.id <= until_position)
        with self._engine.connect() as conn:
            if conn.dialect.name == "sqlite":
                # Every bound is an int, so inlining them as literals is exact and safe.
                sql = str(stmt.compile(conn, compile_kwargs={"literal_binds": True}))
                cursor = conn.connection.driver_connection.execute(sql)  # type: ignore[union-attr]
                try:
                    while chunk := cursor.fetchmany(chunk_size):
                        yield chunk
                finally:
                    cursor.close()
                return
            result = conn.execution_options(stream_results=True, max_row_buffer=chunk_size).execute(
                stmt
            )
            with result:
                while rows := result.fetchmany(chunk_size):
                    yield rows  # type: ignore[misc]

    def last_event_id(self, worker_id: int) -> int:
        """The worker's newest event id accepted by this log (queued or committed); -1 if none."""
        with self._lock:
            expected = self._next_ids.get(worker_id)
        if expected is not None:
            return expected - 1
        return self._last_committed_id(worker_id)

    def last_position(self) -> int:
        """The newest committed row's position; 0 for an empty log."""
        with self._engine.connect() as conn:
            value = conn.execute(sa.select(sa.func.max(events.c.id))).scalar()
        return 0 if value is None else int(value)

    def summary(self) -> LogSummary:
        c = events.c
        out = LogSummary()
        with self._engine.connect() as conn:
            rows, first, last, t0, t1 = conn.execute(
                sa.select(
                    sa.func.count(),
                    sa.func.min(c.id),
                    sa.func.max(c.id),
                    sa.func.min(c.ts),
                    sa.func.max(c.ts),
                )
            ).one()
            out.rows, out.first_position, out.last_position = int(rows), first, last
            out.first_ts, out.last_ts = t0, t1
            for kind, tier, n in conn.execute(
                sa.select(c.kind, c.tier, sa.func.count()).group_by(c.kind, c.tier)
            ):
                out.by_kind_tier[(kind, Tier(tier))] = int(n)
            for worker, n, lo, hi in conn.execute(
                sa.select(
                    c.worker, sa.func.count(), sa.func.min(c.event_id), sa.func.max(c.event_id)
                ).group_by(c.worker)
            ):
                out.workers[int(worker)] = (int(n), int(lo), int(hi))
            out.checkpoints = [
                int(p)
                for p in conn.execute(
                    sa.select(checkpoints.c.position).order_by(checkpoints.c.position)
                ).scalars()
            ]
        return out

    # -- checkpoints --------------------------------------------------------------------------

    def save_checkpoint(self, position: int, state: RegistryState, max_ts: float) -> bool:
        """Store ``state`` as the fold of every row up to ``position``; False if not stored.

        One there already is replaced: it holds the same fold, unless it was written in an
        older snapshot format, which this heals. A log on storage this process cannot write
        (``writable`` is False) keeps none: a checkpoint only saves a later replay time.
        """
        if not self.writable:
            return False
        values = {
            "max_event_id": max(state.last_event_id.values(), default=-1),
            "max_ts": max_ts,
            "created": time.time(),
            "snapshot": encode_state(state),
        }
        with self._engine.begin() as conn:
            exists = conn.execute(
                sa.select(checkpoints.c.id).where(checkpoints.c.position == position)
            ).first()
            if exists is None:
                conn.execute(checkpoints.insert().values(position=position, **values))
            else:
                conn.execute(
                    checkpoints.update().where(checkpoints.c.id == exists[0]).values(**values)
                )
        return True

    def latest_checkpoint(
        self,
        *,
        max_position: int | None = None,
        max_event_id: int | None = None,
        max_ts: float | None = None,
    ) -> Checkpoint | None:
        """The newest checkpoint that covers no event beyond the given bounds."""
        c = checkpoints.c
        stmt = sa.select(c.position, c.max_event_id, c.max_ts, c.snapshot)
        if max_position is not None:
            stmt = stmt.where(c.position <= max_position)
        if max_event_id is not None:
            stmt = stmt.where(c.max_event_id <= max_event_id)
        if max_ts is not None:
            stmt = stmt.where(c.max_ts <= max_ts)
        with self._engine.connect() as conn:
            row = conn.execute(stmt.order_by(c.position.desc()).limit(1)).first()
        if row is None:
            return None
        return Checkpoint(int(row[0]), int(row[1]), float(row[2]), decode_state(row[3]))


_open_logs: weakref.WeakSet[EventLog] = weakref.WeakSet()


@atexit.register
def _close_open_logs() -> None:
    """Commit what is queued when the interpreter exits without ``close()``."""
    for log in list(_open_logs):
        try:
            log.close()
        except Exception as exc:
            print(
                f"kvledger: closing event log {shown_url(log.url)} at exit: {exc}", file=sys.stderr
            )
