"""The event log for asyncio code, on SQLAlchemy's asyncio engine (``sqlite+aiosqlite``,
``postgresql+psycopg``).

Same tables, records, id checks, counters, group commit and back-pressure (``core.LogCore``)
as ``EventLog``, and the same row selection (``reader.select_rows``); the writer is a task on
the caller's loop instead of a thread, and a backlog at its bound makes ``append`` wait instead
of block.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from time import monotonic
from typing import Any

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from kvledger.events.codec import decode
from kvledger.events.log import reader
from kvledger.events.log.core import RETRY_FOR, EventLogError, LogCore, Outage, not_yet_committed
from kvledger.events.log.database import Durability, open_async_database
from kvledger.events.log.rows import InsertStatements, Row, copy_rows_async, flat, max_params
from kvledger.events.log.schema import SchemaError, check_schema, shown_url
from kvledger.events.types import AnyEvent, LogRecord, Lookup, Released, RunInfo

DEFAULT_ASYNC_URL = "sqlite+aiosqlite:///kvledger-data/events.db"


class AsyncEventLog(LogCore):
    """``async with AsyncEventLog(url) as log: await log.append(event)``."""

    def __init__(
        self,
        url: str = DEFAULT_ASYNC_URL,
        *,
        batch_size: int = 10_000,
        queue_size: int = 100_000,
        durability: Durability = "batch",
        max_delay: float = 0.05,
        create: bool = True,
        token_ids: bool = True,
        retry_for: float = RETRY_FOR,
    ) -> None:
        super().__init__(
            batch_size=batch_size,
            queue_size=queue_size,
            max_delay=max_delay,
            durability=durability,
            token_ids=token_ids,
            retry_for=retry_for,
        )
        self.url = url
        self.create = create
        self._db: AsyncEngine = open_async_database(url, durability)
        self._changed: asyncio.Condition | None = None
        self._writer: asyncio.Task[None] | None = None

    async def open(self) -> AsyncEventLog:
        """Check (or, for a blank database, create) the schema and start the writer task."""
        try:
            async with self._db.connect() as conn:
                if not await conn.run_sync(check_schema, self.url):
                    if not self.create:
                        raise SchemaError(f"{shown_url(self.url)} holds no event log")
                    await conn.run_sync(_upgrade, self.url)
                    await conn.commit()
        except BaseException:
            await self._db.dispose()
            raise
        self._changed = asyncio.Condition()
        self._writer = asyncio.create_task(self._run_writer(), name="kvledger-async-log-writer")
        return self

    async def __aenter__(self) -> AsyncEventLog:
        return await self.open()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def _cond(self) -> asyncio.Condition:
        if self._changed is None:
            raise EventLogError("the log is not open; use `async with` or `await log.open()`")
        return self._changed

    async def append(self, event: LogRecord) -> None:
        await self.append_many((event,))

    async def append_many(self, batch: Iterable[LogRecord]) -> None:
        """Queue events (checked as a whole first); waits while the backlog is at its bound."""
        rows = [self._to_row(e) for e in batch]
        cond = self._cond()
        self._check_open()
        committed = {w: await self._last_committed_id(w) for w in self._unknown_workers(rows)}
        self._accept_ids(rows, committed)
        backlog = self._backlog
        async with cond:
            start = 0
            while start < len(rows):
                now = monotonic()
                room = backlog.room(now)
                if room < 1:
                    now = await self._wait_for_room(cond)
                    room = backlog.room(now)
                chunk = rows[start : start + room]
                start += len(chunk)
                if backlog.add(chunk, now):
                    cond.notify_all()

    async def _wait_for_room(self, cond: asyncio.Condition) -> float:
        """Back-pressure, as in ``EventLog._wait_for_room`` (``cond`` held)."""
        backlog = self._backlog
        started = now = monotonic()
        backlog.hold()
        try:
            while backlog.room(now) < 1:
                cond.notify_all()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(cond.wait(), self.max_delay)
                self._check_open()
                now = monotonic()
        finally:
            backlog.release(now - started)
        return now

    async def flush(self) -> None:
        cond = self._cond()
        async with cond:
            backlog = self._backlog
            target = backlog.appended
            backlog.waiters += 1
            try:
                while backlog.committed < target:
                    self._check_open()
                    cond.notify_all()
                    await cond.wait()
            finally:
                backlog.waiters -= 1

    async def close(self) -> None:
        if self._writer is not None and not self._closing:
            cond = self._cond()
            async with cond:
                self._closing = True
                cond.notify_all()
            await self._writer
        self._closing = True
        await self._db.dispose()
        self._raise_writer_failure()

    async def _run_writer(self) -> None:
        """The writer task: commit what is queued until closed, riding out a database it
        loses as ``EventLog``'s writer does (``core.Outage``): the batch that failed is
        committed first on the new connection, less the rows the database already holds."""
        cond = self._cond()
        backlog = self._backlog
        outage = Outage(self.url, self.retry_for)
        batch: list[Row] = []  # taken from the backlog, not yet known to be committed
        try:
            while True:
                try:
                    async with self._db.connect() as conn:
                        commit = await _committer(conn)
                        if batch:  # the batch the outage interrupted
                            newest = {w: await _newest_id(conn, w) for w in {r[0] for r in batch}}
                            await conn.rollback()  # (the reads' transaction: the commit's own next)
                            await commit(not_yet_committed(batch, newest))
                            await self._committed(cond, len(batch))
                            batch = []
                        if outage.ended():
                            self.outages += 1
                        while True:
                            async with cond:
                                while not self._closing:
                                    wait = backlog.writer_wait(monotonic())
                                    if wait == 0.0:
                                        break
                                    with contextlib.suppress(TimeoutError):
                                        await asyncio.wait_for(cond.wait(), wait)
                                # this log's own appends: rows one by one, never a block
                                batch = flat(backlog.take()[0])
                                closing = self._closing
                            if batch:
                                await commit(batch)
                                await self._committed(cond, len(batch))
                                batch = []
                            elif closing:
                                return
                except Exception as exc:
                    pause = outage.failed(exc)
                    async with cond:  # a close() wakes the wait; the outage is retried all the same
                        with contextlib.suppress(TimeoutError):
                            await asyncio.wait_for(cond.wait(), pause)
        except BaseException as exc:
            self._error = exc
            async with cond:
                cond.notify_all()

    async def _committed(self, cond: asyncio.Condition, rows: int) -> None:
        async with cond:
            self._backlog.done(rows, monotonic())
            cond.notify_all()

    async def _last_committed_id(self, worker: int) -> int:
        async with self._db.connect() as conn:
            return await _newest_id(conn, worker)

    async def last_event_id(self, worker_id: int) -> int:
        known = self._known_last_id(worker_id)
        return await self._last_committed_id(worker_id) if known is None else known

    async def read(
        self,
        *,
        worker_id: int | None = None,
        after_event_id: int = -1,
        until_event_id: int | None = None,
        until_ts: float | None = None,
    ) -> AsyncIterator[AnyEvent]:
        """Committed events in append order (same bounds as ``EventLog.read``)."""
        stmt = reader.select_rows(
            worker_id=worker_id, after_event_id=after_event_id, until_event_id=until_event_id
        )
        async with self._db.connect() as conn:
            result = await conn.stream(stmt)
            async for position, ts, payload in result:
                if until_ts is not None and ts > until_ts:
                    return
                event = decode(payload, position)
                if not isinstance(event, Lookup | Released | RunInfo):  # transitions only
                    yield event


async def _committer(conn: AsyncConnection) -> Callable[[list[Row]], Awaitable[None]]:
    """How the writer commits a batch on ``conn``, each batch one transaction: on PostgreSQL
    through psycopg 3, one binary COPY on the driver's own connection (``copy_rows_async``,
    the threaded writer's way: measured 8x the INSERTs', bench/eventlog_bench.py --pg-url);
    elsewhere, multi-row INSERTs (``InsertStatements``)."""
    if conn.dialect.name == "postgresql":
        raw = await conn.get_raw_connection()
        driver: Any = raw.driver_connection
        if hasattr(getattr(driver, "cursor_factory", None), "copy"):  # psycopg 3's cursors

            async def copy(batch: list[Row]) -> None:
                try:
                    async with driver.cursor() as cursor:
                        await copy_rows_async(cursor, batch)
                    await driver.commit()
                except BaseException:
                    with contextlib.suppress(Exception):  # the connection may be gone already
                        await driver.rollback()
                    raise

            return copy
    statements = InsertStatements(conn.dialect.paramstyle, max_params(conn.dialect.name))

    async def insert(batch: list[Row]) -> None:
        for sql, params in statements(batch):
            await conn.exec_driver_sql(sql, params)
        await conn.commit()

    return insert


async def _newest_id(conn: AsyncConnection, worker: int) -> int:
    value = await conn.scalar(reader.last_id_query(worker))
    return -1 if value is None else int(value)


def _upgrade(conn: sa.Connection, url: str) -> None:
    # Alembic's command machinery: only a blank database needs it
    from kvledger.migrations.runner import upgrade

    upgrade(url, connection=conn)
