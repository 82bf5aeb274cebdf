"""Alembic environment for the event-log schema.

Run through ``kvledger db ...`` (or ``kvledger.migrations.runner``), which hands over either a URL
or an open connection; a log opened on an empty database is created through the same path, so
there is exactly one way the tables come to exist.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import context

from kvledger.migrations import VERSION_TABLE

config = context.config


def _run(connection: sa.Connection) -> None:
    context.configure(
        connection=connection,
        # none: the versions are written by hand, and the tests check that they build the
        # tables events/log/schema.py declares (the log sits above the migrations)
        target_metadata=None,
        version_table=VERSION_TABLE,
        # SQLite cannot ALTER most things in place; batch mode copies the table instead.
        render_as_batch=connection.dialect.name == "sqlite",
    )
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:
        _run(connection)
        return
    db = sa.create_engine(config.get_main_option("sqlalchemy.url") or "", poolclass=sa.NullPool)
    with db.connect() as conn:
        _run(conn)
    db.dispose()


if context.is_offline_mode():
    raise SystemExit("offline (SQL script) migrations are not supported; give a database URL")
run_migrations_online()
