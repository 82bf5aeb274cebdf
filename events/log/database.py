"""The event log's database: one place that turns a URL and a durability into a SQLAlchemy
engine, for the threaded log (``open_database``, ``open_read_only``) and the asyncio log
(``open_async_database``). In kvledger an "engine" is an inference engine, so a SQLAlchemy
engine is called ``db`` here and where the log uses one."""

from __future__ import annotations

import os
import sqlite3
from pathlib import Path
from typing import Any, Literal
from urllib.parse import quote

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from kvledger.events.files import check_private, private_file
from kvledger.events.log.rows import insert_sql

try:
    from kvledger.events.log._sqlite import Reader as CompiledReader
    from kvledger.events.log._sqlite import Writer as CompiledWriter
except ImportError:  # not built (no C compiler), or a Python whose sqlite3 hides SQLite's API
    CompiledReader = CompiledWriter = None  # type: ignore[assignment, misc]

Durability = Literal["batch", "fsync", "none"]
DURABILITY_MODES: tuple[Durability, ...] = ("batch", "fsync", "none")
_SQLITE_SYNC = {"batch": "NORMAL", "fsync": "FULL", "none": "OFF"}
_PG_SYNC = {"batch": "on", "fsync": "on", "none": "off"}
SQLITE_BUSY_S = 5.0
"""How long SQLite itself waits for another connection's lock before a statement fails with
"database is locked"; the log's writer then tries again for up to its ``retry_for``."""


def database_args(url: str, durability: Durability) -> tuple[sa.URL, dict[str, Any], str | None]:
    """(URL, create_engine keyword arguments, SQLite ``synchronous`` pragma or None).

    Shared by the threaded and the asyncio log so both honour ``durability`` the same way.
    """
    if durability not in DURABILITY_MODES:
        raise ValueError(
            f"unknown durability {durability!r}; expected one of {', '.join(DURABILITY_MODES)}"
        )
    parsed = sa.make_url(url)
    backend = parsed.get_backend_name()
    if backend == "sqlite":
        if parsed.database in (None, "", ":memory:"):
            raise ValueError(
                "an in-memory SQLite event log cannot be shared by its writer and readers; "
                "give a file path"
            )
        return (
            parsed,
            {"connect_args": {"timeout": SQLITE_BUSY_S}, "hide_parameters": True},
            _SQLITE_SYNC[durability],
        )
    if backend == "postgresql":
        # libpq options from the URL (e.g. a search_path) are kept, with ours after them.
        given = parsed.query.get("options", "")
        given = given if isinstance(given, str) else " ".join(given)
        options = f"{given} -c synchronous_commit={_PG_SYNC[durability]}".strip()
        return (
            parsed.difference_update_query(["options"]),
            {"connect_args": {"options": options}, "hide_parameters": True},
            None,
        )
    return parsed, {"hide_parameters": True}, None


def install_sqlite_pragmas(db: sa.Engine, synchronous: str) -> None:
    """WAL (readers never block the writer) and the durability's ``synchronous`` level."""

    @sa.event.listens_for(db, "connect")
    def _pragmas(dbapi_conn: Any, _record: Any) -> None:
        cur = dbapi_conn.cursor()
        cur.execute("PRAGMA journal_mode=WAL")
        cur.execute(f"PRAGMA synchronous={synchronous}")
        cur.close()


def prepare_sqlite_file(url: str | sa.URL) -> None:
    """Create a SQLite log's file as 0600 before SQLite opens it (SQLite would create it with
    the umask's mode, and its ``-wal`` and ``-shm`` files take the database file's mode), or
    warn when an existing one, or its ``-wal``/``-shm``, is readable by others. Its folder must
    exist: a mistyped path is reported, never created."""
    parsed = sa.make_url(url)
    path = parsed.database
    if parsed.get_backend_name() != "sqlite" or path in (None, "", ":memory:"):
        return
    if path.startswith("file:"):  # a SQLite URI: its options are the operator's
        return
    if not private_file(path):
        check_private(f"{path}-wal", f"{path}-shm")


