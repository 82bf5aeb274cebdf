"""The ``kvledger`` command line.

Each subcommand lives in its own module under ``kvledger.commands`` and exposes
``register(subparsers)``; this module only collects them, so adding a command never touches
another command's code.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

COMMAND_MODULES = (
    "kvledger.commands.demo",
    "kvledger.commands.worker",
    "kvledger.commands.db",
    "kvledger.commands.replay",
    "kvledger.commands.inspect",
    "kvledger.commands.tail",
    "kvledger.commands.simulate",
    "kvledger.commands.sweep",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvledger",
        description="KV-cache block manager with an event-sourced registry.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 0
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130
    except (ValueError, OSError) as exc:
        # Errors the user can act on (bad settings, missing files, corrupt logs) carry a
        # message that names the problem; a traceback would only hide it.
        print(f"kvledger {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
