"""The append buffer's compiled queue (events/log/_gather.c) against its Python queue, on real
SQLite logs: the same calls leave the same rows, raise the same errors and hand the commit sinks
the same events; and what the compiled queue keeps is what makes it cheap (rows the collector
does not track, no events unless a sink wants them)."""

from __future__ import annotations

import contextlib
import gc
import os
import sqlite3
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from switches import python_with

from kvledger.events.log import AppendBuffer, EventLog, EventLogError, core
from kvledger.events.log import buffer as buffer_module
from kvledger.events.log.event_log import Committed
from kvledger.events.log.rows import to_row
from kvledger.events.types import AnyEvent, Cleared, LogRecord, Released, Removed, Stored, Tier

with contextlib.suppress(ImportError):  # not built: every test here skips (pytestmark)
    from kvledger.events.log._gather import Gather, run_of

pytestmark = pytest.mark.skipif(
    not buffer_module.COMPILED_GATHER,
    reason="kvledger.events.log._gather is not built (or KVLEDGER_PYTHON_BUFFER=1)",
)

Op = tuple[str, int]
OPS = st.lists(
    st.tuples(
        st.sampled_from(
            ["add", "extend", "bad", "gap", "cleared", "lookup", "flush", "sink on", "sink off"]
        ),
        st.integers(1, 6),
    ),
    max_size=30,
)


def event(eid: int, kind: int) -> LogRecord:
    """Event ``eid`` of worker 0: a stored chain of 1-3 blocks, or a removal."""
    if kind % 3 == 2:
        return Removed(
            event_id=eid, worker_id=0, dp_rank=0, tier=Tier.G1, ts=eid + 0.5, sequence_hashes=(eid,)
        )
    blocks = tuple((eid * 10 + i, i) for i in range(1 + kind % 3))
    return Stored(
        event_id=eid,
        worker_id=0,
        dp_rank=0,
        tier=Tier.G2,
        ts=eid + 0.25,
        parent_hash=None if eid % 2 else eid,
        blocks=blocks,
        token_ids=tuple((eid, i) for i in range(len(blocks))) if eid % 3 == 0 else None,
    )


def calls(ops: list[Op]) -> Iterator[tuple[str, list[LogRecord]]]:
    """The events each op hands over. Good events take the next id; a bad one (a tier no
    record has) and one that skips an id are refused, so the next good one takes its id."""
    next_id = next_lookup = 0
    for name, n in ops:
        if name in ("add", "extend"):
            batch = [event(next_id + i, next_id + i) for i in range(n)]
            next_id += n
            yield name, batch
        elif name == "bad":
            yield "extend", [replace(event(next_id, n), tier=9)]  # type: ignore[arg-type]
        elif name == "gap":
            yield "extend", [event(next_id + 1, n)]
        elif name == "cleared":  # a kind no compiled function encodes: queued as itself
            yield (
                "extend",
                [Cleared(event_id=next_id, worker_id=0, dp_rank=0, tier=Tier.G1, ts=1.0)],
            )
            next_id += 1
        elif name == "lookup":  # lookup records: the worker's second id stream, in between
            batch = [
                Released(event_id=next_lookup + i, worker_id=0, dp_rank=0, tier=Tier.G1, ts=2.0,
                         request_id=i)
                for i in range(n)
            ]  # fmt: skip
            next_lookup += n
            yield "extend", [*batch[:1], event(next_id, n), *batch[1:]]
            next_id += 1
        else:
            yield name, []


def run(
    url: str, ops: list[Op], compiled: bool
) -> tuple[list[str], list[AnyEvent], list[Committed], list[tuple[object, ...]]]:
    """The ops through a fresh buffer with one queue or the other: what each call raised, what
    the log holds, what a commit sink (when on) was handed, and the table's rows."""
    saved = buffer_module.COMPILED_GATHER
    buffer_module.COMPILED_GATHER = compiled
    try:
        log = EventLog(url)
        buffer = AppendBuffer(log, batch_size=4, max_hold=60.0)
    finally:
        buffer_module.COMPILED_GATHER = saved
    assert (buffer._gather is not None) == compiled
    raised: list[str] = []
    handed: list[Committed] = []
    sink = handed.extend
    sink_on = False
    try:
        for name, batch in calls(ops):
            try:
                if name == "add":
                    for one in batch:
                        buffer.add(one)
                elif name == "extend":
                    buffer.extend(batch)
                elif name == "flush":
                    buffer.flush()
                    log.flush()
                elif name == "sink on" and not sink_on:
                    log.flush()  # what the sink sees starts after what is committed now
                    log.on_commit(sink)
                    sink_on = True
                elif name == "sink off" and sink_on:
                    log.flush()
                    log.off_commit(sink)
                    sink_on = False
            except ValueError as exc:
                raised.append(f"{type(exc).__name__}: {exc}")
        try:
            buffer.close()
        except ValueError as exc:
            raised.append(f"{type(exc).__name__}: {exc}")
        log.flush()
        with sqlite3.connect(url.removeprefix("sqlite:///")) as conn:  # lookup records too
            table = conn.execute("SELECT worker, event_id, kind, payload FROM events ORDER BY id")
            rows = table.fetchall()
        return raised, list(log.read()), handed, rows
    finally:
        log.close()


