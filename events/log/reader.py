"""Reading the log: one chunked reader that every read of the threaded log goes through, the
row selection the asyncio log shares, and the summary and positions ``inspect`` shows.

Rows come in append order (the row id, a row's *position*). The event-id bounds apply to each
worker's own ids, so without ``worker_id`` they select every worker's events
``after_event_id < id <= until_event_id``.
"""

from __future__ import annotations

from collections.abc import Generator, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt
import sqlalchemy as sa

from kvledger.events.chunk_decode import join_records
from kvledger.events.codec import decode
from kvledger.events.log.database import open_compiled_reader
from kvledger.events.log.schema import checkpoints, events
from kvledger.events.types import AnyEvent, LogRecord, Lookup, Released, RunInfo, Tier

READ_CHUNK = 10_000


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


def select_rows(
    *,
    worker_id: int | None = None,
    after_event_id: int = -1,
    until_event_id: int | None = None,
    after_position: int = 0,
    until_position: int | None = None,
    columns: Sequence[str] = ("id", "ts", "payload"),
    lookups_only: bool = False,
) -> sa.Select[Any]:
    """The rows within the bounds, in append order, as ``columns``; with ``lookups_only``,
    only lookup records (stored under negative ``worker`` keys, see ``types.lookup_stream``)."""
    c = events.c
    stmt = sa.select(*(c[name] for name in columns)).order_by(c.id)
    if lookups_only:
        stmt = stmt.where(c.worker < 0)
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
    return stmt


def literal_sql(stmt: sa.Select[Any], bind: sa.Engine | sa.Connection) -> str:
    """``stmt`` as SQL text with its bounds inlined, for a cursor of the driver's own (or the
    compiled reader's): every bound is an int, so inlining them as literals is exact and
    safe."""
    return str(stmt.compile(bind, compile_kwargs={"literal_binds": True}))


def read_chunks(
    db: sa.Engine, stmt: sa.Select[Any], chunk_size: int = READ_CHUNK
) -> Generator[list[tuple[Any, ...]], None, None]:
    """The rows of ``stmt`` in lists of up to ``chunk_size``: what replay folds a list at a time.

    On SQLite the Core statement runs on the connection's own sqlite3 cursor and yields plain
    tuples: wrapping each row in a ``Row`` would cost replay half its speed. Other databases
    stream through a server-side cursor, so a long log is never loaded whole.
    """
    with db.connect() as conn:
        if conn.dialect.name == "sqlite":
            sql = literal_sql(stmt, conn)
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


@dataclass(frozen=True, slots=True)
class RowChunk:
    """Rows ``(position, ts, payload)`` in append order, as arrays over one buffer of the
    payloads end to end: what replay folds a chunk at a time (``chunk_decode.decode_joined``
    reads the records where they lie). Row ``i``'s payload is ``buf[starts[i]:ends[i]]`` and
    ``crcs[i]`` its CRC-32. A slice shares the buffer.

    Replay's compiled reader (``_sqlite.c``) builds one without a Python object per row;
    ``from_rows`` builds one from the tuples any other reader gives."""

    positions: npt.NDArray[np.int64]
    ts: npt.NDArray[np.float64]
    buf: bytes
    starts: npt.NDArray[np.int64]
    ends: npt.NDArray[np.int64]
    crcs: npt.NDArray[np.uint32]

    @classmethod
    def from_rows(cls, rows: Sequence[tuple[int, float, bytes]]) -> RowChunk:
        n = len(rows)
        buf, starts, ends, crcs = join_records([row[2] for row in rows])
        return cls(
            np.fromiter((row[0] for row in rows), np.int64, n),
            np.fromiter((row[1] for row in rows), np.float64, n),
            buf,
            starts,
            ends,
            crcs,
        )

    @classmethod
    def from_buffers(
        cls, positions: bytes, ts: bytes, buf: bytes, ends: bytes, crcs: bytes
    ) -> RowChunk:
        """From the compiled reader's five buffers (native-endian int64, float64, the
        payloads, int64 end offsets, uint32 CRCs)."""
        end = np.frombuffer(ends, np.int64)
        starts = np.empty_like(end)
        starts[0] = 0
        starts[1:] = end[:-1]
        return cls(
            np.frombuffer(positions, np.int64),
            np.frombuffer(ts, np.float64),
            buf,
            starts,
            end,
            np.frombuffer(crcs, np.uint32),
        )

    def __len__(self) -> int:
        return len(self.positions)

    def __getitem__(self, rows: slice) -> RowChunk:
        return RowChunk(
            self.positions[rows], self.ts[rows], self.buf, self.starts[rows], self.ends[rows],
            self.crcs[rows],
        )  # fmt: skip

    def row(self, i: int) -> tuple[int, float, bytes]:
        return (
            int(self.positions[i]),
            float(self.ts[i]),
            self.buf[int(self.starts[i]) : int(self.ends[i])],
        )

    def rows(self) -> Iterator[tuple[int, float, bytes]]:
        """Each row as the tuple ``(position, ts, payload)`` (the record-by-record path)."""
        buf = self.buf
        for position, ts, start, end in zip(
            self.positions.tolist(), self.ts.tolist(), self.starts.tolist(), self.ends.tolist(),
            strict=True,
        ):  # fmt: skip
            yield position, ts, buf[start:end]


