"""The log rides out a database it loses for a while: a PostgreSQL connection terminated or a
server restarted in the middle of an db-on run, a SQLite file locked by another process.
Appends wait under the usual back-pressure, the writer reconnects, and nothing is lost or
written twice; past ``event_log_retry_s`` the run stops with one line.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa
from event_streams import prompt_pool, worker_events
from services import PrivatePostgres, hold_write_lock, pg_connect, skip_without_postgres

from kvledger.events.log import AsyncEventLog, EventLog, EventLogError
from kvledger.events.types import AnyEvent

KVLEDGER = [sys.executable, "-m", "kvledger.cli"]


def _simulate(url: str, state: Path, **env: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [*KVLEDGER, "simulate", "--requests", "2500", "--log", url, "--dump-state", str(state)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **env},
    )


def _rows(url: str) -> tuple[int, int, int]:
    """(rows, distinct (worker, event id), newest id + 1) of the worker 0 stream."""
    db = sa.create_engine(url)
    try:
        with db.connect() as conn:
            rows, distinct, top = conn.exec_driver_sql(
                "SELECT count(*), count(DISTINCT (worker, event_id)), max(event_id) + 1 "
                "FROM events WHERE worker = 0"
            ).one()
    finally:
        db.dispose()
    return int(rows), int(distinct), int(top or 0)


def _replay_verifies(url: str, state: Path) -> None:
    done = subprocess.run(
        [*KVLEDGER, "replay", url, "--verify", str(state)], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stdout + done.stderr


def _wait_rows(url: str, at_least: int, proc: subprocess.Popen[str]) -> None:
    deadline = time.monotonic() + 60
    while True:
        assert proc.poll() is None, proc.communicate()
        try:
            if _rows(url)[0] >= at_least:
                return
        except sa.exc.SQLAlchemyError:
            pass  # the schema is not made yet
        assert time.monotonic() < deadline, "the run wrote nothing"
        time.sleep(0.05)


def _terminate(application_name: str) -> int:
    """pg_terminate_backend of every connection named ``application_name``: how many."""
    with pg_connect() as admin:
        killed = admin.execute(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
            "WHERE application_name = %s",
            (application_name,),
        ).fetchone()
    return int(killed[0]) if killed else 0


@pytest.fixture
def pg_database_url() -> Iterator[str]:
    skip_without_postgres()
    name = f"kvledger_outage_{uuid.uuid4().hex[:8]}"
    admin = pg_connect()
    admin.execute(f'CREATE DATABASE "{name}"')
    try:
        yield f"postgresql+psycopg://postgres@127.0.0.1:5432/{name}"
    finally:
        admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        admin.close()


@pytest.mark.postgres
@pytest.mark.slow
def test_terminated_connections_lose_nothing(pg_database_url: str, tmp_path: Path) -> None:
    """pg_terminate_backend of the log's connection, three times mid-run: the run finishes,
    every event is stored once, and the log replays to the run's final state."""
    name = f"kvlog_{uuid.uuid4().hex[:8]}"
    url = f"{pg_database_url}?application_name={name}"
    state = tmp_path / "run.state"
    proc = _simulate(url, state)
    terminated = 0
    for wanted in (2_000, 8_000, 16_000):
        _wait_rows(pg_database_url, wanted, proc)
        terminated += _terminate(name)
    _out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    assert terminated >= 3
    assert "reachable again" in err and "Traceback" not in err
    rows, distinct, top = _rows(pg_database_url)
    assert rows == distinct == top  # none lost (ids 0..top-1 all there), none twice
    _replay_verifies(url, state)


@pytest.mark.postgres
@pytest.mark.slow
def test_a_server_restart_mid_run_loses_nothing(tmp_path: Path) -> None:
    server = PrivatePostgres().start()
    try:
        state = tmp_path / "run.state"
        proc = _simulate(server.url, state)
        _wait_rows(server.url, 5_000, proc)
        server.restart()
        _out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err
        assert "Traceback" not in err
        rows, distinct, top = _rows(server.url)
        assert rows == distinct == top > 5_000
        _replay_verifies(server.url, state)
    finally:
        server.remove()


@pytest.mark.postgres
@pytest.mark.slow
def test_a_server_gone_past_the_limit_stops_the_run_in_one_line(tmp_path: Path) -> None:
    server = PrivatePostgres().start()
    try:
        proc = _simulate(server.url, tmp_path / "s", KVLEDGER_EVENT_LOG_RETRY_S="2")
        _wait_rows(server.url, 2_000, proc)
        server.stop()
        _out, err = proc.communicate(timeout=120)
        assert proc.returncode != 0
        assert "Traceback" not in err, err
        errors = [line for line in err.splitlines() if "error:" in line]
        assert len(errors) == 1, err
        assert "unreachable for 2 s" in errors[0] and "events were not stored" in errors[0]
    finally:
        server.remove()


