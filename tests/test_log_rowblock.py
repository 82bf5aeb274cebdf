"""The append buffer's block of rows (events/log/rowblock.h, ``_gather.RowBlock``): a batch's
records in flat memory, read as the sequence of rows ``to_row`` makes; the events no compiled
encoder takes kept as themselves until the log encodes them into the block; its run read off its
arrays; and the compiled SQLite writer binding it as it binds rows (real log files)."""

from __future__ import annotations

import contextlib
import gc
import itertools
import math
import sqlite3
import struct
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, cast

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_event_codec import events

from kvledger.events.log import EventLog
from kvledger.events.log import buffer as buffer_module
from kvledger.events.log.database import compiled_sqlite_path, open_compiled_writer
from kvledger.events.log.rows import (
    COLUMNS,
    BatchItem,
    Row,
    compiled_kinds,
    flat,
    to_row,
    to_row_without_tokens,
)
from kvledger.events.types import (
    LogRecord,
    Lookup,
    Released,
    Removed,
    Stored,
    Tier,
    lookup_stream,
)

with contextlib.suppress(ImportError):  # not built: every test here skips (pytestmark)
    from kvledger.events.log._gather import Gather, RowBlock, run_of

pytestmark = pytest.mark.skipif(
    not buffer_module.COMPILED_GATHER or not compiled_kinds(True),
    reason="the compiled queue or encoders are not built (or are turned off)",
)


def block_of(records: list[LogRecord], *, token_ids: bool = True) -> RowBlock:
    """The block a queue holds after ``records`` were handed to it one by one."""

    def never(*_: object) -> None:
        raise AssertionError("a queue this large never hands over")

    gather = Gather(compiled_kinds(token_ids), 1_000_000, 3600.0, never, lambda _: None, never)
    for record in records:
        gather(record)
    block, kept = gather.take()
    assert kept == [] and len(gather) == 0
    return block


def lookups(worker: int, first: int) -> list[LogRecord]:
    """Lookup records, which no compiled encoder takes."""
    common: dict[str, Any] = {"worker_id": worker, "dp_rank": 0, "tier": Tier.G1, "ts": 2.5}
    return [
        Lookup(
            **common,
            event_id=first,
            request_id=7,
            num_tokens=9,
            start=0,
            sequence_hashes=(1, 2),
            hits=(1, 0, 0),
        ),
        Released(**common, event_id=first + 1, request_id=7),
    ]


def key(row: object) -> object:
    """A row compared by value, its ts by its bits (NaN equals itself then): wide events draw
    every float."""
    if type(row) is not tuple:
        return row
    return (*row[:4], struct.pack("<d", row[4]), row[5])


def keys(rows: Sequence[object]) -> list[object]:
    return [key(row) for row in rows]


def numbered(drawn: list[Any], worker: int = 0, first: int = 0) -> list[LogRecord]:
    return [replace(e, worker_id=worker, event_id=first + i) for i, e in enumerate(drawn)]


STORABLE = st.lists(
    events(wide=True).filter(lambda e: not math.isnan(e.ts)), min_size=1, max_size=40
)
"""Events of every transition kind, up to 40 blocks each (a block's records past its first
4 KiB of room, so it grows), any ts but NaN, which a log row refuses (SQLite stores it as
NULL)."""


@settings(max_examples=60, deadline=None)
@given(drawn=STORABLE, token_ids=st.booleans(), tail=st.booleans())
def test_a_block_reads_as_the_rows_its_events_make(
    drawn: list[Any], token_ids: bool, tail: bool
) -> None:
    records = numbered(drawn) + (lookups(0, len(drawn)) if tail else [])
    make: Callable[[LogRecord], Row] = to_row if token_ids else to_row_without_tokens
    block = block_of(records, token_ids=token_ids)
    encoded = set(compiled_kinds(token_ids))
    assert len(block) == len(records)
    for item, record in zip(block, records, strict=True):
        if type(record) in encoded and type(item) is tuple:
            assert key(item) == key(make(record))
            assert not gc.is_tracked(item)
        else:  # kept as itself: a kind no compiled encoder takes, or one it left to Python
            assert item is record
    assert block.objects_left == sum(type(item) is not tuple for item in block)
    assert key(block[-1]) == key(block[len(block) - 1])
    whole = keys(list(block))
    assert keys(block[1::3]) == whole[1::3] and keys(block[::-1]) == whole[::-1]
    assert block[5:2] == [] and keys(block[-100:100]) == whole
    with pytest.raises(IndexError):
        block[len(block)]
    with pytest.raises(TypeError):
        block["0"]  # type: ignore[call-overload]

    block.encode_objects(make)
    assert block.objects_left == 0
    assert keys(list(block)) == keys([make(record) for record in records])


@given(drawn=st.lists(events(), min_size=1, max_size=8), worker=st.integers(-3, 3))
def test_a_blocks_run_is_its_rows_run(drawn: list[Any], worker: int) -> None:
    """A block reads its runs off its arrays: one worker's consecutive ids are the run
    ``run_of`` finds in the same rows as a list, and there is none while some row is still an
    event (the log encodes those first)."""
    records = numbered(drawn, worker, 40)
    block = block_of(records)
    if block.objects_left:
        assert block.runs() is None
    block = cast(RowBlock, encoded(block))
    run = run_of(list(block))
    assert block.runs() == (run,) and run == (worker, 40, 40 + len(records) - 1)

    gap = cast(RowBlock, encoded(block_of(records + numbered(drawn[:1], worker, 42 + len(drawn)))))
    assert gap.runs() is None
    assert block_of([]).runs() is None


