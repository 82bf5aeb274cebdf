"""The append buffer's compiled queue (events/log/_gather.c) against its Python queue, on real
SQLite logs: the same calls leave the same rows, raise the same errors and hand the commit sinks
the same events; and what the compiled queue keeps is what makes it cheap (rows the collector
does not track, no events unless a sink wants them)."""

from __future__ import annotations

import contextlib
import gc
import os
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from switches import python_with

from kvledger.events.log import AppendBuffer, EventLog, EventLogError
from kvledger.events.log import buffer as buffer_module
from kvledger.events.log.event_log import Committed
from kvledger.events.log.rows import to_row
from kvledger.events.types import AnyEvent, Cleared, LogRecord, Removed, Stored, Tier

with contextlib.suppress(ImportError):  # not built: every test here skips (pytestmark)
    from kvledger.events.log._gather import Gather

pytestmark = pytest.mark.skipif(
    not buffer_module.COMPILED_GATHER,
    reason="kvledger.events.log._gather is not built (or KVLEDGER_PYTHON_BUFFER=1)",
)

Op = tuple[str, int]
OPS = st.lists(
    st.tuples(
        st.sampled_from(["add", "extend", "bad", "gap", "cleared", "flush", "sink on", "sink off"]),
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
    next_id = 0
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
        else:
            yield name, []


def run(
    url: str, ops: list[Op], compiled: bool
) -> tuple[list[str], list[AnyEvent], list[Committed]]:
    """The ops through a fresh buffer with one queue or the other: what each call raised, what
    the log holds, and what a commit sink (when on) was handed."""
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
        return raised, list(log.read()), handed
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
