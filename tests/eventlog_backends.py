"""Event-log databases for tests: a SQLite file per test, or a PostgreSQL schema per test.

PostgreSQL is the real server on 127.0.0.1:5432; one throwaway database per test session holds
one schema per test (the URL's search_path picks it), dropped when the session ends.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

PG_HOST = os.environ.get("KVLEDGER_TEST_PG_HOST", "127.0.0.1")
PG_PORT = int(os.environ.get("KVLEDGER_TEST_PG_PORT", "5432"))
PG_USER = os.environ.get("KVLEDGER_TEST_PG_USER", "postgres")


def _admin_connect(dbname: str = "postgres"):  # type: ignore[no-untyped-def]
    import psycopg

    return psycopg.connect(
        host=PG_HOST, port=PG_PORT, user=PG_USER, dbname=dbname, autocommit=True, connect_timeout=3
    )


@pytest.fixture(scope="session")
def pg_database() -> Iterator[str]:
    """A throwaway database for this session; skips when the server cannot be reached."""
    try:
        admin = _admin_connect()
    except Exception as exc:  # psycopg.OperationalError, or psycopg missing
        pytest.skip(f"PostgreSQL at {PG_HOST}:{PG_PORT} is unreachable ({exc}); run .ci/services")
    name = f"kvledger_eventlog_{os.getpid()}_{uuid.uuid4().hex[:8]}"
    admin.execute(f'CREATE DATABASE "{name}"')
    try:
        yield name
    finally:
        admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        admin.close()


def pg_schema_url(database: str) -> str:
    """A fresh schema in ``database``; the URL makes it the connection's search_path."""
    schema = f"t_{uuid.uuid4().hex[:12]}"
    with _admin_connect(database) as conn:
        conn.execute(f'CREATE SCHEMA "{schema}"')
    return (
        f"postgresql+psycopg://{PG_USER}@{PG_HOST}:{PG_PORT}/{database}"
        f"?options=-csearch_path%3D{schema}"
    )


@pytest.fixture(params=["sqlite", "postgres"])
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def new_log_url(backend: str, request: pytest.FixtureRequest, tmp_path: Path):  # type: ignore[no-untyped-def]
    """A factory of fresh, empty log URLs on the parametrized backend."""
    if backend == "sqlite":
        counter = iter(range(1_000_000))
        return lambda: f"sqlite:///{tmp_path / f'events-{next(counter)}.db'}"
    database = request.getfixturevalue("pg_database")
    return lambda: pg_schema_url(database)


@pytest.fixture
def log_url(new_log_url) -> str:  # type: ignore[no-untyped-def]
    return str(new_log_url())
