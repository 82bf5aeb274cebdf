"""The durable event log: group-committed appends, ordered reads, checkpoints.

Appends cost the caller an encode and a list append; a writer thread takes everything queued
and commits it in one transaction (group commit), so the engine's hot path never waits for
the disk unless the queue is full, in which case it waits rather than drop anything.

Reads stream rows in append order (the row id) and decode them. Each worker's event ids are
checked on append to be contiguous, so a log only ever holds what replay can fold.
"""

from __future__ import annotations

import atexit
import sys
import threading
import time
import weakref
from collections.abc import Generator, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

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
        return parsed, {"connect_args": {"timeout": 30}}, _SQLITE_SYNC[durability]
    if backend == "postgresql":
        # libpq options from the URL (e.g. a search_path) are kept, with ours after them.
        given = parsed.query.get("options", "")
        given = given if isinstance(given, str) else " ".join(given)
        options = f"{given} -c synchronous_commit={_PG_SYNC[durability]}".strip()
        return (
            parsed.difference_update_query(["options"]),
            {"connect_args": {"options": options}},
            None,
        )
    return parsed, {}, None


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


def insert_sql(paramstyle: str) -> str:
    """The positional INSERT for one row, in the driver's own parameter style.

    Rows go to ``executemany`` as plain tuples: the same call the raw-sqlite3 benchmark makes.
    """
    cols = ("worker", "event_id", "kind", "tier", "ts", "payload")
    ph = _placeholder(paramstyle)
    return f"INSERT INTO {events.name} ({', '.join(cols)}) VALUES ({', '.join([ph] * len(cols))})"


def check_queue_sizes(batch_size: int, queue_size: int) -> None:
    """The writer wakes every ``batch_size`` events, so the queue must hold at least one batch."""
    if batch_size < 1 or queue_size < batch_size:
        raise ValueError(
            f"need 1 <= batch_size <= queue_size, got batch_size={batch_size}, "
            f"queue_size={queue_size}"
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

    ``batch_size``: queued events that wake the writer early (and rows per executemany);
    ``queue_size``: queued events beyond which ``append`` blocks; ``max_delay``: longest an
    appended event waits before the writer commits it; ``durability``: "batch" (a committed
    batch survives the process dying), "fsync" (also survives the machine dying), "none".
    ``read_only`` opens an existing log without a writer.
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
        check_queue_sizes(batch_size, queue_size)
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
        self._engine = make_engine(self.url, durability)
        try:
            self._open_schema(create and not read_only)
        except BaseException:
            self._engine.dispose()
            raise
        self._insert_sql = insert_sql(self._engine.dialect.paramstyle)
        self._lock = threading.Lock()
        self._wake_writer = threading.Condition(self._lock)
        self._not_full = threading.Condition(self._lock)
        self._committed_cv = threading.Condition(self._lock)
        self._pending: list[Row] = []
        self._next_ids: dict[int, int] = {}
        self._appended = 0
        self._committed = 0
        self._flush_requested = False
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
        """Queue one event; blocks while the queue is full. Usable as an emitter's sink."""
        row = to_row(event)
        with self._lock:
            self._check_open()
            expected = self._next_ids.get(event.worker_id)
            if expected is None:
                expected = self._last_committed_id(event.worker_id) + 1
            if event.event_id != expected:
                raise order_error(event.worker_id, event.event_id, expected)
            while len(self._pending) >= self.queue_size:
                self._wake_writer.notify()
                self._not_full.wait(0.1)
                self._check_open()
            self._next_ids[event.worker_id] = expected + 1
            pending = self._pending
            pending.append(row)
            self._appended += 1
            if len(pending) == self.batch_size:
                self._wake_writer.notify()

    def append_many(self, batch: Iterable[AnyEvent]) -> None:
        """Queue several events (checked as a whole before any is queued)."""
        rows = [to_row(e) for e in batch]
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
                room = self.queue_size - len(self._pending)
                if room <= 0:
                    self._wake_writer.notify()
                    self._not_full.wait(0.1)
                    self._check_open()
                    continue
                chunk = rows[start : start + room]
                self._pending.extend(chunk)
                self._appended += len(chunk)
                start += len(chunk)
                if len(self._pending) >= self.batch_size:
                    self._wake_writer.notify()

    def _last_committed_id(self, worker: int) -> int:
        with self._engine.connect() as conn:
            value = conn.execute(
                sa.select(sa.func.max(events.c.event_id)).where(events.c.worker == worker)
            ).scalar()
        return -1 if value is None else int(value)

    def _check_open(self) -> None:
        if self._error is not None:
            raise EventLogError(
                f"the event log writer failed ({type(self._error).__name__}: {self._error}); "
                f"{self._appended - self._committed} appended events were not stored"
            ) from self._error
        if self._closing or self._closed:
            raise EventLogError("the event log is closed")
        if self.read_only:
            raise EventLogError(f"{shown_url(self.url)} was opened read-only")

    @property
    def queue_depth(self) -> int:
        """Events appended and not yet committed (what a crash now would lose)."""
        return self._appended - self._committed

    def flush(self) -> None:
        """Return once everything appended so far is committed."""
        if self._writer is None:
            return
        with self._lock:
            target = self._appended
            while self._committed < target:
                if self._error is not None:
                    self._check_open()
                self._flush_requested = True
                self._wake_writer.notify()
                self._committed_cv.wait(0.1)

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
            raise EventLogError(
                f"the event log writer failed ({type(self._error).__name__}: {self._error}); "
                f"{self._appended - self._committed} appended events were not stored"
            ) from self._error

    def __enter__(self) -> EventLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _run_writer(self) -> None:
        try:
            with self._engine.connect() as conn:
                while True:
                    with self._lock:
                        if not (self._pending or self._closing or self._flush_requested):
                            self._wake_writer.wait(self.max_delay)
                        batch, self._pending = self._pending, []
                        self._flush_requested = False
                        closing = self._closing
                        self._not_full.notify_all()
                    if batch:
                        self._write(conn, batch)
                        with self._lock:
                            self._committed += len(batch)
                            self._committed_cv.notify_all()
                    elif closing:
                        return
        except BaseException as exc:
            with self._lock:
                self._error = exc
                self._not_full.notify_all()
                self._committed_cv.notify_all()

    def _write(self, conn: sa.Connection, batch: list[Row]) -> None:
        size = self.batch_size
        for start in range(0, len(batch), size):
            conn.exec_driver_sql(self._insert_sql, batch[start : start + size])
        conn.commit()

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

    def save_checkpoint(self, position: int, state: RegistryState, max_ts: float) -> None:
        """Store ``state`` as the fold of every row up to ``position``.

        One there already is replaced: it holds the same fold, unless it was written in an
        older snapshot format, which this heals.
        """
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