def read_row_chunks(
    db: sa.Engine, stmt: sa.Select[Any], chunk_size: int = READ_CHUNK, path: str | None = None
) -> Generator[RowChunk, None, None]:
    """``read_chunks`` of ``(id, ts, payload)`` rows as ``RowChunk``s. With ``path`` (the log's
    SQLite file, where the compiled reader is built: ``database.compiled_sqlite_path``), the
    compiled reader steps the rows on a read-only connection of its own; a file it cannot
    open so (on a read-only mount without its ``-shm``, say) is read through ``db``."""
    reader = None
    if path is not None:
        reader = open_compiled_reader(path, literal_sql(stmt, db))
    if reader is None:
        for rows in read_chunks(db, stmt, chunk_size):
            yield RowChunk.from_rows(rows)
        return
    with reader:
        while (buffers := reader.read(chunk_size)) is not None:
            yield RowChunk.from_buffers(*buffers)


def decode_rows(
    rows: Iterable[tuple[Any, ...]], until_ts: float | None = None
) -> Iterator[tuple[int, AnyEvent]]:
    """(position, event) for (position, ts, payload) rows, up to the first stamped after
    ``until_ts`` (a prefix of the log, not a filter); lookup records are left out."""
    for position, record in decode_records(rows, until_ts):
        if not isinstance(record, Lookup | Released | RunInfo):
            yield position, record


def decode_records(
    rows: Iterable[tuple[Any, ...]], until_ts: float | None = None
) -> Iterator[tuple[int, LogRecord]]:
    """``decode_rows`` with the lookup records in."""
    for position, ts, payload in rows:
        if until_ts is not None and ts > until_ts:
            return
        yield position, decode(payload, position)


def last_id_query(worker: int) -> sa.Select[Any]:
    """The worker's newest committed event id (NULL when it has none)."""
    return sa.select(sa.func.max(events.c.event_id)).where(events.c.worker == worker)


def last_position(db: sa.Engine) -> int:
    """The newest committed row's position; 0 for an empty log."""
    with db.connect() as conn:
        value = conn.execute(sa.select(sa.func.max(events.c.id))).scalar()
    return 0 if value is None else int(value)


def tail_start(db: sa.Engine, count: int) -> int:
    """The position after which the newest ``count`` transitions lie (lookup records, which
    ``read`` leaves out, not counted); 0 when the log holds fewer."""
    c = events.c
    if count <= 0:
        return last_position(db)
    stmt = sa.select(c.id).where(c.worker >= 0).order_by(c.id.desc()).offset(count - 1).limit(1)
    with db.connect() as conn:
        value = conn.execute(stmt).scalar()
    return 0 if value is None else int(value) - 1


def summary(db: sa.Engine) -> LogSummary:
    """Row counts by kind and tier, each worker's id range, positions, times and checkpoints."""
    c = events.c
    out = LogSummary()
    with db.connect() as conn:
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
            sa.select(c.worker, sa.func.count(), sa.func.min(c.event_id), sa.func.max(c.event_id))
            .where(c.worker >= 0)  # lookup streams are counted under their kinds
            .group_by(c.worker)
        ):
            out.workers[int(worker)] = (int(n), int(lo), int(hi))
        out.checkpoints = [
            int(p)
            for p in conn.execute(
                sa.select(checkpoints.c.position).order_by(checkpoints.c.position)
            ).scalars()
        ]
    return out


_WORKERS = sa.text(
    # each worker (not the lookup streams, whose keys are negative) by one index seek apiece:
    # a skip scan of the (worker, event_id) unique index, where DISTINCT would read it whole
    "WITH RECURSIVE w(worker) AS ("
    " SELECT min(worker) FROM events WHERE worker >= 0"
    " UNION ALL"
    " SELECT (SELECT min(worker) FROM events WHERE worker > w.worker) FROM w"
    " WHERE w.worker IS NOT NULL"
    ") SELECT worker FROM w WHERE worker IS NOT NULL"
)


def last_position_until(db: sa.Engine, event_id: int) -> tuple[int, dict[int, int]]:
    """By the columns: the position of the last row holding a transition with an id up to
    ``event_id`` (0 when none does), and the id each worker reaches within the bound: its
    newest id, or ``event_id`` when it goes further. Two index seeks per worker (``(worker,
    event_id)`` is unique and indexed)."""
    c = events.c
    newest = 0
    ids: dict[int, int] = {}
    with db.connect() as conn:
        workers = [int(w) for (w,) in conn.execute(_WORKERS)]
        for worker in workers:
            row = conn.execute(
                sa.select(c.id, c.event_id)
                .where(c.worker == worker, c.event_id <= event_id)
                .order_by(c.event_id.desc())
                .limit(1)
            ).first()
            if row is not None:
                newest = max(newest, int(row[0]))
                top = conn.execute(sa.select(sa.func.max(c.event_id)).where(c.worker == worker))
                ids[worker] = min(event_id, int(top.scalar_one()))
    return newest, ids
