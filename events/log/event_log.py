"""The durable event log for threaded code: group-committed appends, ordered reads, checkpoints.

Appends cost the caller an encode and a list append; a writer thread takes what is queued and
commits it in one transaction (group commit), so the engine's hot path never waits for the disk
while the writer keeps up. When it does not, ``append`` waits (back-pressure, see
``core.Backlog``) rather than let the uncommitted tail, which a crash would lose, grow without
bound. On SQLite the writer commits each batch with the GIL released (``_sqlite.c``, when
built); elsewhere, and without it, the rows go out as multi-row INSERTs (``rows.py`` says why),
on PostgreSQL as one COPY.

Reads stream rows in append order (the row id) through ``reader.read_chunks`` and decode them.
Each worker's event ids are checked on append to be contiguous (``core.LogCore``), so a log only
ever holds what replay can fold.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import sys
import threading
import weakref
from collections.abc import Callable, Generator, Iterable, Iterator, Sequence
from itertools import chain
from pathlib import Path
from time import monotonic
from typing import Any, Protocol

import sqlalchemy as sa

from kvledger.events.codec import decode
from kvledger.events.log import checkpoints, reader
from kvledger.events.log.checkpoints import Checkpoint
from kvledger.events.log.core import RETRY_FOR, LogCore, Outage, not_yet_committed
from kvledger.events.log.database import (
    Durability,
    compiled_sqlite_path,
    open_compiled_writer,
    open_database,
    open_read_only,
)
from kvledger.events.log.reader import READ_CHUNK, LogSummary, RowChunk
from kvledger.events.log.rows import BatchItem, InsertStatements, Row, copy_rows, flat, max_params
from kvledger.events.log.schema import (
    DEFAULT_URL,
    SchemaError,
    check_schema,
    database_url,
    paste_note,
    shown_url,
)
from kvledger.events.types import AnyEvent, LogRecord, Lookup, Released, RunInfo
from kvledger.registry.state import RegistryState

log = logging.getLogger(__name__)

Committed = tuple[AnyEvent, bytes]
"""A committed transition and its record, the bytes the log stored (``codec.encode``)."""
CommitSink = Callable[[Sequence[Committed]], object]
"""Called by the writer with each committed batch's transitions (``EventLog.on_commit``)."""

_LOOKUP_TYPES = (Lookup, Released, RunInfo)


class Feed(Protocol):
    """What the writer asks of an ``AppendBuffer`` attached to its log."""

    @property
    def due(self) -> float | None:
        """When the oldest waiting event must be handed over (None: none waits)."""

    def hand_over_from_writer(self) -> None:
        """Hand what waits to the log now, without waiting for room (the writer makes it)."""

    def flush(self) -> None:
        """Hand what waits to the log now (a caller's ``EventLog.flush``)."""

    @property
    def waiting(self) -> int:
        """Events handed to the buffer and not yet to the log."""

    def keep_events(self, keep: bool) -> None:
        """Whether the log has commit sinks, which want each event beside its row (called
        under the log's lock: must not take the buffer's)."""


