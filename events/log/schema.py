"""The event-log tables, as SQLAlchemy Core metadata.

The migrations (``kvledger.migrations``, below the log) are the authority on what a database
holds (``kvledger db upgrade``); these definitions are what the log's code reads and writes, and
the tests check that the migrations build them. ``SCHEMA_HEAD`` names the revision this code
reads and writes, so a log opened with a different revision is refused.
"""

from __future__ import annotations

import sqlalchemy as sa

from kvledger.migrations import revisions

SCHEMA_HEAD = "0002"
"""The Alembic revision these tables correspond to."""

# SQLite only makes INTEGER PRIMARY KEY an alias of the rowid (cheap appends, ids that grow by
# one); BIGINT elsewhere so PostgreSQL logs can outgrow 2**31 rows.
RowId = sa.BigInteger().with_variant(sa.Integer(), "sqlite")

metadata = sa.MetaData()

events = sa.Table(
    "events",
    metadata,
    sa.Column("id", RowId, primary_key=True, autoincrement=True),
    sa.Column("worker", sa.BigInteger, nullable=False),
    sa.Column("event_id", sa.BigInteger, nullable=False),
    sa.Column("kind", sa.String(16), nullable=False),
    sa.Column("tier", sa.SmallInteger, nullable=False),
    sa.Column("ts", sa.Double, nullable=False),
    sa.Column("payload", sa.LargeBinary, nullable=False),
    # One row per (worker, event id): a repeated event is refused by the database itself, and
    # the constraint's index is the one per-worker reads and last_event_id use.
    sa.UniqueConstraint("worker", "event_id", name="uq_events_worker_event_id"),
)

checkpoints = sa.Table(
    "checkpoints",
    metadata,
    sa.Column("id", RowId, primary_key=True, autoincrement=True),
    # The snapshot is the fold of every event row with id <= position.
    sa.Column("position", sa.BigInteger, nullable=False, unique=True),
    sa.Column("max_event_id", sa.BigInteger, nullable=False),
    sa.Column("max_ts", sa.Double, nullable=False),
    sa.Column("created", sa.Double, nullable=False),
    sa.Column("snapshot", sa.LargeBinary, nullable=False),
)

KNOWN_REVISIONS = ("0001", "0002")
"""Every revision up to ``SCHEMA_HEAD``, oldest first: a log at one of these is merely old."""

DEFAULT_URL = "sqlite:///kvledger-data/events.db"


class SchemaError(ValueError):
    """The database's schema is not the one this code reads and writes."""


def database_url(location: str) -> str:
    """Accept a SQLAlchemy URL or a path to a SQLite file (what the CLI's LOG argument is)."""
    if "://" in location:
        return location
    return f"sqlite:///{location}"


def shown_url(url: str) -> str:
    """The URL for messages, without its password."""
    return sa.make_url(url).render_as_string(hide_password=True)


def paste_note(url: str) -> str:
    """What to add after a command that shows ``url`` (as ``shown_url`` does, or ``url`` as
    shown): pasted as printed, a URL whose password reads ``***`` would log in with the
    password "***"."""
    if sa.make_url(url).password is None:
        return ""
    return " (the password is shown as ***: put yours back before running it)"


def upgrade_hint(url: str) -> str:
    return f"kvledger db upgrade --url '{shown_url(url)}'"


def check_log_url(url: str) -> str:
    """``url`` when it names a database kvledger can open here; otherwise a ``ValueError``
    saying why in one line: not a URL, a kind of database SQLAlchemy does not know, or one whose
    driver is not installed (``mysql://`` without MySQLdb), so the mistake is reported when the
    setting or flag is read rather than as a driver's traceback when the log is opened."""
    try:
        parsed = sa.make_url(url)
    except sa.exc.ArgumentError:
        raise ValueError(
            f"{url!r} is not a database URL; give e.g. sqlite:///path/events.db or "
            "postgresql+psycopg://user@host/db"
        ) from None
    shown = parsed.render_as_string(hide_password=True)
    try:
        dialect = parsed.get_dialect()
    except sa.exc.NoSuchModuleError:
        raise ValueError(
            f"{shown}: SQLAlchemy knows no database {parsed.drivername!r}; kvledger's logs are "
            "SQLite (sqlite:///path/events.db) or PostgreSQL (postgresql+psycopg://user@host/db)"
        ) from None
    try:
        dialect.import_dbapi()
    except ImportError as exc:
        if parsed.get_backend_name() == "postgresql":
            raise ValueError(
                f"{shown}: the {parsed.drivername} driver is not installed ({exc}): pip install "
                "'kvledger[postgres]'"
            ) from None
        raise ValueError(
            f"{shown}: the {parsed.drivername} driver is not installed ({exc}); install it, or "
            "use SQLite (sqlite:///path/events.db) or PostgreSQL (postgresql+psycopg://...)"
        ) from None
    return url


def schema_revision(conn: sa.Connection) -> str | None:
    """The database's Alembic revision; None when it has no version table (or an empty one)."""
    heads = revisions(conn)
    if len(heads) > 1:
        raise SchemaError(
            f"the event log has several schema heads {list(heads)}; it was migrated by hand"
        )
    return heads[0] if heads else None


def check_schema(conn: sa.Connection, url: str) -> bool:
    """Raise ``SchemaError`` unless the schema is ``SCHEMA_HEAD``; False for a blank database.

    The messages name the command that fixes the mismatch, because whoever reads them is
    usually starting a service, not debugging the log.
    """
    revision = schema_revision(conn)
    if revision == SCHEMA_HEAD:
        return True
    where = shown_url(url)
    if revision is None:
        if sa.inspect(conn).has_table(events.name):
            raise SchemaError(
                f"{where} has an '{events.name}' table but no kvledger schema version; it was "
                f"not created by kvledger. Point the log at an empty database, or run "
                f"`{upgrade_hint(url)}`{paste_note(url)} on one."
            )
        return False
    if revision in KNOWN_REVISIONS:
        raise SchemaError(
            f"{where} has event-log schema revision {revision}, older than this kvledger's "
            f"{SCHEMA_HEAD}. Run `{upgrade_hint(url)}`{paste_note(url)} to migrate it."
        )
    raise SchemaError(
        f"{where} has event-log schema revision {revision!r}, which this kvledger does not know "
        f"(its newest is {SCHEMA_HEAD}): the log was written by a newer kvledger. Upgrade "
        f"kvledger, or run `kvledger db downgrade {SCHEMA_HEAD} --url '{where}'` with the newer "
        f"one."
    )
