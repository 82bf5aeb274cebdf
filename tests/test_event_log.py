"""The durable event log on real databases: a SQLite file and the PostgreSQL server.

Every test here runs against both backends (the ``backend`` fixture), so the two pass the
same module.
"""

from __future__ import annotations

import asyncio
import math
import re
import sqlite3
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import cast

import pytest
import sqlalchemy as sa
from event_streams import tee
from services import hold_write_lock, tiny_tmpfs

from kvledger.events.codec import CodecError
from kvledger.events.log import EventLog, EventLogError
from kvledger.events.log.database import compiled_sqlite_path
from kvledger.events.log.replay import replay, replay_report, verify
from kvledger.events.log.schema import SchemaError
from kvledger.events.types import AnyEvent, BlockInfo, Removed, Stored, Tier
from kvledger.migrations import runner
from kvledger.registry.emitter import EventEmitter
from kvledger.registry.state import EventOrderError, RegistryState


def emit_some(emitter: EventEmitter, n: int, start: int = 0) -> None:
    """Stored runs, removals and offloads, in a pattern that leaves a non-trivial state."""
    for i in range(start, start + n):
        emitter.stored(Tier.G1, None if i % 4 == 0 else i - 1, [(i, i * 7 + 1)])
        if i % 3 == 0:
            emitter.removed(Tier.G1, [i])
        if i % 5 == 0:
            emitter.copied(Tier.G1, Tier.G2, [BlockInfo(i, i * 7 + 1, None)])


