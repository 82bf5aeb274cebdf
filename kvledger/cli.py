"""The ``kvledger`` command line.

Each subcommand lives in its own module under ``kvledger.commands`` and exposes
``register(subparsers)``; this module only collects them, so adding a command never touches
another command's code.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import os
import re
import sys
import warnings
from collections.abc import Callable, Sequence

from kvledger.extras import missing_extra

CLI_SWITCH_INTERVAL_S = 0.0005
"""The switch interval of kvledger's own processes (``kvledger worker``, ``simulate``): the
log's writer and the publishers are threads beside the engine's, and each of their system
calls gives the interpreter up and waits up to this long to get it back from an engine thread
that runs Python without pause. At Python's 5 ms, a publisher of 15k events/s fell seconds
behind the log; at 0.5 ms it applies within 50 ms p99 (``bench/redis_bench.py``, RESULTS).
``switch_interval_s`` overrides it; in a library user's process kvledger leaves it alone."""

CLI_GC_THRESHOLDS = (700, 10, 100)
"""The collector's thresholds in kvledger's own processes: Python's for the young generations,
and a full collection ten times rarer than Python's (after 100 collections of the middle
generation, not 10). A full collection walks every live object (the trace, the engines'
queues, a router's index); in a 2-worker KV-routed simulation of the Mooncake conversation
trace four of them took 130 ms of a 2.3 s run and found no garbage. Cycles are still
collected while young, and the old ones at the rarer full collections."""

COMMAND_MODULES = (
    "kvledger.commands.demo",
    "kvledger.commands.worker",
    "kvledger.commands.db",
    "kvledger.commands.replay",
    "kvledger.commands.inspect",
    "kvledger.commands.tail",
    "kvledger.commands.simulate",
    "kvledger.commands.sweep",
    "kvledger.commands.whatif",
    "kvledger.commands.report",
)


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser of every command, or of ``command`` alone: each command module is named
    after its command, and importing all of them (SQLAlchemy, Alembic, torch, ...) would cost a
    short run more than its work."""
    parser = argparse.ArgumentParser(
        prog="kvledger",
        description="KV-cache block manager with an event-sourced registry.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        if command is None or name.rpartition(".")[2] == command:
            importlib.import_module(name).register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    names = {name.rpartition(".")[2] for name in COMMAND_MODULES}
    parser = build_parser(argv[0] if argv and argv[0] in names else None)
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 0
    # What start-up built (the command's modules, pydantic's schemas) lives until exit: moved
    # out of the collector's generations, the collections a run triggers do not walk it again
    # (1.3% of a `simulate --no-log` run's instructions, all in those walks).
    gc.freeze()
    gc.set_threshold(*CLI_GC_THRESHOLDS)
    # This process is kvledger's (``switch_interval_s``, applied by the builder, overrides it).
    sys.setswitchinterval(CLI_SWITCH_INTERVAL_S)
    prefix = f"kvledger {args.command}"
    with warnings.catch_warnings():
        warnings.showwarning = _warning_printer(prefix)
        try:
            status = int(args.func(args) or 0)
            sys.stdout.flush()  # a closed pipe shows up here, not at interpreter exit
            return status
        except KeyboardInterrupt:
            return 130
        except BrokenPipeError:
            # The reader of our output went away (`kvledger inspect LOG | head -1`): stop
            # quietly, as Python's documentation recommends, without a "Broken pipe" at exit.
            _discard_stdout()
            return 1
        except Exception as exc:
            message = operator_error(exc, getattr(args, "log", None) or getattr(args, "url", None))
            if message is None:
                raise  # not an operator's mistake: a bug, whose traceback is the report
            for line in message.splitlines():  # one line per mistake, each named
                print(f"{prefix}: error: {line}", file=sys.stderr)
            return 2


def operator_error(exc: Exception, where: str | None = None) -> str | None:
    """The message for an error an operator can fix (bad settings, flags or input files, a
    database or Redis that is missing or down, a full disk, an optional dependency this install
    lacks); None for anything else.

    ``where`` names the log or database the command was given, for messages from the database
    driver that do not say which database they mean.
    """
    missing = missing_extra(exc)  # an optional dependency this install lacks
    if missing is not None:
        return missing
    # here, not at start-up: only an error needs them (`kvledger --help` loads none)
    import redis
    import sqlalchemy as sa
    from alembic.util import CommandError

    from kvledger.events.log import EventLogError
    from kvledger.events.shared.claims import ClaimLost, WorkerIdTaken

    if isinstance(exc, sa.exc.DBAPIError):
        return _database_message(exc, where)
    if isinstance(exc, redis.AuthenticationError):  # before ConnectionError: it is one
        return (
            f"Redis refused the login: {_one_line(exc).rstrip('.')}; check the user name and "
            "password in the Redis URL"
        )
    if isinstance(exc, redis.exceptions.NoPermissionError):
        return (
            f"Redis refused a command: {_one_line(exc)}; the URL's user lacks a permission "
            "kvledger needs (docs/security.md lists each role's)"
        )
    if isinstance(exc, redis.ConnectionError | redis.TimeoutError):
        return f"redis unreachable: {_one_line(exc)}"
    if isinstance(exc, OSError):
        if exc.strerror and exc.filename is not None:
            return f"{exc.filename}: {exc.strerror}"
        return exc.strerror or _one_line(exc)
    if isinstance(exc, EventLogError | CommandError | sa.exc.ArgumentError):
        return _one_line(exc)
    if isinstance(exc, WorkerIdTaken | ClaimLost):
        return _one_line(exc)
    if isinstance(exc, ValueError):  # settings, traces, schema, codec: messages we wrote
        return str(exc)
    return None


def _database_message(exc: Exception, where: str | None) -> str:
    # here, not at start-up: only a database error needs them
    import sqlite3

    import sqlalchemy as sa

    from kvledger.events.log.schema import database_url, shown_url

    orig = getattr(exc, "orig", None) or exc
    text = _one_line(orig)
    shown = f"{shown_url(database_url(where))}: " if where else ""
    if isinstance(orig, sqlite3.DatabaseError):
        if "not a database" in text or "malformed" in text:
            return f"{shown}{text}: the file is damaged or is not a SQLite database"
        if "unable to open" in text:
            return f"{shown}{text}: its folder is missing, or it is not a file we may open"
    if isinstance(exc, sa.exc.OperationalError) and "does not exist" in text:
        return f"{shown}{text}; create the database or fix the URL"
    return f"{shown}{text}"


def _one_line(exc: BaseException) -> str:
    text = re.sub(r"\s*\(Background on this error at: [^\s)]+\)", "", str(exc))
    return " ".join(text.split())


def _warning_printer(prefix: str) -> Callable[..., None]:
    def show(message: Warning | str, category: type[Warning], *_: object, **__: object) -> None:
        print(f"{prefix}: warning: {message}", file=sys.stderr)

    return show


def _discard_stdout() -> None:
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):  # stdout without a file descriptor (captured in a test)
        pass


if __name__ == "__main__":
    sys.exit(main())
