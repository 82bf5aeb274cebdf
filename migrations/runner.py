"""Run the event-log migrations programmatically (what ``kvledger db`` and a fresh log use).

Every ``url`` is a SQLAlchemy URL (callers turn a SQLite path into one first).
"""

from __future__ import annotations

from pathlib import Path

import sqlalchemy as sa
from alembic import command
from alembic.config import Config
from alembic.script import ScriptDirectory
from alembic.util import CommandError

from kvledger.migrations import revisions

SCRIPT_LOCATION = str(Path(__file__).resolve().parent)


def alembic_config(url: str, connection: sa.Connection | None = None) -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", SCRIPT_LOCATION)
    # ConfigParser treats % as interpolation; URLs may contain escaped characters.
    cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    if connection is not None:
        cfg.attributes["connection"] = connection
    return cfg


def upgrade(url: str, revision: str = "head", connection: sa.Connection | None = None) -> None:
    """Migrate the database at ``url`` (a new SQLite file is the caller's to create: the log
    and ``kvledger db upgrade`` make it readable by its owner only, in a folder that exists)."""
    command.upgrade(alembic_config(url, connection), revision)


def downgrade(url: str, revision: str) -> None:
    command.downgrade(alembic_config(url), revision)


def current(url: str) -> str | None:
    """The database's revision; None for a blank database."""
    db = sa.create_engine(url, poolclass=sa.NullPool)
    try:
        with db.connect() as conn:
            heads = revisions(conn)
    finally:
        db.dispose()
    if len(heads) > 1:
        shown = sa.make_url(url).render_as_string(hide_password=True)
        raise CommandError(f"{shown} has several schema heads {heads}; it was migrated by hand")
    return heads[0] if heads else None


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