def open_database(url: str, durability: Durability = "batch") -> sa.Engine:
    """An engine with the settings that ``durability`` asks for (a new SQLite file is made
    readable by its owner only)."""
    parsed, kwargs, synchronous = database_args(url, durability)
    prepare_sqlite_file(parsed)
    db = sa.create_engine(parsed, **kwargs)
    if synchronous is not None:
        install_sqlite_pragmas(db, synchronous)
    return db


def compiled_sqlite_path(url: str) -> str | None:
    """The file a SQLite log's compiled writer and reader (``_sqlite.c``) open, or None where
    the Python ones serve: another database, the extension not built, a SQLite URI or URL
    options (which the compiled ones do not read), or ``KVLEDGER_PYTHON_SQLITE=1`` in the
    environment (to measure it, or to rule it out)."""
    if CompiledWriter is None or os.environ.get("KVLEDGER_PYTHON_SQLITE", "") not in ("", "0"):
        return None
    parsed = sa.make_url(url)
    path = parsed.database
    if parsed.get_backend_name() != "sqlite" or parsed.query or not path:
        return None
    if path == ":memory:" or path.startswith("file:"):
        return None
    return path


def open_compiled_writer(path: str, durability: Durability) -> CompiledWriter:
    """A connection of the compiled writer to the log file at ``path`` (it exists: the schema
    was made through SQLAlchemy), with the pragmas and busy timeout that ``open_database``
    gives SQLAlchemy's connections. Raises ``sqlite3``'s own errors, as a connect would."""
    return CompiledWriter(
        path, _SQLITE_SYNC[durability], int(SQLITE_BUSY_S * 1000), insert_sql("qmark")
    )


def open_compiled_reader(path: str, sql: str) -> CompiledReader | None:
    """The compiled reader of ``sql`` (a SELECT of id, ts and payload) on a read-only
    connection to the log file at ``path``; None where SQLite cannot open it so (a read-only
    mount without the ``-shm`` file a WAL reader needs: ``open_read_only`` says more), and the
    caller reads through SQLAlchemy's engine, which found a way."""
    try:
        return CompiledReader(path, sql, int(SQLITE_BUSY_S * 1000))
    except sqlite3.OperationalError:
        return None


def open_async_database(url: str, durability: Durability = "batch") -> AsyncEngine:
    """``open_database`` for SQLAlchemy's asyncio engine (``sqlite+aiosqlite``,
    ``postgresql+psycopg``)."""
    parsed, kwargs, synchronous = database_args(url, durability)
    prepare_sqlite_file(parsed)
    db = create_async_engine(parsed, **kwargs)
    if synchronous is not None:
        install_sqlite_pragmas(db.sync_engine, synchronous)
    return db


def open_read_only(url: str) -> tuple[sa.Engine, bool]:
    """An engine that reads a SQLite log wherever it lies, and whether it may store checkpoints.

    Reading a WAL database takes its -shm (and -wal) file, which SQLite creates next to it;
    where it cannot (a read-only mount, a folder the user may not write) a plain open fails with
    "unable to open database file". Then the file is opened through SQLite's URI as
    ``mode=ro``, which reads existing -shm/-wal files without writing them, and failing that as
    ``immutable=1``: no writer is running then (it would have created those files), so the file
    cannot change while it is read. Only the plain open may store checkpoints.
    """
    parsed = sa.make_url(url)
    path = Path(parsed.database or "").resolve()
    failure: sa.exc.OperationalError | None = None
    for query in ("", "mode=ro", "mode=ro&immutable=1"):
        target = f"file:{quote(str(path))}?{query}" if query else str(path)

        def connect(target: str = target, uri: bool = bool(query)) -> sqlite3.Connection:
            return sqlite3.connect(target, uri=uri, timeout=30, check_same_thread=False)

        db = sa.create_engine(parsed, creator=connect, hide_parameters=True)
        try:
            with db.connect() as conn:
                conn.exec_driver_sql("SELECT count(*) FROM sqlite_master").scalar()
        except sa.exc.OperationalError as exc:
            db.dispose()
            failure = exc
            continue
        return db, not query and os.access(path, os.W_OK)
    assert failure is not None
    raise failure
