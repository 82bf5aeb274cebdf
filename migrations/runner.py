"""Run the event-log migrations programmatically (what ``kvledger db`` and a fresh log use)."""

from __future__ import annotations

from pathlib import Path

import sqlalchemy as sa
from alembic import command
from alembic.config import Config
from alembic.script import ScriptDirectory

from kvledger.events.log.engine import prepare_sqlite_file
from kvledger.events.log.schema import database_url, schema_revision

SCRIPT_LOCATION = str(Path(__file__).resolve().parent)


def alembic_config(url: str, connection: sa.Connection | None = None) -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", SCRIPT_LOCATION)
    # ConfigParser treats % as interpolation; URLs may contain escaped characters.
    cfg.set_main_option("sqlalchemy.url", database_url(url).replace("%", "%%"))
    if connection is not None:
        cfg.attributes["connection"] = connection
    return cfg


def upgrade(url: str, revision: str = "head", connection: sa.Connection | None = None) -> None:
    if connection is None:  # a new SQLite file is made readable by its owner only
        prepare_sqlite_file(database_url(url))
    command.upgrade(alembic_config(url, connection), revision)


def downgrade(url: str, revision: str) -> None:
    command.downgrade(alembic_config(url), revision)


def current(url: str) -> str | None:
    engine = sa.create_engine(database_url(url), poolclass=sa.NullPool)
    try:
        with engine.connect() as conn:
            return schema_revision(conn)
    finally:
        engine.dispose()


def history() -> list[tuple[str, str | None, str]]:
    """(revision, down revision, first line of its docstring), oldest first."""
    script = ScriptDirectory(SCRIPT_LOCATION)
    out = []
    for rev in reversed(list(script.walk_revisions())):
        down = rev.down_revision if isinstance(rev.down_revision, str | None) else None
        out.append((rev.revision, down, (rev.doc or "").strip().splitlines()[0]))
    return out


def head() -> str | None:
    return ScriptDirectory(SCRIPT_LOCATION).get_current_head()