class Clock:
    """A deterministic timestamp source (one second per event)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        self.now += 1.0
        return self.now


def test_append_read_flush_in_order(log_url: str) -> None:
    seen: list[AnyEvent] = []
    with EventLog(log_url, batch_size=7, queue_size=50) as log:
        for worker in (0, 1):
            emitter = EventEmitter(tee(log.append, seen.append), worker_id=worker)
            emit_some(emitter, 40)
        log.flush()
        assert list(log.read()) == seen
        assert list(log.read(worker_id=1)) == [e for e in seen if e.worker_id == 1]
        assert list(log.read(worker_id=0, after_event_id=5, until_event_id=9)) == [
            e for e in seen if e.worker_id == 0 and 5 < e.event_id <= 9
        ]
        assert log.last_event_id(0) == max(e.event_id for e in seen if e.worker_id == 0)
        assert log.last_event_id(7) == -1
    with EventLog(log_url, read_only=True) as again:
        assert list(again.read()) == seen
        assert again.last_event_id(1) == max(e.event_id for e in seen if e.worker_id == 1)
        summary = again.summary()
        assert summary.rows == len(seen)
        assert set(summary.workers) == {0, 1}
        assert sum(summary.by_kind_tier.values()) == len(seen)


def test_append_many_and_until_ts(log_url: str) -> None:
    batch: list[AnyEvent] = []
    emit_some(EventEmitter(batch.append, clock=Clock()), 30)
    with EventLog(log_url) as log:
        log.append_many(batch)
        log.flush()
        cut = batch[len(batch) // 2].ts
        assert list(log.read(until_ts=cut)) == [e for e in batch if e.ts <= cut]
        assert replay(log, until_ts=cut) == RegistryState.from_events(
            e for e in batch if e.ts <= cut
        )


def test_close_commits_and_is_idempotent(log_url: str) -> None:
    log = EventLog(log_url, max_delay=10.0)
    emit_some(EventEmitter(log.append), 10)
    log.close()
    log.close()
    with pytest.raises(EventLogError, match="closed"):
        log.append(
            Removed(event_id=99, worker_id=0, dp_rank=0, tier=Tier.G1, ts=0.0, sequence_hashes=(1,))
        )
    with EventLog(log_url, read_only=True) as reader:
        assert reader.last_event_id(0) >= 9


@pytest.mark.parametrize("bad_id", [0, 2, 5])
def test_repeats_and_gaps_are_refused_and_the_log_goes_on(log_url: str, bad_id: int) -> None:
    with EventLog(log_url) as log:
        emitter = EventEmitter(log.append)
        for i in range(3):
            emitter.stored(Tier.G1, None, [(i, i)])
        event = Removed(
            event_id=bad_id, worker_id=0, dp_rank=0, tier=Tier.G1, ts=0.0, sequence_hashes=(1,)
        )
        with pytest.raises(ValueError, match=f"worker 0: event {bad_id} .*expects event 3 next"):
            log.append(event)
        with pytest.raises(ValueError, match=f"event {bad_id} .*expects event 4 next"):
            log.append_many(
                [
                    Removed(
                        event_id=3,
                        worker_id=0,
                        dp_rank=0,
                        tier=Tier.G1,
                        ts=0.0,
                        sequence_hashes=(1,),
                    ),
                    event,
                ]
            )
        emitter.removed(Tier.G1, [1])  # id 3: nothing of the refused batch was queued
        log.flush()
        assert [e.event_id for e in log.read()] == [0, 1, 2, 3]


def test_a_batch_mixing_workers_is_checked_per_worker(log_url: str) -> None:
    """``append_many`` takes an emitter's run of one worker by a short path; a batch that
    mixes workers, or brings one the log has not seen, is checked worker by worker, and
    nothing of a refused batch is queued."""

    def removed(worker: int, event_id: int) -> Removed:
        return Removed(
            event_id=event_id, worker_id=worker, dp_rank=0, tier=Tier.G1, ts=0.0,
            sequence_hashes=(event_id,),
        )  # fmt: skip

    with EventLog(log_url) as log:
        log.append_many([removed(0, 0), removed(0, 1)])
        log.append_many([removed(0, 2), removed(1, 0), removed(0, 3)])  # worker 1 is new
        with pytest.raises(ValueError, match=r"worker 1: event 2 leaves a gap.*expects event 1"):
            log.append_many([removed(0, 4), removed(1, 2)])
        with pytest.raises(ValueError, match=r"worker 0: event 3 repeats.*expects event 4"):
            log.append_many([removed(1, 1), removed(0, 3)])
        log.append_many([removed(1, 1), removed(0, 4)])
        log.flush()
        assert [(e.worker_id, e.event_id) for e in log.read()] == [
            (0, 0), (0, 1), (0, 2), (1, 0), (0, 3), (1, 1), (0, 4)
        ]  # fmt: skip


def test_bad_event_is_refused_at_append(log_url: str) -> None:
    with EventLog(log_url) as log:
        bad = Stored(
            event_id=0,
            worker_id=0,
            dp_rank=0,
            tier=Tier.G1,
            ts=0.0,
            parent_hash=None,
            blocks=((1.5, 1),),  # type: ignore[arg-type]
        )
        with pytest.raises(CodecError):
            log.append(bad)
        EventEmitter(log.append).removed(Tier.G1, [1])
        log.flush()
        assert log.last_event_id(0) == 0


def test_a_nan_ts_is_refused_at_append_and_the_log_goes_on(log_url: str) -> None:
    """SQLite stores a NaN as NULL, which the ts column refuses: an event with a NaN ts used to
    reach the writer, which failed and lost the rest of its batch with it."""
    with EventLog(log_url) as log:
        emitter = EventEmitter(log.append)
        emitter.removed(Tier.G1, [1])
        nan = Removed(
            event_id=1, worker_id=0, dp_rank=0, tier=Tier.G1, ts=math.nan, sequence_hashes=(2,)
        )
        with pytest.raises(CodecError, match="ts is NaN"):
            log.append(nan)
        emitter.removed(Tier.G1, [3])
        log.flush()
        assert [e.event_id for e in log.read()] == [0, 1]


@pytest.mark.parametrize("durability", ["batch", "fsync", "none"])
def test_durability_modes(new_log_url: Callable[[], str], durability: str) -> None:
    url = new_log_url()
    with EventLog(url, durability=durability) as log:  # type: ignore[arg-type]
        emit_some(EventEmitter(log.append), 5)
    assert replay(url).last_event_id == {0: log.last_event_id(0)}


def test_bad_settings_are_refused(log_url: str, tmp_path: Path) -> None:
    with pytest.raises(
        ValueError, match="unknown durability 'sometimes'; expected one of batch, fsync, none"
    ):
        EventLog(log_url, durability="sometimes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="batch_size <= queue_size"):
        EventLog(log_url, batch_size=10, queue_size=5)
    with pytest.raises(ValueError, match="in-memory"):
        EventLog("sqlite:///:memory:")
    with pytest.raises(FileNotFoundError, match="no event log at"):
        EventLog(str(tmp_path / "missing.db"), read_only=True)


def test_full_queue_slows_the_caller_and_drops_nothing(log_url: str) -> None:
    with EventLog(log_url, batch_size=5, queue_size=20, max_delay=0.01) as log:
        emitter = EventEmitter(log.append)
        emitter.stored(Tier.G1, None, [(0, 0)])
        log.flush()
        db, blocker = hold_write_lock(log_url)
        done = threading.Event()

        def produce() -> None:
            emit_some(emitter, 60, start=1)
            done.set()

        producer = threading.Thread(target=produce)
        producer.start()
        time.sleep(0.5)
        assert not done.is_set(), "append did not block on a full queue"
        blocker.rollback()
        blocker.close()
        db.dispose()
        producer.join(30)
        assert done.is_set()
        log.flush()
        ids = [e.event_id for e in log.read()]
        assert ids == list(range(emitter.next_event_id))


def test_writer_failure_is_reported_not_swallowed(log_url: str) -> None:
    log = EventLog(log_url, max_delay=0.01)
    emitter = EventEmitter(log.append)
    emitter.stored(Tier.G1, None, [(1, 1)])
    log.flush()
    # Another writer steals the worker's next id: the database refuses our row.
    db = sa.create_engine(log_url)
    with db.begin() as conn:
        conn.exec_driver_sql(
            "INSERT INTO events (worker, event_id, kind, tier, ts, payload) "
            "VALUES (0, 1, 'removed', 1, 0.0, '')"
            if db.dialect.name == "sqlite"
            else "INSERT INTO events (worker, event_id, kind, tier, ts, payload) "
            "VALUES (0, 1, 'removed', 1, 0.0, ''::bytea)"
        )
    db.dispose()
    emitter.removed(Tier.G1, [1])
    with pytest.raises(
        EventLogError,
        match=r"(?s)writer failed \(IntegrityError.*1 appended events were not stored",
    ):
        log.flush()
    with pytest.raises(EventLogError, match="writer failed"):
        emitter.removed(Tier.G1, [1])
    with pytest.raises(EventLogError):
        log.close()


def test_a_batch_of_several_statements_commits_whole_or_not_at_all(log_url: str) -> None:
    """A batch the writer splits into several INSERTs is one transaction: when a later
    statement fails, the rows of the earlier ones are not committed either."""
    log = EventLog(log_url)
    emitter = EventEmitter(log.append)
    emitter.stored(Tier.G1, None, [(0, 0)])
    log.flush()
    db = sa.create_engine(log_url)
    with db.begin() as conn:  # another writer takes id 900, in the batch's 2nd statement
        conn.execute(
            sa.text(
                "INSERT INTO events (worker, event_id, kind, tier, ts, payload) "
                "VALUES (0, 900, 'removed', 1, 0.0, :payload)"
            ),
            {"payload": b""},
        )
    batch: list[AnyEvent] = []
    EventEmitter(batch.append, first_event_id=1).removed(Tier.G1, [1])
    for _ in range(1, 1100):
        batch.append(replace(batch[-1], event_id=batch[-1].event_id + 1))
    log.append_many(batch)  # one backlog batch of 1,100 rows: INSERTs of 512, 512 and 76
    with pytest.raises(EventLogError, match=r"writer failed \(IntegrityError"):
        log.flush()
    with pytest.raises(EventLogError):
        log.close()
    with db.connect() as conn:
        ids = conn.execute(sa.text("SELECT event_id FROM events ORDER BY event_id")).scalars()
        assert list(ids) == [0, 900]
    db.dispose()


# -- schema ---------------------------------------------------------------------------------


def test_older_schema_names_the_upgrade_command(log_url: str) -> None:
    runner.upgrade(log_url, "0001")
    with pytest.raises(
        SchemaError, match=r"revision 0001, older .* Run `kvledger db upgrade --url"
    ):
        EventLog(log_url)
    runner.upgrade(log_url)
    with EventLog(log_url) as log:
        assert log.last_event_id(0) == -1


def test_newer_schema_is_refused(log_url: str) -> None:
    runner.upgrade(log_url)
    db = sa.create_engine(log_url)
    with db.begin() as conn:
        conn.exec_driver_sql("UPDATE kvledger_schema_version SET version_num = '0099'")
    db.dispose()
    with pytest.raises(
        SchemaError, match=r"revision '0099'.*newer kvledger.*kvledger db downgrade 0002"
    ):
        EventLog(log_url)


def test_foreign_table_is_refused(log_url: str) -> None:
    db = sa.create_engine(log_url)
    with db.begin() as conn:
        conn.exec_driver_sql("CREATE TABLE events (x INTEGER)")
    db.dispose()
    with pytest.raises(SchemaError, match="not created by kvledger"):
        EventLog(log_url)


def test_blank_database_is_created_but_not_when_read_only(
    new_log_url: Callable[[], str],
) -> None:
    url = new_log_url()
    if url.startswith("postgresql"):
        with pytest.raises(SchemaError, match="holds no event log; run `kvledger db upgrade"):
            EventLog(url, read_only=True)
    with EventLog(url) as log:
        assert log.last_position() == 0
    assert runner.current(url) == runner.head() == "0002"


def test_migrations_go_down_and_up(log_url: str) -> None:
    with EventLog(log_url) as log:
        emit_some(EventEmitter(log.append), 5)
    runner.downgrade(log_url, "0001")
    assert runner.current(log_url) == "0001"
    runner.upgrade(log_url)
    with EventLog(log_url, read_only=True) as log:
        assert log.last_event_id(0) > 0
    assert [rev for rev, _down, _doc in runner.history()] == ["0001", "0002"]


def test_the_migrations_build_the_tables_the_log_declares(log_url: str) -> None:
    """The versions are written by hand (the migrations sit below the log and do not import
    its table definitions); what they build must be what the log's code reads and writes."""
    from alembic.autogenerate import compare_metadata
    from alembic.migration import MigrationContext

    from kvledger.events.log.schema import metadata
    from kvledger.migrations import VERSION_TABLE

    runner.upgrade(log_url)
    db = sa.create_engine(log_url)
    try:
        with db.connect() as conn:
            context = MigrationContext.configure(
                conn, opts={"version_table": VERSION_TABLE, "compare_type": True}
            )
            assert compare_metadata(context, metadata) == []
    finally:
        db.dispose()


