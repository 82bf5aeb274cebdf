"""Where the tests find PostgreSQL and Redis, and how they skip when a server is down.

Both are real servers (``.ci/services`` starts them); the PostgreSQL address can be moved with
``KVLEDGER_TEST_PG_HOST``, ``KVLEDGER_TEST_PG_PORT`` and ``KVLEDGER_TEST_PG_USER``.
"""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
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


def wait_until(condition: Callable[[], bool], what: str, timeout: float = 20.0) -> None:
    """Poll ``condition()`` until true; a generous bound, never a timing assertion."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s: {what}")
        time.sleep(0.05)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (for a server a test starts, or
    an address that refuses connections)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def start_redis(port: int, workdir: Path) -> subprocess.Popen[bytes]:
    """A private ``redis-server`` on 127.0.0.1:``port`` that keeps nothing on disk, returned
    once it answers (a test may stop, kill or restart it without touching the shared one)."""
    proc = subprocess.Popen(
        [
            shutil.which("redis-server") or "redis-server",
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(workdir),
        ],
        stdout=subprocess.DEVNULL,
    )
    client = redis.Redis(port=port)
    for _ in range(100):
        try:
            client.ping()
            return proc
        except redis.ConnectionError:
            time.sleep(0.05)
    proc.kill()
    raise RuntimeError("private redis-server did not start")


@contextlib.contextmanager
def tiny_tmpfs(where: Path, size: str) -> Iterator[Path]:
    """A tmpfs of ``size`` mounted at ``where`` (made here) for the block's life: a real file
    system that fills up (ENOSPC, as a full disk). Skips the test where mounting needs a
    privilege this process lacks. The unmount is lazy: a file still open there must not fail
    the test's clean-up."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root with CAP_SYS_ADMIN; not available here")
    where.mkdir()
    proc = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], capture_output=True
    )
    if proc.returncode != 0:
        pytest.skip("mounting a tmpfs needs root with CAP_SYS_ADMIN; not available here")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=True)


def hold_write_lock(url: str) -> tuple[Any, Any]:
    """Another connection that holds the events table's write lock until it rolls back: a
    writer that cannot commit, for the tests of back-pressure and commit lag."""
    import sqlalchemy as sa

    db = sa.create_engine(url)
    conn = db.connect()
    if db.dialect.name == "sqlite":
        conn.exec_driver_sql("BEGIN IMMEDIATE")
    else:
        conn.exec_driver_sql("LOCK TABLE events IN EXCLUSIVE MODE")
    return db, conn


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


class PrivatePostgres:
    """A PostgreSQL server of one test's own, on a free loopback port, which the test may
    restart or stop (the shared server on :5432 is never touched). Needs the server binaries
    (``initdb``, ``pg_ctl``) and, when run as root, the ``postgres`` user to run them as."""

    def __init__(self) -> None:
        found = sorted(glob.glob("/usr/lib/postgresql/*/bin/pg_ctl"))
        self._bin = Path(found[-1]).parent if found else None
        if self._bin is None and shutil.which("pg_ctl"):
            self._bin = Path(str(shutil.which("pg_ctl"))).parent
        if self._bin is None:
            pytest.skip("needs the PostgreSQL server binaries (initdb, pg_ctl)")
        self._as: list[str] = []
        if os.geteuid() == 0:
            if shutil.which("runuser") is None:
                pytest.skip("as root, a private PostgreSQL needs runuser and a postgres user")
            self._as = ["runuser", "-u", "postgres", "--"]
        self.dir = Path(tempfile.mkdtemp(prefix="kvledger-pg-"))
        if self._as:
            shutil.chown(self.dir, "postgres")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = int(s.getsockname()[1])
        self._run("initdb", "-D", str(self.dir / "data"), "-A", "trust", "-U", "postgres")

    @property
    def url(self) -> str:
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/postgres"

    def _run(self, tool: str, *args: str) -> None:
        assert self._bin is not None
        subprocess.run(
            [*self._as, str(self._bin / tool), *args], check=True, capture_output=True, timeout=60
        )

    def _ctl(self, action: str) -> None:
        options = f"-p {self.port} -k {self.dir} -c listen_addresses=127.0.0.1"
        self._run(
            "pg_ctl", "-D", str(self.dir / "data"), "-l", str(self.dir / "log"), "-m", "fast",
            "-w", "-o", options, action,
        )  # fmt: skip

    def start(self) -> PrivatePostgres:
        self._ctl("start")
        return self

    def restart(self) -> None:
        self._ctl("restart")

    def stop(self) -> None:
        self._ctl("stop")

    def remove(self) -> None:
        with contextlib.suppress(Exception):
            self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)
