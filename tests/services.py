"""Where the tests find PostgreSQL and Redis, and how they skip when a server is down.

Both are real servers (``.ci/services`` starts them); the PostgreSQL address can be moved with
``KVLEDGER_TEST_PG_HOST``, ``KVLEDGER_TEST_PG_PORT`` and ``KVLEDGER_TEST_PG_USER``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import redis

from kvledger.config import Settings

PG_HOST = os.environ.get("KVLEDGER_TEST_PG_HOST", "127.0.0.1")
PG_PORT = int(os.environ.get("KVLEDGER_TEST_PG_PORT", "5432"))
PG_USER = os.environ.get("KVLEDGER_TEST_PG_USER", "postgres")
PG_SERVER_URL = f"postgresql+psycopg://{PG_USER}@{PG_HOST}:{PG_PORT}"
"""The server, without a database: append ``/name`` for a SQLAlchemy URL."""

REDIS_URL = "redis://127.0.0.1:6379/0"


def pg_connect(dbname: str = "postgres") -> Any:
    """An autocommit psycopg connection as the admin user (psycopg is imported here, so a test
    module that never reaches PostgreSQL does not need it)."""
    import psycopg

    return psycopg.connect(
        host=PG_HOST, port=PG_PORT, user=PG_USER, dbname=dbname, autocommit=True, connect_timeout=3
    )


def skip_without_postgres() -> None:
    """Skip the calling test when the PostgreSQL server cannot be reached."""
    try:
        pg_connect().close()
    except Exception as exc:  # psycopg.OperationalError, or psycopg missing
        pytest.skip(f"PostgreSQL at {PG_HOST}:{PG_PORT} is unreachable ({exc}); run .ci/services")


def redis_or_skip(url: str = REDIS_URL, **kwargs: Any) -> redis.Redis:
    """A client of the Redis server at ``url``; skips the calling test when it is down."""
    client = redis.Redis.from_url(url, **kwargs)
    try:
        client.ping()
    except redis.ConnectionError:
        pytest.skip(f"no Redis at {url} (run .ci/services)")
    return client


def hold_write_lock(url: str) -> tuple[Any, Any]:
    """Another connection that holds the events table's write lock until it rolls back: a
    writer that cannot commit, for the tests of back-pressure and commit lag."""
    import sqlalchemy as sa

    engine = sa.create_engine(url)
    conn = engine.connect()
    if engine.dialect.name == "sqlite":
        conn.exec_driver_sql("BEGIN IMMEDIATE")
    else:
        conn.exec_driver_sql("LOCK TABLE events IN EXCLUSIVE MODE")
    return engine, conn


def manager_settings(tmp_path: Path, **kw: object) -> Settings:
    """Settings for a small BlockManager in ``tmp_path``: 4-token blocks of 2 float32 layers,
    its G3 file and SQLite event log there; ``kw`` sets the tiers and anything else."""
    base: dict[str, object] = dict(
        block_size=4,
        num_layers=2,
        outer_dim=2,
        inner_dim=8,
        dtype="float32",
        data_dir=tmp_path / "data",
        event_log_url=f"sqlite:///{tmp_path / 'events.db'}",
    )
    base.update(kw)
    return Settings.load(**base)