# -- replay ---------------------------------------------------------------------------------


def test_replay_to_event_and_checkpoints(log_url: str) -> None:
    seen: list[AnyEvent] = []
    with EventLog(log_url) as log:
        emit_some(EventEmitter(tee(log.append, seen.append), clock=Clock()), 200)
        log.flush()
        full = RegistryState.from_events(seen)
        first = replay_report(log, checkpoint_every=100)
        assert first.state == full and first.start_position == 0
        assert len(first.checkpoints_written) == len(seen) // 100
        again = replay_report(log, checkpoint_every=100)
        assert again.start_position == first.checkpoints_written[-1]
        assert again.rows_folded == len(seen) - again.start_position
        assert again.state == full
        assert again.state.last_event_id == full.last_event_id
        for cut in (0, 57, 150, len(seen) - 1):
            want = RegistryState.from_events(e for e in seen if e.event_id <= cut)
            report = replay_report(log, until_event_id=cut)
            assert report.state == want
            assert report.start_position <= cut + 1
            assert not report.checkpoints_written
        ts = seen[120].ts
        assert replay(log, until_ts=ts) == RegistryState.from_events(e for e in seen if e.ts <= ts)
        assert replay(log, use_checkpoints=False) == full
        assert verify(replay(log), full) == []
        del full.tiers[(0, Tier.G1)]
        assert verify(replay(log), full) != []