def test_a_locked_sqlite_file_is_waited_for(tmp_path: Path) -> None:
    """Another process holds the write lock for longer than SQLite's own busy wait: appends
    wait, the writer tries again, and everything lands once the lock is let go."""
    url = f"sqlite:///{tmp_path / 'events.db'}"
    events = worker_events(1, 0, 200, prompt_pool(1))
    with EventLog(url, max_delay=0.05, retry_for=30) as log:
        log.append_many(events[:50])
        log.flush()
        db, conn = hold_write_lock(url)
        release = threading.Timer(7.0, lambda: (conn.rollback(), conn.close()))
        release.start()
        started = time.monotonic()
        log.append_many(events[50:])  # back-pressure: waits for the writer
        log.flush()
        waited = time.monotonic() - started
        release.join()
        db.dispose()
        assert waited > 5  # it really was held up, then got through
        assert log.outages == 1
        assert list(log.read()) == events


def test_a_lock_held_past_the_limit_fails_in_one_line(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'events.db'}"
    events = worker_events(1, 0, 40, prompt_pool(1))
    log = EventLog(url, retry_for=1)
    db, conn = hold_write_lock(url)
    try:
        log.append_many(events)
        with pytest.raises(EventLogError) as failed:
            log.flush()
        message = str(failed.value)
        assert "unreachable for" in message and "database is locked" in message
        assert f"{len(events)} appended events were not stored" in message
        assert "\n" not in message
    finally:
        conn.rollback()
        conn.close()
        db.dispose()
        with pytest.raises(EventLogError):
            log.close()


# -- the asyncio log: the same policy (core.Outage) in its writer task ------------------------


@pytest.mark.postgres
def test_the_asyncio_log_rides_out_terminated_connections(pg_database_url: str) -> None:
    """pg_terminate_backend of the asyncio log's connection, twice between appends: every
    event is stored once and reads back in order."""
    name = f"kvlog_{uuid.uuid4().hex[:8]}"
    events = worker_events(1, 0, 3_000, prompt_pool(1))

    async def run() -> tuple[list[AnyEvent], int, int]:
        terminated = 0
        url = f"{pg_database_url}?application_name={name}"  # psycopg's async driver, by itself
        async with AsyncEventLog(url, retry_for=30) as log:
            for part in range(3):
                await log.append_many(events[part * 1_000 : (part + 1) * 1_000])
                await log.flush()
                if part < 2:
                    terminated += await asyncio.to_thread(_terminate, name)
            read = [event async for event in log.read()]
            return read, terminated, log.outages

    read, terminated, outages = asyncio.run(run())
    assert read == events  # none lost, none twice, in order
    assert terminated >= 2 and outages >= 1  # its connection went, and it got the server back
    rows, distinct, top = _rows(pg_database_url)
    assert rows == distinct == top == len(events)


def test_the_asyncio_log_waits_for_a_locked_sqlite_file(tmp_path: Path) -> None:
    path = tmp_path / "events.db"
    events = worker_events(1, 0, 200, prompt_pool(1))

    async def run() -> tuple[list[AnyEvent], float, int]:
        async with AsyncEventLog(f"sqlite+aiosqlite:///{path}", retry_for=30) as log:
            await log.append_many(events[:50])
            await log.flush()
            db, conn = hold_write_lock(f"sqlite:///{path}")
            release = threading.Timer(7.0, lambda: (conn.rollback(), conn.close()))
            release.start()
            started = time.monotonic()
            await log.append_many(events[50:])
            await log.flush()
            waited = time.monotonic() - started
            await asyncio.to_thread(release.join)
            db.dispose()
            return [event async for event in log.read()], waited, log.outages

    read, waited, outages = asyncio.run(run())
    assert waited > 5  # held up by the lock, then through
    assert outages == 1
    assert read == events


def test_the_asyncio_log_gives_up_past_the_limit_in_one_line(tmp_path: Path) -> None:
    path = tmp_path / "events.db"
    events = worker_events(1, 0, 40, prompt_pool(1))

    async def run() -> str:
        log = await AsyncEventLog(f"sqlite+aiosqlite:///{path}", retry_for=1).open()
        db, conn = hold_write_lock(f"sqlite:///{path}")
        try:
            await log.append_many(events)
            with pytest.raises(EventLogError) as failed:
                await log.flush()
            return str(failed.value)
        finally:
            conn.rollback()
            conn.close()
            db.dispose()
            with pytest.raises(EventLogError):
                await log.close()

    message = asyncio.run(run())
    assert "unreachable for" in message and "database is locked" in message
    assert f"{len(events)} appended events were not stored" in message
    assert "\n" not in message