class EventLog(LogCore):
    """An append-only event log in a SQL database (SQLite file by default).

    ``batch_size``: queued events that wake the writer at once; ``queue_size``: most events
    appended and not yet committed; ``max_delay``: longest an appended event waits for its
    commit while the writer keeps up; ``durability``: "batch" (a committed batch survives the
    process dying), "fsync" (also survives the machine dying), "none". ``Backlog`` states the
    bound on what a crash loses and the back-pressure that keeps it. ``read_only`` opens an
    existing log without a writer, also where it cannot be written (see ``open_read_only``).
    ``token_ids`` False stores ``Stored`` events without their token ids (users' prompts).
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
        retry_for: float = RETRY_FOR,
        token_ids: bool = True,
    ) -> None:
        super().__init__(
            batch_size=batch_size,
            queue_size=queue_size,
            max_delay=max_delay,
            durability=durability,
            token_ids=token_ids,
            retry_for=retry_for,
        )
        self.url = database_url(url)
        self._durability: Durability = durability
        self._compiled_path = compiled_sqlite_path(self.url)
        """The SQLite file the compiled writer and replay's reader open (None: Python's)."""
        parsed = sa.make_url(self.url)
        if parsed.get_backend_name() == "sqlite" and (read_only or not create):
            path = Path(parsed.database or "")
            if not path.is_file():
                raise FileNotFoundError(f"no event log at {path}")
        self.read_only = read_only
        self.writable = True
        """False when a read-only log lies where it cannot be written (no checkpoints then)."""
        if read_only and parsed.get_backend_name() == "sqlite":
            self._db, self.writable = open_read_only(self.url)
        else:
            self._db = open_database(self.url, durability)
        try:
            self._open_schema(create and not read_only)
        except BaseException:
            self._db.dispose()
            raise
        self._lock = threading.Lock()
        self._wake_writer = threading.Condition(self._lock)
        self._committed_cv = threading.Condition(self._lock)
        self._writer: threading.Thread | None = None
        # append buffers in front of this log: the writer hands over what waits in them
        self._feeds: list[Feed] = []
        # who gets each committed batch (``on_commit``), and the events of the queued rows,
        # kept beside them only while someone wants them
        self._commit_sinks: list[tuple[CommitSink, int | None]] = []
        self._pending_events: list[LogRecord] | None = None
        if not read_only:
            self._writer = threading.Thread(target=self._run_writer, name="kvledger-log-writer")
            self._writer.daemon = True  # closed at exit by _close_open_logs, not by join order
            self._writer.start()
            _open_logs.add(self)

    # -- schema -------------------------------------------------------------------------------

    def _open_schema(self, create: bool) -> None:
        with self._db.connect() as conn:
            if check_schema(conn, self.url):
                return
            if not create:
                raise SchemaError(
                    f"{shown_url(self.url)} holds no event log; run "
                    f"`kvledger db upgrade --url '{shown_url(self.url)}'`{paste_note(self.url)} "
                    "or open it for writing"
                )
            # Alembic's command machinery: only a blank database needs it
            from kvledger.migrations.runner import upgrade

            upgrade(self.url, connection=conn)
            conn.commit()
            check_schema(conn, self.url)

    # -- appending ----------------------------------------------------------------------------

    def append(self, event: LogRecord) -> None:
        """Queue one event (or lookup record); waits while the backlog is at its bound. Usable
        as an emitter's sink.

        The one-by-one hot path: the checks of ``_check_open``, ``_accept_next`` and the
        backlog's ``room`` and ``add`` are made inline (``Backlog.add_one``), one method call
        under the lock where there were four (profiled: a third of an append's own time
        outside the encode)."""
        row = self._to_row(event)
        backlog = self._backlog
        with self._lock:
            if self._error is not None or self._closing or self._closed or self.read_only:
                self._check_open()
            now = monotonic()
            if backlog.room(now) < 1:
                now = self._wait_for_room()
            worker = row[0]
            next_ids = self._next_ids
            if next_ids.get(worker) == event.event_id:
                next_ids[worker] = event.event_id + 1
            else:
                self._accept_ids((row,), self._committed_ids((row,)))
            if self._pending_events is not None:
                self._pending_events.append(event)
            if backlog.add_one(row, now):
                self._wake_writer.notify()

    def append_many(self, batch: Iterable[LogRecord]) -> None:
        """Queue several events (checked as a whole before any is queued)."""
        self._append_many(batch, wait=True)

    def _append_many(self, batch: Iterable[LogRecord], *, wait: bool) -> None:
        """``append_many``; with ``wait`` False, queued whatever the backlog holds."""
        events = list(batch)
        self._append_items(events, events, wait=wait)

    def _append_items(
        self, items: Sequence[Row | LogRecord], events: Sequence[LogRecord], *, wait: bool
    ) -> None:
        """``append_many`` of an ``AppendBuffer``'s queue: each item an event's row, or an
        event no compiled function encoded (encoded here, which refuses a bad one), and
        ``events`` the events of the newest items (a buffer keeps them only while the log has
        commit sinks). With ``wait`` False, queued whatever the backlog holds: how the writer
        itself hands over what waits in a buffer (it would wait for itself)."""
        rows, runs = self._rows_of(items)
        backlog = self._backlog
        with self._lock:
            if wait:
                self._check_open()
            else:  # the writer: also while the log closes (its last hand-over)
                self._raise_writer_failure()
            if not rows:
                return
            if not (self._accept_run(rows) if runs is None else self._accept_runs(runs)):
                self._accept_ids(rows, self._committed_ids(rows))
            if self._pending_events is not None and len(events) < len(rows):
                # rows queued before a commit sink came: their events from their records
                missing = len(rows) - len(events)
                events = [decode(row[5]) for row in rows[:missing]] + list(events)
            now = monotonic()
            if not wait or backlog.room(now) >= len(rows):  # the usual case
                if self._pending_events is not None:
                    self._pending_events.extend(events)
                if backlog.add(rows, now):
                    self._wake_writer.notify()
                return
            start = 0
            while start < len(rows):
                now = monotonic()
                room = backlog.room(now)
                if room < 1:
                    now = self._wait_for_room()
                    room = backlog.room(now)
                chunk = rows[start : start + room]
                if self._pending_events is not None:
                    self._pending_events.extend(events[start : start + room])
                start += len(chunk)
                if backlog.add(chunk, now):
                    self._wake_writer.notify()

    def _committed_ids(self, rows: Sequence[Any]) -> dict[int, int]:
        """The newest committed id of each worker of ``rows`` the log has not seen yet."""
        return {worker: self._last_committed_id(worker) for worker in self._unknown_workers(rows)}

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
        with self._db.connect() as conn:
            value = conn.execute(reader.last_id_query(worker)).scalar()
        return -1 if value is None else int(value)

    def flush(self) -> None:
        """Return once everything appended so far is committed, what waits in the append
        buffers in front of this log included."""
        if self._writer is None:
            return
        with self._lock:
            feeds = list(self._feeds)
        for feed in feeds:  # outside the lock: a buffer's hand-over takes it
            feed.flush()
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
        self._db.dispose()
        self._raise_writer_failure()

    def __enter__(self) -> EventLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _run_writer(self) -> None:
        try:
            self._write_until_closed()
        except BaseException as exc:
            with self._lock:
                self._error = exc
                self._committed_cv.notify_all()

    def _write_until_closed(self) -> None:
        """The writer: commit what is queued, hand it to the commit sinks, until closed.

        A database it loses (``core.is_outage``: a dropped connection, a restarting server, a
        locked file) is tried again, with a growing pause, for up to ``retry_for`` seconds;
        appends wait under the usual back-pressure meanwhile. The batch that failed is
        committed first on the new connection, less the rows the database already holds (a
        connection can drop after the server committed and before it said so), so nothing is
        lost and nothing is written twice.
        """
        batch: list[BatchItem] = []  # taken from the backlog, not yet known to be committed
        count = 0  # its rows
        events: list[LogRecord] = []  # their events, for the commit sinks (a tail of batch)
        outage = Outage(self.url, self.retry_for)
        compiled = self._compiled_path
        while True:
            try:
                with (
                    _Writer(self._db)
                    if compiled is None
                    else open_compiled_writer(compiled, self._durability)
                ) as writer:
                    if batch:  # the batch the outage interrupted
                        rows = flat(batch)
                        newest = {w: self._last_committed_id(w) for w in {r[0] for r in rows}}
                        rest: list[BatchItem] = list(not_yet_committed(rows, newest))
                        writer.commit(rest)
                        self._committed(batch, count, events)
                        batch, count, events = [], 0, []
                    if outage.ended():
                        self.outages += 1
                    while True:
                        batch, count, events, closing = self._next_batch()
                        if batch:
                            writer.commit(batch)
                            self._committed(batch, count, events)
                            batch, count, events = [], 0, []
                        elif closing:
                            return
            except Exception as exc:
                pause = outage.failed(exc)
                with self._lock:  # a close() wakes the wait; the outage is retried all the same
                    self._wake_writer.wait(pause)

    def _next_batch(self) -> tuple[list[BatchItem], int, list[LogRecord], bool]:
        """Wait until a commit is due (or the log closes), hand the append buffers' events
        over, and take the batch: (rows and blocks of them, the rows' number, their events for
        the sinks, closing)."""
        backlog = self._backlog
        with self._lock:
            while not self._closing:
                now = monotonic()
                wait = self._writer_wait(now)
                if wait == 0.0:
                    break
                backlog.writer_deadline = None if wait is None else now + wait
                self._wake_writer.wait(wait)
                backlog.writer_deadline = 0.0
            feeds = list(self._feeds)
        for feed in feeds:  # outside the lock: a buffer's producer takes both
            feed.hand_over_from_writer()
        with self._lock:
            batch, count = backlog.take()
            events: list[LogRecord] = []
            if self._pending_events:
                events, self._pending_events = self._pending_events, []
            return batch, count, events, self._closing

    def _committed(self, batch: list[BatchItem], count: int, events: list[LogRecord]) -> None:
        """``batch`` (``count`` rows) is in the database: hand its events to the commit sinks,
        then count it (so a ``flush`` returns only once the sinks have them)."""
        if events:  # the events of the newest rows of the batch, in order
            rows = flat(batch)
            records = [row[5] for row in rows[len(rows) - len(events) :]]
            self._hand_to_commit_sinks(list(zip(events, records, strict=True)))
        with self._lock:
            self._backlog.done(count, monotonic())
            self._committed_cv.notify_all()

    @property
    def queue_depth(self) -> int:
        """Events appended and not yet committed, those waiting in the append buffers in
        front of this log included (what a crash now would lose)."""
        return super().queue_depth + sum(feed.waiting for feed in list(self._feeds))

    # -- commit sinks: what other processes see -------------------------------------------------

    def on_commit(self, sink: CommitSink, *, worker_id: int | None = None) -> None:
        """Hand ``sink`` every transition committed from now on (of ``worker_id`` only, when
        given), in commit order, a committed batch per call, from the writer thread, each as
        (event, record): the record is the row's payload, so a sink that ships events on
        (the shared registry's stream) sends the very bytes the log stored.

        This is how views outside the process (the shared registry, the ZMQ stream) are fed:
        they receive an event only once it is committed, so a crash never un-says what they
        hold. Events appended before the sink was added are not handed to it (read them from
        the log). Lookup records are not handed on. ``sink`` must not block: it delays the
        next commit; an exception it raises is logged and the writer goes on.
        """
        with self._lock:
            self._check_open()
            self._commit_sinks.append((sink, worker_id))
            if self._pending_events is None:
                self._pending_events = []
                for feed in self._feeds:
                    feed.keep_events(True)

    def off_commit(self, sink: CommitSink) -> None:
        """Stop handing committed events to ``sink``."""
        with self._lock:
            self._commit_sinks = [(s, w) for s, w in self._commit_sinks if s is not sink]
            if not self._commit_sinks:
                self._pending_events = None
                for feed in self._feeds:
                    feed.keep_events(False)

    def _hand_to_commit_sinks(self, pairs: list[tuple[LogRecord, bytes]]) -> None:
        with self._lock:
            sinks = list(self._commit_sinks)
        events: list[Committed] = [p for p in pairs if not isinstance(p[0], _LOOKUP_TYPES)]  # type: ignore[misc]
        if not events or not sinks:
            return
        for sink, worker in sinks:
            mine = events if worker is None else [p for p in events if p[0].worker_id == worker]
            if not mine:
                continue
            try:
                sink(mine)
            except Exception:
                log.exception("a commit sink of the event log %s failed", shown_url(self.url))

    def _writer_wait(self, now: float) -> float | None:
        """Seconds until the writer's next commit or hand-over is due (None: nothing waits)."""
        wait = self._backlog.writer_wait(now)
        if wait == 0.0:
            return wait
        for feed in self._feeds:
            due = feed.due  # read without the buffer's lock: ``_feed_due`` covers a race
            if due is not None and (wait is None or due - now < wait):
                wait = max(0.0, due - now)
        return wait

    # -- append buffers (``buffer.AppendBuffer``) -------------------------------------------------

    def _attach(self, feed: Feed) -> None:
        with self._lock:
            self._check_open()
            self._feeds.append(feed)
            feed.keep_events(self._pending_events is not None)

    def _detach(self, feed: Feed) -> None:
        with self._lock:
            if feed in self._feeds:
                self._feeds.remove(feed)

    def _feed_due(self, due: float) -> None:
        """A buffer's oldest event must be handed over by ``due``: wake the writer unless it
        wakes by then anyway. (The buffer updated ``due`` before; the writer reads it under
        this lock, so it either saw it or is waiting, and then this wakes it.) Raises when the
        log takes nothing more, as an append would."""
        with self._lock:
            self._check_open()
            if self._backlog.wakes_too_late(due):
                self._wake_writer.notify()

    # -- reading: every read goes through ``read_chunks`` ----------------------------------------

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
        positions = self.read_positions(
            worker_id=worker_id,
            after_event_id=after_event_id,
            until_event_id=until_event_id,
            until_ts=until_ts,
        )
        return (event for _position, event in positions)

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
        rows = self.read_rows(
            worker_id=worker_id,
            after_event_id=after_event_id,
            until_event_id=until_event_id,
            after_position=after_position,
            until_position=until_position,
        )
        return reader.decode_rows(rows, until_ts)

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
        return chain.from_iterable(
            self.read_chunks(
                worker_id=worker_id,
                after_event_id=after_event_id,
                until_event_id=until_event_id,
                after_position=after_position,
                until_position=until_position,
            )
        )

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
        lookups_only: bool = False,
    ) -> Generator[list[tuple[Any, ...]], None, None]:
        """Raw rows in lists of up to ``chunk_size``: what replay folds a list at a time.
        ``columns`` names what each row holds (``kvledger inspect --check`` reads them all);
        ``lookups_only`` reads the lookup records alone (``kvledger whatif``)."""
        stmt = reader.select_rows(
            lookups_only=lookups_only,
            worker_id=worker_id,
            after_event_id=after_event_id,
            until_event_id=until_event_id,
            after_position=after_position,
            until_position=until_position,
            columns=columns,
        )
        return reader.read_chunks(self._db, stmt, chunk_size)

    def read_row_chunks(
        self,
        *,
        after_position: int = 0,
        until_position: int | None = None,
        chunk_size: int = READ_CHUNK,
    ) -> Generator[RowChunk, None, None]:
        """Every row in the position bounds as ``RowChunk``s of up to ``chunk_size``: what
        replay folds, read by the compiled reader where it serves (``reader.read_row_chunks``)."""
        stmt = reader.select_rows(after_position=after_position, until_position=until_position)
        return reader.read_row_chunks(self._db, stmt, chunk_size, self._compiled_path)

    def last_event_id(self, worker_id: int) -> int:
        """The worker's newest event id accepted by this log (queued or committed); -1 if none."""
        with self._lock:
            known = self._known_last_id(worker_id)
        return self._last_committed_id(worker_id) if known is None else known

    def last_position(self) -> int:
        """The newest committed row's position; 0 for an empty log."""
        return reader.last_position(self._db)

    def last_position_until(self, event_id: int) -> tuple[int, dict[int, int]]:
        """By the columns: the position of the last row that holds a transition with an id up
        to ``event_id`` (each worker's newest such row, the latest of them; 0 when none does),
        and the id each worker reaches within the bound (``event_id``, or its newest id when
        that is lower). No later row holds one: a worker's ids grow with the position. What
        ``replay --until`` reads up to."""
        return reader.last_position_until(self._db, event_id)

    def tail_start(self, count: int) -> int:
        """The position after which the newest ``count`` events lie (``kvledger tail -n``)."""
        return reader.tail_start(self._db, count)

    def summary(self) -> LogSummary:
        return reader.summary(self._db)

    # -- checkpoints --------------------------------------------------------------------------

    def save_checkpoint(self, position: int, state: RegistryState, max_ts: float) -> bool:
        """Store ``state`` as the fold of every row up to ``position``; False if not stored.

        A log on storage this process cannot write (``writable`` is False) keeps none: a
        checkpoint only saves a later replay time.
        """
        if not self.writable:
            return False
        checkpoints.save_checkpoint(self._db, position, state, max_ts)
        return True

    def latest_checkpoint(
        self,
        *,
        max_position: int | None = None,
        max_event_id: int | None = None,
        max_ts: float | None = None,
    ) -> Checkpoint | None:
        """The newest checkpoint that covers no event beyond the given bounds."""
        return checkpoints.latest_checkpoint(
            self._db, max_position=max_position, max_event_id=max_event_id, max_ts=max_ts
        )