def test_unreadable_checkpoint_is_skipped_and_rewritten(log_url: str) -> None:
    """A checkpoint in an older snapshot format (or damaged) costs a full fold, not a failure,
    and the fold writes a readable one in its place."""
    seen: list[AnyEvent] = []
    with EventLog(log_url) as log:
        emit_some(EventEmitter(tee(log.append, seen.append)), 60)
        log.flush()
        written = replay_report(log, checkpoint_every=50).checkpoints_written
        assert written
    db = sa.create_engine(log_url)
    with db.begin() as conn:
        conn.execute(sa.text("UPDATE checkpoints SET snapshot = :s"), {"s": b"\x93\x01\x90\x90"})
    db.dispose()
    with EventLog(log_url) as log:
        with pytest.warns(UserWarning, match="ignoring the newest checkpoint.*snapshot version 1"):
            report = replay_report(log, checkpoint_every=50)
        assert report.start_position == 0
        assert report.state == RegistryState.from_events(seen)
        assert replay_report(log, checkpoint_every=50).start_position == written[-1]


def test_corrupt_row_stops_replay_naming_its_position(log_url: str) -> None:
    with EventLog(log_url) as log:
        emit_some(EventEmitter(log.append), 20)
    db = sa.create_engine(log_url)
    with db.begin() as conn:
        conn.execute(sa.text("UPDATE events SET payload = :p WHERE id = 9"), {"p": b"\x91\x07"})
    db.dispose()
    with pytest.raises(CodecError, match="event at position 9: "):
        replay(log_url, checkpoint_every=None)


