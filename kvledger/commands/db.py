"""``kvledger db upgrade|downgrade|current|history``: the event-log schema's migrations."""

from __future__ import annotations

import argparse

from kvledger.events.schema import SCHEMA_HEAD, database_url, shown_url
from kvledger.migrations import runner


def default_url() -> str:
    from kvledger.config import Settings

    return Settings.load().log_url


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("db", help="migrate the event-log database schema")
    actions = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    url_help = "event log: a SQLAlchemy URL or a SQLite file path (default: from settings)"

    up = actions.add_parser("upgrade", help="migrate to the newest schema (or --revision)")
    up.add_argument("--url", help=url_help)
    up.add_argument("--revision", default="head")
    up.set_defaults(func=upgrade)

    down = actions.add_parser("downgrade", help="migrate back to REVISION")
    down.add_argument("revision")
    down.add_argument("--url", help=url_help)
    down.set_defaults(func=downgrade)

    cur = actions.add_parser("current", help="show the database's schema revision")
    cur.add_argument("--url", help=url_help)
    cur.set_defaults(func=current)

    hist = actions.add_parser("history", help="list the schema revisions this kvledger knows")
    hist.set_defaults(func=history)


def _url(args: argparse.Namespace) -> str:
    return database_url(args.url) if args.url else default_url()


def upgrade(args: argparse.Namespace) -> int:
    url = _url(args)
    runner.upgrade(url, args.revision)
    print(f"{shown_url(url)}: schema at {runner.current(url)}")
    return 0


def downgrade(args: argparse.Namespace) -> int:
    url = _url(args)
    runner.downgrade(url, args.revision)
    print(f"{shown_url(url)}: schema at {runner.current(url) or 'base (no tables)'}")
    return 0


def current(args: argparse.Namespace) -> int:
    url = _url(args)
    revision = runner.current(url)
    if revision is None:
        print(f"{shown_url(url)}: no kvledger schema (run `kvledger db upgrade`)")
        return 1
    state = "up to date" if revision == SCHEMA_HEAD else f"this kvledger expects {SCHEMA_HEAD}"
    print(f"{shown_url(url)}: {revision} ({state})")
    return 0 if revision == SCHEMA_HEAD else 1


def history(args: argparse.Namespace) -> int:
    for revision, down, doc in runner.history():
        head = " (head)" if revision == SCHEMA_HEAD else ""
        print(f"{down or 'base'} -> {revision}{head}: {doc}")
    return 0
