"""The event-log schema's history: Alembic's environment, the versions, and ``runner``, which
applies them (``kvledger db``, and the log itself when it opens a blank database).

The migrations sit below the log: ``events/log`` creates and checks its tables through them,
and nothing here imports ``events``. That the versions build the tables the log's code reads
and writes (``events/log/schema.py``) is checked by the tests, not by Alembic's autogenerate.
"""

from __future__ import annotations

import sqlalchemy as sa

VERSION_TABLE = "kvledger_schema_version"
"""Alembic's version table, named so that it cannot clash with another application's."""


def revisions(conn: sa.Connection) -> tuple[str, ...]:
    """The revisions the database's version table holds: none for a blank database, one for
    a database kvledger migrated."""
    # alembic's runtime: only opening a database needs it, not importing the log
    from alembic.runtime.migration import MigrationContext

    context = MigrationContext.configure(conn, opts={"version_table": VERSION_TABLE})
    return tuple(context.get_current_heads())
