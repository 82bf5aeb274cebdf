"""The compiled SQLite writer and reader (events/log/_sqlite.c) against the Python ones.

The writer: the same rows in the same table for any batch, the same exception classes and
SQLite's own words for what goes wrong, nothing of a failed batch written, and the interpreter
free while SQLite works. The reader: the same rows, positions and checksums as Python's sqlite3
reads, for any bounds and chunk size.

The rest of the suite's log tests (outages, kills, back-pressure, a full disk, a second process
as the same worker; replay of damaged rows, bounds, checkpoints and read-only mounts) run
through them too, since the log picks them wherever they are built; test_event_log's full-disk
test runs both writers."""

from __future__ import annotations

import itertools
import sqlite3
import threading
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from services import hold_write_lock
from switches import python_with
from test_event_codec import events

from kvledger.events.codec import CodecError
from kvledger.events.log import EventLog
from kvledger.events.log._sqlite import Reader as CompiledReader
from kvledger.events.log._sqlite import Writer as CompiledWriter
from kvledger.events.log.database import compiled_sqlite_path, open_compiled_writer
from kvledger.events.log.reader import RowChunk, read_chunks, read_row_chunks, select_rows
from kvledger.events.log.replay import replay
from kvledger.events.log.rows import COLUMNS, Row, insert_sql, to_row
from kvledger.events.types import Removed, Tier
from kvledger.registry.emitter import EventEmitter

_NAMES = itertools.count()


def new_log(folder: Path) -> Path:
    """An empty log file with the schema, made as the log makes it."""
    path = folder / f"events-{next(_NAMES)}.db"
    EventLog(f"sqlite:///{path}").close()
    return path


def table(path: Path) -> list[tuple[Any, ...]]:
    with sqlite3.connect(path) as conn:
        return conn.execute(f"SELECT id, {', '.join(COLUMNS)} FROM events ORDER BY id").fetchall()


def python_commit(path: Path, batch: list[Row]) -> None:
    """What the Python writer's statements leave, by plain sqlite3 (one transaction)."""
    with sqlite3.connect(path) as conn:
        conn.executemany(insert_sql("qmark"), batch)