class _Writer:
    """The writer's connection: the driver's own connection and one cursor for its life
    (every call that releases the GIL costs a hand-off, see ``InsertStatements``, and
    SQLAlchemy opens and closes a cursor per statement). A connection that failed is thrown
    away, not given back to the pool."""

    def __init__(self, db: sa.Engine) -> None:
        self._db = db
        self._conn: sa.Connection | None = None

    def __enter__(self) -> _Writer:
        conn = self._conn = self._db.connect()
        self.statements = InsertStatements(conn.dialect.paramstyle, max_params(conn.dialect.name))
        dbapi = conn.connection.dbapi_connection
        assert dbapi is not None
        self.dbapi: Any = dbapi
        self.cursor = dbapi.cursor()
        # SQLite: no implicit BEGIN, so a one-statement batch is its own transaction
        # (``commit``); given back as it was (the connection returns to the pool)
        self.autocommit = conn.dialect.name == "sqlite"
        # PostgreSQL through psycopg 3: COPY, not INSERTs (``copy_rows``)
        self.copy = conn.dialect.name == "postgresql" and hasattr(self.cursor, "copy")
        if self.autocommit:
            self._isolation = dbapi.isolation_level
            dbapi.isolation_level = None
        return self

    def __exit__(self, exc_type: object, *_: object) -> None:
        conn, self._conn = self._conn, None
        assert conn is not None
        if exc_type is not None:
            conn.invalidate()
        elif self.autocommit:
            self.dbapi.isolation_level = self._isolation
        conn.close()

    def commit(self, items: list[BatchItem]) -> None:
        """Run a batch's INSERTs (on PostgreSQL through psycopg 3: one COPY) as one
        transaction and commit it.

        With ``autocommit`` (SQLite with its implicit BEGIN turned off), a batch of one
        statement runs alone: SQLite commits a statement outside a transaction as it
        completes, so the batch costs one call into SQLite where BEGIN, INSERT and COMMIT cost
        three. Each such call gives the GIL to the producer, and getting it back waits up to a
        switch interval (5 ms) while the producer runs: those waits set the writer's pace under
        load, and with it the back-pressure the producer feels. Larger batches (more than
        ``STATEMENT_ROWS`` rows) still get BEGIN and COMMIT around their statements.
        """
        batch = flat(items)
        if not batch:
            return
        cursor = self.cursor
        statements = [] if self.copy else list(self.statements(batch))
        if self.autocommit and len(statements) == 1:
            cursor.execute(*statements[0])
            return
        try:
            if self.copy:
                copy_rows(cursor, batch)
            elif self.autocommit:
                cursor.execute("BEGIN")
            for sql, params in statements:
                cursor.execute(sql, params)
            self.dbapi.commit()
        except BaseException:
            with contextlib.suppress(Exception):  # the connection may be gone already
                self.dbapi.rollback()
            raise


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
