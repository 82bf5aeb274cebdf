"""A log row: the columns an event is stored as, and the multi-row INSERTs that write them.

The writer inserts rows with multi-row ``INSERT ... VALUES (...), (...)`` statements, not
``executemany``: Python's sqlite3 releases the GIL around every row's ``sqlite3_step`` and takes
it back to bind the next row, and with a busy producer thread each take can wait for the
interpreter's switch interval (5 ms), which made a 5,000-row batch take seconds. One statement
per few hundred rows hands the GIL over a few times per batch instead of once per row.

No I/O here: the threaded and the asyncio writer run the statements on their own connections.
"""

from __future__ import annotations

import sqlite3
import struct
from collections.abc import Iterator, Sequence
from itertools import chain
from typing import Any, cast

from kvledger.events.codec import (
    COMPILED_ROWS,
    COMPILED_STORED_ROW_WITHOUT_TOKENS,
    KIND_CODES,
    KIND_NAMES,
    PYTHON_ENCODERS,
    CodecError,
    LogRow,
    encode,
)
from kvledger.events.log.schema import events
from kvledger.events.types import (
    LogRecord,
    Lookup,
    Released,
    RunInfo,
    Stored,
    lookup_stream,
    without_token_ids,
)

Row = LogRow

BatchItem = Row | Sequence[Row]
"""An item of a batch the writer commits: one row, or a block of them (an append buffer's
batch, ``_gather.RowBlock``: its rows in flat memory, read as a sequence of rows)."""


def to_row(event: LogRecord) -> Row:
    """The event as the columns of its log row (the record is encoded, hence validated).

    The hot kinds' rows come whole from the compiled encoders (``codec.COMPILED_ROWS``) where
    they were built; otherwise (those not built, the other kinds, and what the compiled ones
    leave to Python) the Python encoder, without asking the compiled one again, and
    ``row_worker`` inlined on the exact type (what ``encode`` accepts): every appended event
    comes through here, and each extra call or isinstance test on a union cost it a tenth of
    its time."""
    cls = type(event)
    compiled = COMPILED_ROWS.get(cls)
    if compiled is not None:
        row = compiled(event)
        if row is not None:
            return row
    encoder = PYTHON_ENCODERS.get(cls)
    if encoder is None:
        encode(event)  # raises its error
    try:
        payload = encoder(event)  # type: ignore[misc]
    except (OverflowError, TypeError, struct.error) as exc:
        raise CodecError(f"cannot encode {event!r}: {exc}") from None
    if event.ts != event.ts:  # SQLite stores NaN as NULL, which the ts column refuses
        raise CodecError(f"cannot log {event!r}: its ts is NaN, the log's ts column holds numbers")
    worker = event.worker_id
    if cls in _LOOKUP_TYPES:
        worker = lookup_stream(worker)
    return (worker, event.event_id, KIND_NAMES[cls], int(event.tier), event.ts, payload)


_LOOKUP_TYPES = frozenset((Lookup, Released, RunInfo))


def to_row_without_tokens(event: LogRecord) -> Row:
    """``to_row`` with a ``Stored`` event's token ids left out: what a log that must not hold
    prompts stores (the ``token_ids`` setting). Replay needs none of them. The compiled row
    leaves them out as it writes; otherwise the event is copied without them first."""
    if type(event) is Stored:
        compiled = COMPILED_STORED_ROW_WITHOUT_TOKENS
        if compiled is not None:
            row = compiled(event)
            if row is not None:
                return row
        return to_row(without_token_ids(event))
    return to_row(event)


_STORED_WITHOUT_TOKENS = 5  # events/records.h: KIND_STORED_WITHOUT_TOKENS


def compiled_kinds(token_ids: bool) -> dict[type, int]:
    """The record kind (events/records.h) of each event type the compiled encoders write, as
    ``to_row`` would (with ``token_ids`` False, ``to_row_without_tokens``): what an append
    buffer's compiled queue encodes each event with. Empty where the encoders were not built
    or ``KVLEDGER_PYTHON_ENCODERS=1`` turns them off."""
    kinds: dict[type, int] = {cls: KIND_CODES[cls] for cls in COMPILED_ROWS}
    if Stored in kinds and not token_ids:
        if COMPILED_STORED_ROW_WITHOUT_TOKENS is None:
            del kinds[Stored]
        else:
            kinds[Stored] = _STORED_WITHOUT_TOKENS
    return kinds


def flat(batch: Sequence[BatchItem]) -> list[Row]:
    """A batch's rows, one by one (a block's rows made as tuples): what the writers that are
    not the compiled one take."""
    rows: list[Row] = []
    for item in batch:
        if type(item) is tuple:
            rows.append(item)
        else:
            rows.extend(cast(Sequence[Row], item))
    return rows


def row_worker(record: LogRecord) -> int:
    """The ``worker`` column of a record's row: the worker's id for a transition, its lookup
    stream (``lookup_stream``, negative) for a lookup record."""
    if isinstance(record, Lookup | Released | RunInfo):
        return lookup_stream(record.worker_id)
    return record.worker_id


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


def _placeholder(paramstyle: str) -> str:
    if paramstyle == "qmark":
        return "?"
    if paramstyle in ("format", "pyformat"):
        return "%s"
    raise ValueError(f"database driver paramstyle {paramstyle!r} is not supported")


COPY_SQL = f"COPY {events.name} ({', '.join(COLUMNS)}) FROM STDIN (FORMAT BINARY)"
COPY_TYPES = ("int8", "int8", "varchar", "int2", "float8", "bytea")
"""The columns' PostgreSQL types, in ``COLUMNS`` order (``schema.events``)."""


def copy_rows(cursor: Any, batch: list[Row]) -> None:
    """Write ``batch`` with one binary ``COPY ... FROM STDIN`` on a psycopg 3 cursor.

    Measured against the multi-row INSERTs (bench/eventlog_bench.py, the PostgreSQL lines):
    the INSERTs cost the server a parse and a plan per statement and the client a text
    rendering of every parameter; COPY streams the rows in PostgreSQL's binary format,
    written by psycopg's C row writer. The caller commits (the batch is one transaction)."""
    with cursor.copy(COPY_SQL) as copy:
        copy.set_types(COPY_TYPES)
        write_row = copy.write_row
        for row in batch:
            write_row(row)


async def copy_rows_async(cursor: Any, batch: list[Row]) -> None:
    """``copy_rows`` on a psycopg 3 ``AsyncCursor`` (``AsyncEventLog``'s writer): the rows
    are buffered by psycopg and sent as the buffer fills, so an ``await`` a row is cheap."""
    async with cursor.copy(COPY_SQL) as copy:
        copy.set_types(COPY_TYPES)
        write_row = copy.write_row
        for row in batch:
            await write_row(row)
