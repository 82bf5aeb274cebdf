"""The event log for asyncio code, on SQLAlchemy's asyncio engine (``sqlite+aiosqlite``,
``postgresql+psycopg``).

Same tables, records, id checks, group commit and back-pressure (``Backlog``) as ``EventLog``;
the writer is a task on the caller's loop instead of a thread, and a backlog at its bound makes
``append`` wait instead of block.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterable
from time import monotonic

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from kvledger.events.codec import decode
from kvledger.events.log import (
    Backlog,
    Durability,
    EventLogError,
    InsertStatements,
    engine_args,
    install_sqlite_pragmas,
    max_params,
    order_error,
    to_row,
    writer_failure,
)
from kvledger.events.schema import SchemaError, check_schema, events, shown_url
from kvledger.events.types import AnyEvent

DEFAULT_ASYNC_URL = "sqlite+aiosqlite:///kvledger-data/events.db"


class AsyncEventLog:
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
    ) -> None:
        self._backlog = Backlog(
            batch_size=batch_size, queue_size=queue_size, max_delay=max_delay, durability=durability
        )
        self.url = url
        self.batch_size = batch_size
        self.queue_size = queue_size
        self.max_delay = max_delay
        self.max_lag = self._backlog.max_lag
        self.create = create
        parsed, kwargs, synchronous = engine_args(url, durability)
        self._engine: AsyncEngine = create_async_engine(parsed, **kwargs)
        if synchronous is not None:
            install_sqlite_pragmas(self._engine.sync_engine, synchronous)
        self._next_ids: dict[int, int] = {}
        self._changed: asyncio.Condition | None = None
        self._writer: asyncio.Task[None] | None = None
        self._closing = False
        self._error: BaseException | None = None

    async def open(self) -> AsyncEventLog:
        """Check (or, for a blank database, create) the schema and start the writer task."""
        try:
            async with self._engine.connect() as conn:
                if not await conn.run_sync(check_schema, self.url):
                    if not self.create:
                        raise SchemaError(f"{shown_url(self.url)} holds no event log")
                    await conn.run_sync(_upgrade, self.url)
                    await conn.commit()
        except BaseException:
            await self._engine.dispose()
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

    def _check_open(self) -> None:
        if self._error is not None:
            raise writer_failure(self._error, self.queue_depth) from self._error
        if self._closing:
            raise EventLogError("the event log is closed")

    @property
    def queue_depth(self) -> int:
        """Events appended and not yet committed (what a crash now would lose)."""
        return self._backlog.appended - self._backlog.committed

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

    async def append(self, event: AnyEvent) -> None:
        await self.append_many((event,))

    async def append_many(self, batch: Iterable[AnyEvent]) -> None:
        """Queue events (checked as a whole first); waits while the backlog is at its bound."""
        rows = [to_row(e) for e in batch]
        cond = self._cond()
        self._check_open()
        next_ids: dict[int, int] = {}
        for worker, event_id, *_ in rows:
            expected = next_ids.get(worker, self._next_ids.get(worker))
            if expected is None:
                expected = await self._last_committed_id(worker) + 1
            if event_id != expected:
                raise order_error(worker, event_id, expected)
            next_ids[worker] = expected + 1
        self._next_ids.update(next_ids)
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
        await self._engine.dispose()
        if self._error is not None:
            raise writer_failure(self._error, self.queue_depth) from self._error

    async def _run_writer(self) -> None:
        cond = self._cond()
        backlog = self._backlog
        try:
            async with self._engine.connect() as conn:
                statements = InsertStatements(
                    conn.dialect.paramstyle, max_params(conn.dialect.name)
                )
                while True:
                    async with cond:
                        while not self._closing:
                            wait = backlog.writer_wait(monotonic())
                            if wait == 0.0:
                                break
                            with contextlib.suppress(TimeoutError):
                                await asyncio.wait_for(cond.wait(), wait)
                        batch = backlog.take()
                        closing = self._closing
                    if batch:
                        for sql, params in statements(batch):
                            await conn.exec_driver_sql(sql, params)
                        await conn.commit()
                        async with cond:
                            backlog.done(len(batch), monotonic())
                            cond.notify_all()
                    elif closing:
                        return
        except BaseException as exc:
            self._error = exc
            async with cond:
                cond.notify_all()

    async def _last_committed_id(self, worker: int) -> int:
        async with self._engine.connect() as conn:
            value = await conn.scalar(
                sa.select(sa.func.max(events.c.event_id)).where(events.c.worker == worker)
            )
        return -1 if value is None else int(value)

    async def last_event_id(self, worker_id: int) -> int:
        expected = self._next_ids.get(worker_id)
        if expected is not None:
            return expected - 1
        return await self._last_committed_id(worker_id)

    async def read(
        self,
        *,
        worker_id: int | None = None,
        after_event_id: int = -1,
        until_event_id: int | None = None,
        until_ts: float | None = None,
    ) -> AsyncIterator[AnyEvent]:
        """Committed events in append order (same bounds as ``EventLog.read``)."""
        c = events.c
        stmt = sa.select(c.id, c.ts, c.payload).order_by(c.id)
        if worker_id is not None:
            stmt = stmt.where(c.worker == worker_id)
        if after_event_id >= 0:
            stmt = stmt.where(c.event_id > after_event_id)
        if until_event_id is not None:
            stmt = stmt.where(c.event_id <= until_event_id)
        async with self._engine.connect() as conn:
            result = await conn.stream(stmt)
            async for position, ts, payload in result:
                if until_ts is not None and ts > until_ts:
                    return
                yield decode(payload, position)


def _upgrade(conn: sa.Connection, url: str) -> None:
    from kvledger.migrations.runner import upgrade

    upgrade(url, connection=conn)