def test_replay_refuses_a_gap_naming_its_position(log_url: str) -> None:
    with EventLog(log_url) as log:
        emit_some(EventEmitter(log.append), 20)
    db = sa.create_engine(log_url)
    with db.begin() as conn:
        conn.exec_driver_sql("DELETE FROM events WHERE id = 5")
    db.dispose()
    with pytest.raises(EventOrderError, match="position 6: worker 0: event 5 follows 3"):
        replay(log_url)


# -- asyncio variant ------------------------------------------------------------------------


def test_async_log_round_trip(log_url: str) -> None:
    from kvledger.events.log import AsyncEventLog

    if log_url.startswith("sqlite:"):
        async_url = log_url.replace("sqlite:", "sqlite+aiosqlite:", 1)
    else:
        async_url = log_url
    batch: list[AnyEvent] = []
    emit_some(EventEmitter(batch.append), 25)

    async def run() -> list[AnyEvent]:
        async with AsyncEventLog(async_url, batch_size=4, queue_size=8) as log:
            for event in batch[:10]:
                await log.append(event)
            await log.append_many(batch[10:])
            with pytest.raises(ValueError, match="repeats"):
                await log.append(batch[0])
            await log.flush()
            assert await log.last_event_id(0) == batch[-1].event_id
            return [e async for e in log.read()]

    assert asyncio.run(run()) == batch
    with EventLog(log_url, read_only=True) as sync_log:
        assert list(sync_log.read()) == batch


def test_sqlite_log_is_wal_and_readable_by_sqlite3(backend: str, log_url: str) -> None:
    if backend != "sqlite":
        pytest.skip("SQLite file specifics")
    with EventLog(log_url) as log:
        emit_some(EventEmitter(log.append), 3)
    path = log_url.removeprefix("sqlite:///")
    conn = sqlite3.connect(path)
    assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert conn.execute("SELECT count(*) FROM events").fetchone()[0] > 3
    conn.close()


# -- writer failures ------------------------------------------------------------------------


def _assert_one_clean_line(message: str) -> None:
    """What an operator sees: one line, no statement, no parameters, no binary rows."""
    assert "\n" not in message, message
    for leak in ("[SQL", "parameters", "b'\\x", 'b"\\x', "INSERT INTO"):
        assert leak not in message, f"{leak!r} in {message!r}"
    assert len(message) < 400, message


def test_duplicate_worker_id_from_a_second_writer_is_one_clean_line(log_url: str) -> None:
    first = EventLog(log_url, max_delay=0.01)
    emitter = EventEmitter(first.append)
    emit_some(emitter, 5)
    first.flush()
    # A second process starts as the same worker: both continue from the same next id.
    second = EventLog(log_url, max_delay=0.01)
    intruder = EventEmitter(second.append, first_event_id=second.last_event_id(0) + 1)
    emit_some(intruder, 5)
    second.flush()
    emit_some(emitter, 5, start=5)
    with pytest.raises(EventLogError) as failure:
        first.flush()
    message = str(failure.value)
    _assert_one_clean_line(message)
    assert "IntegrityError" in message
    assert "same worker id" in message
    assert re.search(r"\d+ appended events were not stored$", message)
    with pytest.raises(EventLogError) as again:
        first.close()
    _assert_one_clean_line(str(again.value))
    second.close()


