"""``kvledger db upgrade|downgrade|current|history``: the event-log schema's migrations."""

from __future__ import annotations

import argparse
import errno
from pathlib import Path

import sqlalchemy as sa

from kvledger.commands.args import log_location
from kvledger.events.log.database import prepare_sqlite_file
from kvledger.events.log.schema import (
    KNOWN_REVISIONS,
    SCHEMA_HEAD,
    SchemaError,
    database_url,
    paste_note,
    shown_url,
)
from kvledger.migrations import runner


def default_url() -> str:
    from kvledger.config import Settings  # pydantic-settings: only when --url is left out

    return Settings.load().log_url


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("db", help="migrate the event-log database schema")
    actions = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    url_help = "event log: a SQLAlchemy URL or a SQLite file path (default: from settings)"

    up = actions.add_parser("upgrade", help="migrate to the newest schema (or --revision)")
    up.add_argument("--url", type=log_location, help=url_help)
    up.add_argument("--revision", default="head")
    up.set_defaults(func=upgrade)

    down = actions.add_parser("downgrade", help="migrate back to REVISION")
    down.add_argument("revision")
    down.add_argument("--url", type=log_location, help=url_help)
    down.set_defaults(func=downgrade)

    cur = actions.add_parser("current", help="show the database's schema revision")
    cur.add_argument("--url", type=log_location, help=url_help)
    cur.set_defaults(func=current)

    hist = actions.add_parser("history", help="list the schema revisions this kvledger knows")
    hist.set_defaults(func=history)


def _url(args: argparse.Namespace) -> str:
    return database_url(args.url) if args.url else default_url()


def _exists(url: str) -> bool:
    """False for a SQLite file that is not there (a server's database: the server says)."""
    parsed = sa.make_url(url)
    return parsed.get_backend_name() != "sqlite" or Path(parsed.database or "").is_file()


def _existing(url: str) -> str:
    """The URL of a database that must exist already: reading a SQLite file's revision must
    not leave an empty file (or folder) behind where none was."""
    if not _exists(url):
        raise FileNotFoundError(
            errno.ENOENT,
            "no such event log (`kvledger db upgrade` creates one)",
            sa.make_url(url).database,
        )
    return url


def _refuse_newer(url: str) -> None:
    """Alembic cannot migrate from a revision it has no script for; say what that means."""
    revision = runner.current(url)
    if revision is not None and revision not in KNOWN_REVISIONS:
        raise SchemaError(
            f"{shown_url(url)} is at schema revision {revision!r}, which this kvledger does not "
            f"know (its newest is {SCHEMA_HEAD}): a newer kvledger wrote it. Use that kvledger, "
            f"or downgrade with it: `kvledger db downgrade {SCHEMA_HEAD} --url "
            f"'{shown_url(url)}'`{paste_note(url)}."
        )


def upgrade(args: argparse.Namespace) -> int:
    url = _url(args)
    if args.url is None:  # the default log: its data folder is made (0700), as a run makes it
        from kvledger.config import Settings

        Settings.load().prepare_log_folder()
    if _exists(url):
        _refuse_newer(url)
    prepare_sqlite_file(url)  # a new SQLite file: the owner's alone, in a folder that exists
    runner.upgrade(url, args.revision)
    print(f"{shown_url(url)}: schema at {runner.current(url)}")
    return 0


def downgrade(args: argparse.Namespace) -> int:
    url = _existing(_url(args))
    _refuse_newer(url)
    runner.downgrade(url, args.revision)
    print(f"{shown_url(url)}: schema at {runner.current(url) or 'base (no tables)'}")
    return 0


def current(args: argparse.Namespace) -> int:
    url = _existing(_url(args))
    revision = runner.current(url)
    if revision is None:
        print(f"{shown_url(url)}: no kvledger schema (run `kvledger db upgrade`)")
        return 1
    if revision == SCHEMA_HEAD:
        state = "up to date"
    elif revision in KNOWN_REVISIONS:
        state = f"this kvledger expects {SCHEMA_HEAD}"
    else:
        state = f"newer than this kvledger knows (its newest is {SCHEMA_HEAD})"
    print(f"{shown_url(url)}: {revision} ({state})")
    return 0 if revision == SCHEMA_HEAD else 1


def history(args: argparse.Namespace) -> int:
    for revision, down, doc in runner.history():
        head = " (head)" if revision == SCHEMA_HEAD else ""
        print(f"{down or 'base'} -> {revision}{head}: {doc}")
    return 0
