"""Fixtures shared by the test modules.

Event-log databases: a SQLite file per test, or a PostgreSQL schema per test. PostgreSQL is
the real server (``services.PG_SERVER_URL``); one throwaway database per test session holds
one schema per test (the URL's search_path picks it), dropped when the session ends.
"""

from __future__ import annotations

import importlib.util
import io
import os
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis
from services import PG_HOST, PG_PORT, PG_SERVER_URL, pg_connect, redis_or_skip

# The vLLM harness and end-to-end test import vLLM: they run in the vLLM test venv
# (integrations/test_vllm_offloading.py starts them there), never in this suite's interpreter.
# The SGLang backend tests likewise run in the SGLang test venv (integrations/
# test_sglang_hicache.py starts them there); that venv's pytest collects them itself.
collect_ignore = ["integrations/vllm_harness", "integrations/vllm_e2e"]
if importlib.util.find_spec("sglang") is None:
    collect_ignore.append("integrations/sglang")


@pytest.fixture(autouse=True)
def _switch_interval_restored() -> Iterator[None]:
    """``kvledger.cli.main`` and a worker's ``switch_interval_s`` set the interpreter's switch
    interval, which is the process's: a test that runs them in-process leaves the next test
    the interval it found."""
    before = sys.getswitchinterval()
    yield
    sys.setswitchinterval(before)


@pytest.fixture(scope="session")
def pg_database() -> Iterator[str]:
    """A throwaway database for this session; skips when the server cannot be reached."""
    try:
        admin = pg_connect()
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
    with pg_connect(database) as conn:
        conn.execute(f'CREATE SCHEMA "{schema}"')
    return f"{PG_SERVER_URL}/{database}?options=-csearch_path%3D{schema}"


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def new_log_url(backend: str, request: pytest.FixtureRequest, tmp_path: Path) -> Callable[[], str]:
    """A factory of fresh, empty log URLs on the parametrized backend."""
    if backend == "sqlite":
        counter = iter(range(1_000_000))
        return lambda: f"sqlite:///{tmp_path / f'events-{next(counter)}.db'}"
    database = request.getfixturevalue("pg_database")
    return lambda: pg_schema_url(database)


@pytest.fixture
def log_url(new_log_url: Callable[[], str]) -> str:
    return new_log_url()


@pytest.fixture
def redis_client() -> redis.Redis:
    """A client of the test Redis server; skips the test when it is down."""
    return redis_or_skip()


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """No ``KVLEDGER_*`` or ``DYN_KVBM_*`` variable of the calling shell leaks into a test."""
    for name in list(os.environ):
        if name.startswith(("KVLEDGER_", "DYN_KVBM_")):
            monkeypatch.delenv(name)


class Terminal(io.StringIO):
    """A stream that says it is a terminal, to see what commands draw only on one."""

    def isatty(self) -> bool:
        return True


@pytest.fixture
def terminal() -> Terminal:
    return Terminal()