@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(ops=OPS)
def test_the_compiled_queue_does_what_the_python_queue_does(tmp_path: Path, ops: list[Op]) -> None:
    runs = [
        run(f"sqlite:///{tmp_path}/{os.urandom(6).hex()}.db", ops, compiled)
        for compiled in (True, False)
    ]
    compiled, python = runs
    assert compiled[0] == python[0]  # the same errors, from the same calls
    assert compiled[1] == python[1]  # the same log
    assert compiled[2] == python[2]  # the same events and records to the sink
    assert compiled[3] == python[3]  # the same rows, lookup records included


def test_rows_the_queue_keeps_are_not_tracked_by_the_collector() -> None:
    """The compiled row of a hot kind holds only ints, a str, a float and bytes: untracked from
    the start, so rows waiting for their commit never enter a young collection."""
    for one in (event(0, 0), event(2, 2)):
        row = to_row(one)
        assert row is not None and not gc.is_tracked(row)


def test_the_queue_keeps_events_only_while_the_log_has_commit_sinks(log_url: str) -> None:
    with EventLog(log_url) as log:
        buffer = AppendBuffer(log, batch_size=100, max_hold=60.0)
        gather = buffer._gather
        assert gather is not None and not gather.keep_events
        buffer.extend([event(0, 0), event(1, 1)])  # rows only
        handed: list[Committed] = []
        sink = handed.extend
        log.on_commit(sink)
        assert gather.keep_events
        buffer.extend([event(2, 2)])  # kept beside its row from now on
        items, events = gather.take()
        assert [type(item) for item in items] == [tuple, tuple, tuple]
        assert events == [event(2, 2)]
        log._append_items(items, events, wait=True)  # what a hand-over does with them
        log.flush()
        # the two rows queued before the sink came reach it too, decoded from their records
        assert [e for e, _ in handed] == [event(0, 0), event(1, 1), event(2, 2)]
        assert [record for _, record in handed] == [to_row(event(i, i))[5] for i in range(3)]
        log.off_commit(sink)
        assert not gather.keep_events
        buffer.close()


def test_a_closed_buffer_refuses_through_the_compiled_call(log_url: str) -> None:
    with EventLog(log_url) as log:
        buffer = AppendBuffer(log)
        buffer.add(event(0, 0))
        buffer.close()
        with pytest.raises(EventLogError, match="append buffer is closed"):
            buffer.add(event(1, 1))
        with pytest.raises(EventLogError, match="append buffer is closed"):
            buffer.extend([event(1, 1)])
        log.flush()
        assert list(log.read()) == [event(0, 0)]


def test_the_queue_refuses_bad_arguments() -> None:
    def nothing(*_: object) -> None:
        return None

    with pytest.raises(ValueError, match="batch_size"):
        Gather({}, 0, 1.0, nothing, nothing, nothing)
    with pytest.raises(ValueError, match="max_hold"):
        Gather({}, 1, 0.0, nothing, nothing, nothing)
    with pytest.raises(TypeError, match="callables"):
        Gather({}, 1, 1.0, None, nothing, nothing)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        Gather([], 1, 1.0, nothing, nothing, nothing)  # type: ignore[arg-type]
    gather = Gather({}, 8, 60.0, nothing, nothing, nothing)
    with pytest.raises(TypeError, match="sequence"):
        gather.extend(5)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        gather()  # type: ignore[call-arg]


def test_kvledger_python_buffer_turns_the_compiled_queue_off() -> None:
    code = "from kvledger.events.log import buffer; print(buffer.COMPILED_GATHER)"
    for value, expected in (("1", "False"), ("0", "True")):
        out = python_with("KVLEDGER_PYTHON_BUFFER", value, code).stdout.strip()
        assert out == expected