@pytest.mark.parametrize("writer", ["compiled", "python"])
def test_disk_full_is_one_clean_line(backend: str, writer: str, tmp_path: Path) -> None:
    """A log on a tiny file system that fills up: SQLite's write of the WAL gets ENOSPC, and
    the writer SQLITE_FULL from the library, as from any full disk. Both writers (the compiled
    one, and the Python one it falls back to) say so in one line, and what they committed
    before stays a readable prefix of what was appended."""
    if backend != "sqlite":
        pytest.skip("filling a PostgreSQL server's disk is not done in a unit test")
    with tiny_tmpfs(tmp_path / "tiny", "256k") as mount:
        log_url = f"sqlite:///{mount / 'events.db'}"
        if writer == "compiled" and compiled_sqlite_path(log_url) is None:
            pytest.skip("the compiled writer is not built here (no C compiler at install)")
        with pytest.MonkeyPatch.context() as env:
            env.setenv("KVLEDGER_PYTHON_SQLITE", "1" if writer == "python" else "0")
            log = EventLog(log_url, max_delay=0.01)
            emitter = EventEmitter(log.append)
            emit_some(emitter, 50)
            log.flush()
            committed = log.last_event_id(0) + 1
            with pytest.raises(EventLogError) as failure:  # at an append or at the flush
                emit_some(emitter, 20_000, start=50)
                log.flush()
            with pytest.raises(EventLogError):
                log.close()
        message = str(failure.value)
        _assert_one_clean_line(message)
        assert "database or disk is full" in message
        assert re.search(r"OperationalError: .*; \d+ appended events were not stored$", message)
        with EventLog(log_url, read_only=True) as log:
            ids = [event.event_id for event in log.read()]
        assert ids == list(range(len(ids))) and len(ids) >= committed


def test_a_full_database_is_one_clean_line(
    backend: str, log_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SQLite's own page limit makes the database full wherever no file system can be mounted:
    the Python writer's INSERT gets SQLITE_FULL, as from a full disk. (The limit is set on
    SQLAlchemy's connections, which the compiled writer does not use.)"""
    if backend != "sqlite":
        pytest.skip("filling a PostgreSQL server's disk is not done in a unit test")
    monkeypatch.setenv("KVLEDGER_PYTHON_SQLITE", "1")
    EventLog(log_url).close()
    path = cast(str, sa.make_url(log_url).database)  # a SQLite URL names its file
    with sqlite3.connect(path) as conn:
        (pages,) = conn.execute("PRAGMA page_count").fetchone()

    def limit_pages(dbapi_conn: sqlite3.Connection, _record: object) -> None:
        dbapi_conn.execute(f"PRAGMA max_page_count = {pages + 4}")

    sa.event.listen(sa.pool.Pool, "connect", limit_pages)
    try:
        log = EventLog(log_url, max_delay=0.01)
        with pytest.raises(EventLogError) as failure:  # at an append or at the flush
            emit_some(EventEmitter(log.append), 2000)
            log.flush()
        with pytest.raises(EventLogError):
            log.close()
    finally:
        sa.event.remove(sa.pool.Pool, "connect", limit_pages)
    message = str(failure.value)
    _assert_one_clean_line(message)
    assert "database or disk is full" in message
    assert re.search(r"OperationalError: .*; \d+ appended events were not stored$", message)


@pytest.mark.parametrize("bad_id", [0, 2, 5])
def test_async_log_checks_ids_as_the_threaded_log_does(log_url: str, bad_id: int) -> None:
    """One id check serves both logs: the same refusals, nothing of a refused batch queued, and
    a worker's next id learned from what a previous run committed."""
    from kvledger.events.log import AsyncEventLog

    async_url = log_url.replace("sqlite:", "sqlite+aiosqlite:", 1)

    def removed(event_id: int) -> Removed:
        return Removed(
            event_id=event_id, worker_id=0, dp_rank=0, tier=Tier.G1, ts=0.0, sequence_hashes=(1,)
        )

    with EventLog(log_url) as log:
        emitter = EventEmitter(log.append)
        for i in range(3):
            emitter.stored(Tier.G1, None, [(i, i)])

    async def run() -> list[int]:
        async with AsyncEventLog(async_url) as log:
            with pytest.raises(ValueError, match=f"worker 0: event {bad_id} .*expects event 3"):
                await log.append(removed(bad_id))
            with pytest.raises(ValueError, match=f"event {bad_id} .*expects event 4 next"):
                await log.append_many([removed(3), removed(bad_id)])
            assert log.queue_depth == 0 and await log.last_event_id(0) == 2
            await log.append(removed(3))  # nothing of the refused batch was queued
            await log.flush()
            return [e.event_id async for e in log.read()]

    assert asyncio.run(run()) == [0, 1, 2, 3]