@pytest.fixture
def folder(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    yield tmp_path_factory.mktemp("logs")


def test_this_install_built_it(tmp_path: Path) -> None:
    """The build is optional, so a broken one would pass unnoticed but for this module's
    import: the suite's install has a compiler (as for test_codec_compiled), and a plain SQLite
    log's writer is then the compiled one."""
    assert compiled_sqlite_path(f"sqlite:///{tmp_path / 'a.db'}") == str(tmp_path / "a.db")
    assert compiled_sqlite_path("postgresql+psycopg://u@127.0.0.1/db") is None
    assert compiled_sqlite_path(f"sqlite:///file:{tmp_path / 'a.db'}?mode=ro&uri=true") is None
    assert CompiledWriter.__module__ == "kvledger.events.log._sqlite"


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(st.lists(events(), min_size=1, max_size=30))
def test_same_rows_as_the_python_writer(folder: Path, drawn: list[Any]) -> None:
    batch = [to_row(replace_ids(event, i)) for i, event in enumerate(drawn)]
    ours, theirs = new_log(folder), new_log(folder)
    with open_compiled_writer(str(ours), "batch") as writer:
        writer.commit(batch[:1])
        writer.commit(batch[1:])
        writer.commit([])
    python_commit(theirs, batch[:1])
    python_commit(theirs, batch[1:])
    assert table(ours) == table(theirs)
    assert [row[1:] for row in table(ours)] == [tuple(row) for row in batch]


def replace_ids(event: Any, i: int) -> Any:
    """``event`` as worker 0's ``i``-th (drawn ids repeat; the table refuses a repeat)."""
    return replace(event, worker_id=0, event_id=i)


def removed(event_id: int, worker_id: int = 0) -> Row:
    return to_row(
        Removed(
            event_id=event_id, worker_id=worker_id, dp_rank=0, tier=Tier.G1, ts=1.0,
            sequence_hashes=(event_id + 1,),
        )
    )  # fmt: skip


def test_a_repeated_id_is_the_integrity_error_and_nothing_of_the_batch_is_written(
    folder: Path,
) -> None:
    path = new_log(folder)
    with open_compiled_writer(str(path), "batch") as writer:
        writer.commit([removed(0), removed(1)])
        with pytest.raises(sqlite3.IntegrityError, match="UNIQUE constraint failed"):
            writer.commit([removed(2), removed(3), removed(1)])
        writer.commit([removed(2)])  # the connection goes on, the failed batch left no row
    assert [row[2] for row in table(path)] == [0, 1, 2]


@pytest.mark.parametrize(
    ("row", "error", "words"),
    [
        ((0, 1, "removed", 0, 1.0), TypeError, "a log row is a tuple"),
        ((0, 1, "removed", 0, 1, b"x"), TypeError, "a log row is a tuple"),
        ((0, True, "removed", 0, 1.0, b"x"), TypeError, "a log row is a tuple"),
        ([0, 1, "removed", 0, 1.0, b"x"], TypeError, "a log row is a tuple"),
        ((0, 2**63, "removed", 0, 1.0, b"x"), OverflowError, "too large"),
    ],
)
def test_a_malformed_row_is_refused_before_anything_is_written(
    folder: Path, row: Any, error: type[Exception], words: str
) -> None:
    path = new_log(folder)
    with open_compiled_writer(str(path), "batch") as writer:
        with pytest.raises(error, match=words):
            writer.commit([removed(0), row])
        with pytest.raises(TypeError, match="list"):
            writer.commit((removed(0),))  # type: ignore[arg-type]
    assert table(path) == []


def test_opening_fails_as_sqlite3_does(tmp_path: Path) -> None:
    with pytest.raises(sqlite3.OperationalError, match="unable to open database file"):
        open_compiled_writer(str(tmp_path / "missing" / "events.db"), "batch")
    (tmp_path / "not-a-log.db").write_bytes(b"x" * 4096)
    with pytest.raises(sqlite3.DatabaseError, match="not a database"):
        open_compiled_writer(str(tmp_path / "not-a-log.db"), "batch")
    with pytest.raises(ValueError, match="synchronous must be"):
        CompiledWriter(str(new_log(tmp_path)), "SOMETIMES", 100, insert_sql("qmark"))


def test_a_closed_writer_refuses_to_commit(folder: Path) -> None:
    writer = open_compiled_writer(str(new_log(folder)), "fsync")
    writer.close()
    writer.close()
    with pytest.raises(sqlite3.InterfaceError, match="closed"):
        writer.commit([removed(0)])


def test_the_interpreter_runs_while_a_commit_waits_for_sqlite(folder: Path) -> None:
    """A commit that waits on another connection's lock (SQLite's busy handler, inside the C
    call) leaves the interpreter to other threads: here the one that then releases the lock.
    If the commit held the GIL, that thread could not run until the busy timeout had failed
    the commit."""
    path = new_log(folder)
    db, conn = hold_write_lock(f"sqlite:///{path}")
    writer = CompiledWriter(str(path), "NORMAL", 30_000, insert_sql("qmark"))
    started = threading.Event()
    failure: list[BaseException] = []

    def commit() -> None:
        started.set()
        try:
            writer.commit([removed(0)])
        except BaseException as exc:
            failure.append(exc)

    thread = threading.Thread(target=commit)
    thread.start()
    started.wait()
    thread.join(0.3)  # Python code runs here while the commit waits inside SQLite
    assert thread.is_alive()
    conn.rollback()
    conn.close()
    db.dispose()
    thread.join(30)
    writer.close()
    assert not thread.is_alive() and failure == []
    assert [row[2] for row in table(path)] == [0]


def test_a_locked_log_is_the_operational_error_the_outage_policy_retries(folder: Path) -> None:
    path = new_log(folder)
    db, conn = hold_write_lock(f"sqlite:///{path}")
    try:
        writer = CompiledWriter(str(path), "NORMAL", 50, insert_sql("qmark"))
        with pytest.raises(sqlite3.OperationalError, match="database is locked"):
            writer.commit([removed(0)])
        writer.close()
    finally:
        conn.rollback()
        conn.close()
        db.dispose()
    assert table(path) == []


def test_the_environment_turns_it_off(tmp_path: Path) -> None:
    """``KVLEDGER_PYTHON_SQLITE=1``: the log's Python writer (multi-row INSERTs) serves."""
    script = (
        "import sys; from kvledger.events.log.database import compiled_sqlite_path; "
        "sys.stdout.write(repr(compiled_sqlite_path(sys.argv[1])))"
    )
    url = f"sqlite:///{tmp_path / 'a.db'}"
    for value, expected in (("1", "None"), ("0", repr(str(tmp_path / "a.db")))):
        out = python_with("KVLEDGER_PYTHON_SQLITE", value, script, url)
        assert out.stdout == expected


# -- the reader ------------------------------------------------------------------------------


def same_chunks(ours: list[RowChunk], theirs: list[RowChunk]) -> None:
    assert [len(c) for c in ours] == [len(c) for c in theirs]
    for a, b in zip(ours, theirs, strict=True):
        assert a.positions.tolist() == b.positions.tolist()
        assert a.ts.tolist() == b.ts.tolist()
        assert list(a.rows()) == list(b.rows())
        assert a.crcs.tolist() == b.crcs.tolist()


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    st.lists(events(), min_size=0, max_size=40),
    st.integers(1, 50),
    st.integers(0, 45),
    st.none() | st.integers(0, 45),
)
def test_reads_what_sqlite3_reads(
    folder: Path, drawn: list[Any], chunk: int, after: int, until: int | None
) -> None:
    path = new_log(folder)
    with open_compiled_writer(str(path), "batch") as writer:
        writer.commit([to_row(replace_ids(event, i)) for i, event in enumerate(drawn)])
    url = f"sqlite:///{path}"
    with EventLog(url, read_only=True) as log:
        db = log._db
        stmt = select_rows(after_position=after, until_position=until)
        ours = list(read_row_chunks(db, stmt, chunk, str(path)))
        theirs = [RowChunk.from_rows(rows) for rows in read_chunks(db, stmt, chunk)]
        same_chunks(ours, theirs)
        same_chunks(
            list(log.read_row_chunks(after_position=after, until_position=until, chunk_size=chunk)),
            theirs,
        )