def expected_run(rows: object) -> tuple[int, int, int] | None:
    """``run_of``'s answer, by its definition: a non-empty list of six-tuples whose worker and
    event id are plain ints in the int64 range, one worker, each id the one before plus one."""
    if type(rows) is not list or not rows:
        return None
    for row in rows:
        if type(row) is not tuple or len(row) != 6:
            return None
        if not all(type(v) is int and -(2**63) <= v < 2**63 for v in row[:2]):
            return None
    worker, first = rows[0][0], rows[0][1]
    if any(r[0] != worker or r[1] != first + i for i, r in enumerate(rows)):
        return None
    return worker, first, rows[-1][1]


ID = st.one_of(
    st.integers(-3, 12),
    st.sampled_from([2**63 - 2, 2**63 - 1, 2**63, -(2**63), -(2**63) - 1]),
    st.sampled_from([True, 1.0, "1", None]),
)
ROW = st.tuples(st.one_of(st.integers(0, 2), st.sampled_from([False, 2**64])), ID).map(
    lambda w_e: (w_e[0], w_e[1], "stored", 1, 0.0, b"x")
)


@st.composite
def batches(draw: st.DrawFn) -> object:
    """Mostly runs (one worker, consecutive ids from anywhere, the int64 edge included), with
    a row changed here and there, and now and then something that is not a list of rows."""
    kind = draw(st.sampled_from(["run", "run", "run", "rows", "odd"]))
    if kind == "odd":
        return draw(st.sampled_from([(), [], [()], [(1, 2)], ((1, 2, "s", 1, 0.0, b""),), [1]]))
    if kind == "rows":
        return draw(st.lists(ROW, min_size=1, max_size=6))
    worker = draw(st.integers(0, 3))
    first = draw(st.one_of(st.integers(0, 100), st.integers(2**63 - 6, 2**63 - 1)))
    n = draw(st.integers(1, 6))
    rows: list[tuple[object, ...]] = [(worker, first + i, "stored", 1, 0.0, b"x") for i in range(n)]
    at = draw(st.integers(0, n - 1))
    change = draw(st.sampled_from(["none", "none", "row", "worker", "id"]))
    if change == "row":
        rows[at] = draw(ROW)
    elif change == "worker":  # its id still in the run
        rows[at] = (draw(st.sampled_from([worker + 1, True, 2**64])), *rows[at][1:])
    elif change == "id":  # its worker's, the id a repeat, a skip or not an int
        shift = draw(st.sampled_from([-1, 0, 1, 2]))
        wrong = draw(st.sampled_from([first + at + shift, float(first + at)]))
        rows[at] = (worker, wrong, *rows[at][2:])
    return rows


@given(rows=batches())
def test_run_of_is_a_run_exactly_when_its_definition_holds(rows: object) -> None:
    assert run_of(rows) == expected_run(rows)


@given(rows=batches(), known=st.integers(0, 102))
@settings(suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_the_logs_batch_check_takes_what_the_python_loop_takes(
    tmp_path: Path, rows: object, known: int
) -> None:
    """The log's id check of a batch (its run check, then the general one where that says no)
    with the compiled run and with the Python loop: the same batches taken, the same refused
    with the same message, the same next ids after."""
    if (
        type(rows) is not list
        or not rows
        or not all(type(r) is tuple and len(r) == 6 for r in rows)
    ):
        return  # not a batch of rows: the log never checks such a thing
    with EventLog(str(tmp_path / f"run{known}.db")) as log:
        outcomes = []
        for compiled in (True, False):
            log._next_ids = {0: known, 1: known, 3: 2**63 - 6}
            saved = core.run_of
            core.run_of = saved if compiled else None
            try:
                if not log._accept_run(rows):
                    log._accept_ids(rows, log._committed_ids(rows))
                outcome = "taken"
            except (ValueError, TypeError, OverflowError) as exc:
                outcome = f"{type(exc).__name__}: {exc}"
            finally:
                core.run_of = saved
            outcomes.append((outcome, dict(log._next_ids)))
        assert outcomes[0] == outcomes[1]


def test_kvledger_python_buffer_turns_the_compiled_run_check_off() -> None:
    code = "from kvledger.events.log import core; print(core.run_of is None)"
    for value, expected in (("1", "True"), ("0", "False")):
        assert python_with("KVLEDGER_PYTHON_BUFFER", value, code).stdout.strip() == expected