def expected_runs(ids: list[tuple[int, int]]) -> tuple[tuple[int, int, int], ...] | None:
    """``RowBlock.runs``'s answer by its definition: each worker's ids, in the order the
    workers first come, follow each other; at most eight workers."""
    runs: dict[int, list[int]] = {}
    for worker, event_id in ids:
        run = runs.setdefault(worker, [event_id, event_id - 1])
        if event_id != run[1] + 1:
            return None
        run[1] = event_id
    if not runs or len(runs) > 8:
        return None
    return tuple((worker, first, last) for worker, (first, last) in runs.items())


@given(
    ids=st.lists(
        st.tuples(st.integers(-2, 9), st.integers(0, 6)).map(lambda w_e: (w_e[0], w_e[1] + 5)),
        max_size=24,
    ),
    lookup_at=st.integers(0, 24),
)
def test_a_blocks_runs_are_each_workers_run(ids: list[tuple[int, int]], lookup_at: int) -> None:
    """Mostly broken runs from random ids, and now and then real ones (one worker, or a
    worker's transitions with its lookup records between them, as a step logs them)."""
    records: list[LogRecord] = [
        Removed(event_id=e, worker_id=w, dp_rank=0, tier=Tier.G1, ts=1.0, sequence_hashes=(e,))
        for w, e in ids
    ]
    block = encoded(block_of(records))
    assert cast(RowBlock, block).runs() == expected_runs(ids)
    steps = [
        Removed(event_id=i, worker_id=3, dp_rank=0, tier=Tier.G1, ts=1.0, sequence_hashes=(i,))
        for i in range(len(ids) + 1)
    ]
    mixed = [*steps[:lookup_at], *lookups(3, 40), *steps[lookup_at:]]
    both = cast(RowBlock, encoded(block_of(mixed)))
    stream = lookup_stream(3)
    transitions, records_run = (3, 0, len(steps) - 1), (stream, 40, 41)
    first_two = (transitions, records_run) if lookup_at > 0 else (records_run, transitions)
    assert both.runs() == first_two
    assert block_of(mixed).runs() is None  # its lookup records not yet encoded


@pytest.mark.parametrize(
    ("change", "message"), [({"tier": 9}, "tier"), ({"ts": math.nan}, "ts is NaN")]
)
def test_a_bad_event_raises_from_encode_objects_and_the_rows_before_it_stay_encoded(
    change: dict[str, Any], message: str
) -> None:
    good = lookups(0, 0)
    stored = Stored(
        event_id=2, worker_id=0, dp_rank=0, tier=Tier.G1, ts=1.0, parent_hash=None,
        blocks=((1, 2),), token_ids=None,
    )  # fmt: skip
    bad = replace(stored, **change)  # what the compiled encoder leaves to Python
    block = block_of([*good, bad])
    assert block.objects_left == 3
    with pytest.raises(ValueError, match=message):
        block.encode_objects(to_row)
    assert block.objects_left == 1
    assert list(block)[:2] == [to_row(r) for r in good] and block[2] is bad


def encoded(block: RowBlock) -> Sequence[Row]:
    """``block`` with every row encoded: what the log hands its writer."""
    block.encode_objects(to_row)
    assert block.objects_left == 0
    return cast(Sequence[Row], block)


_NAMES = itertools.count()


def new_log(folder: Path) -> Path:
    path = folder / f"events-{next(_NAMES)}.db"
    EventLog(f"sqlite:///{path}").close()
    assert compiled_sqlite_path(f"sqlite:///{path}") == str(path)
    return path


def table(path: Path) -> list[tuple[Any, ...]]:
    with sqlite3.connect(path) as conn:
        return conn.execute(f"SELECT {', '.join(COLUMNS)} FROM events ORDER BY id").fetchall()


@settings(
    max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(drawn=STORABLE, cut=st.integers(0, 40))
def test_the_compiled_writer_binds_blocks_as_it_binds_rows(
    tmp_path: Path, drawn: list[Any], cut: int
) -> None:
    """A batch of rows, blocks and rows again leaves the table the same rows, in order, that
    the batch's rows one by one leave."""
    records = numbered(drawn) + lookups(0, len(drawn))
    cut = min(cut, len(records))
    rows = [to_row(r) for r in records]
    block = encoded(block_of(records[cut:]))
    empty = encoded(block_of([]))
    ours, theirs = new_log(tmp_path), new_log(tmp_path)
    batch: list[BatchItem] = [*rows[:cut], empty, block]
    with open_compiled_writer(str(ours), "batch") as writer:
        writer.commit(batch)
    with open_compiled_writer(str(theirs), "batch") as writer:
        writer.commit(rows)
    assert table(ours) == table(theirs) == [tuple(row) for row in rows]
    assert keys(flat(batch)) == keys(rows)


def test_the_compiled_writer_refuses_a_block_with_events_not_yet_encoded(tmp_path: Path) -> None:
    path = new_log(tmp_path)
    stored = Stored(
        event_id=0, worker_id=0, dp_rank=0, tier=Tier.G1, ts=1.0, parent_hash=None,
        blocks=((1, 2),), token_ids=None,
    )  # fmt: skip
    block = block_of([stored, *lookups(0, 1)])
    with open_compiled_writer(str(path), "batch") as writer:
        unencoded: list[BatchItem] = [to_row(stored), cast(Sequence[Row], block)]  # a bug's
        with pytest.raises(TypeError, match="not yet encoded"):
            writer.commit(unencoded)
        assert table(path) == []  # nothing of the batch
        whole: list[BatchItem] = [encoded(block)]
        writer.commit(whole)
    assert len(table(path)) == 3