def test_a_reader_refuses_what_it_cannot_read(folder: Path) -> None:
    path = new_log(folder)
    with pytest.raises(ValueError, match="id, ts and payload"):
        CompiledReader(str(path), "SELECT id FROM events", 100)
    with pytest.raises(sqlite3.OperationalError, match="no such column"):
        CompiledReader(str(path), "SELECT id, ts, no_payload FROM events", 100)
    reader = CompiledReader(str(path), "SELECT id, ts, payload FROM events", 100)
    with pytest.raises(ValueError, match="at least 1"):
        reader.read(0)
    assert reader.read(10) is None and reader.read(10) is None  # an empty log: at its end
    reader.close()
    with pytest.raises(sqlite3.InterfaceError, match="closed"):
        reader.read(10)
    with pytest.raises(sqlite3.OperationalError, match="unable to open"):
        CompiledReader(str(folder / "missing.db"), "SELECT id, ts, payload FROM events", 100)


def test_a_file_it_cannot_open_read_only_is_read_through_sqlalchemy(folder: Path) -> None:
    """Where SQLite cannot open the file read-only (a WAL file on a read-only mount without
    its -shm, say; here a path with nothing there), replay's reader falls back to the
    connection the log opened, which found a way (``database.open_read_only``)."""
    path = new_log(folder)
    with EventLog(f"sqlite:///{path}") as log:
        emitter = EventEmitter(log.append)
        emitter.removed(Tier.G1, [1])
        log.flush()
        chunks = list(read_row_chunks(log._db, select_rows(), 10, str(folder / "nothing.db")))
    assert [chunk.positions.tolist() for chunk in chunks] == [[1]]


@pytest.mark.parametrize("python", ["0", "1"])
def test_a_chunk_of_empty_payloads_is_a_damaged_row_not_a_crash(
    folder: Path, python: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A row whose payload was emptied (damage): both readers hand it to the decoder, which
    names the row, where the compiled reader once handed over None for a chunk of no bytes."""
    monkeypatch.setenv("KVLEDGER_PYTHON_SQLITE", python)
    path = new_log(folder)
    with EventLog(f"sqlite:///{path}") as log:
        EventEmitter(log.append).removed(Tier.G1, [1])
        log.flush()
    with sqlite3.connect(path) as conn:
        conn.execute("UPDATE events SET payload = x''")
    with pytest.raises(CodecError, match="event at position 1: not a msgpack record"):
        replay(f"sqlite:///{path}", use_checkpoints=False)
