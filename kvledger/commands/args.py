"""Argument types shared by the commands: each refuses a bad value while parsing.

A mistake in a flag is then reported by argparse (usage line, the flag's name, exit 2) before
any work starts, rather than after a long run or as a traceback from deep inside it.
"""

from __future__ import annotations

import argparse
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # for the annotations only: pyzmq loads only for a run that publishes
    from kvledger.events.shared.zmq_process import ZmqPublisherProcess
    from kvledger.events.shared.zmq_publish import ZmqPublisher


def non_negative_int(text: str) -> int:
    value = _int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {value}")
    return value


def positive_int(text: str) -> int:
    value = _int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be 1 or more, got {value}")
    return value


def linger_seconds(text: str) -> float:
    """A wait of 0 to under 60 seconds (what ``RedisPublisher(linger_s=...)`` takes)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number of seconds, got {text!r}") from None
    if not 0 <= value < 60:
        raise argparse.ArgumentTypeError(f"must be 0 or more and under 60, got {text}")
    return value


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"must be a finite number above 0, got {text!r}")
    return value


def port(text: str) -> int:
    value = _int(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"a TCP port is 0..65535, got {value}")
    return value


def timestamp(text: str) -> float:
    """Seconds since the epoch, or an ISO 8601 time as ``kvledger inspect`` prints it.

    An ISO time without a zone is taken as UTC, the zone ``inspect`` prints in. It covers the
    whole of its last digit: inspect prints times cut to the millisecond, so ``...35.324`` means
    up to the end of that millisecond, and the log's last time as printed includes its last
    event.
    """
    try:
        value = float(text)
    except ValueError:
        import datetime as dt  # here: every command imports this module, few read times

        try:
            when = dt.datetime.fromisoformat(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected seconds since the epoch or an ISO time such as "
                f"2026-11-25T03:46:35.319+00:00, got {text!r}"
            ) from None
        if when.tzinfo is None:
            when = when.replace(tzinfo=dt.UTC)
        return math.nextafter(when.timestamp() + _last_digit(text), -math.inf)
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
    return value


def positive_ints(text: str) -> list[int]:
    """Comma-separated whole numbers of 1 or more: several values make a sweep."""
    return [positive_int(part) for part in _parts(text)]


def non_negative_ints(text: str) -> list[int]:
    """Comma-separated whole numbers of 0 or more."""
    return [non_negative_int(part) for part in _parts(text)]


def choices(allowed: tuple[str, ...]) -> Callable[[str], list[str]]:
    """Comma-separated names out of ``allowed``."""

    def parse(text: str) -> list[str]:
        values = _parts(text)
        wrong = [v for v in values if v not in allowed]
        if wrong:
            raise argparse.ArgumentTypeError(
                f"unknown {', '.join(map(repr, wrong))}; choose from {', '.join(allowed)}"
            )
        return values

    return parse


def _parts(text: str) -> list[str]:
    parts = [part.strip() for part in text.split(",")]
    if not all(parts):
        raise argparse.ArgumentTypeError(f"expected comma-separated values, got {text!r}")
    return parts


@dataclass(frozen=True)
class LogBound:
    """A point in a log: a position (row id), or a time (seconds since the epoch) given to
    a precision: ``since`` is where it starts, ``until`` where it ends (``...35.3`` covers
    that whole tenth of a second)."""

    position: int | None = None
    since: float | None = None
    until: float | None = None


def log_bound(text: str) -> LogBound:
    """An event position (a whole number, as ``kvledger inspect`` prints them) or an ISO time
    (``2026-11-25T03:46:35.319``, UTC unless a zone is given)."""
    if text.strip().isdigit():
        return LogBound(position=int(text))
    if not any(c in text for c in "-:T"):
        raise argparse.ArgumentTypeError(
            f"expected an event position (a whole number) or an ISO time such as "
            f"2026-11-25T03:46:35.319, got {text!r}"
        )
    end = timestamp(text)
    import datetime as dt

    start = dt.datetime.fromisoformat(text)
    if start.tzinfo is None:
        start = start.replace(tzinfo=dt.UTC)
    return LogBound(since=start.timestamp(), until=end)


def input_file(text: str) -> str:
    """A file read at the end of a run: it must exist now, not only after the run."""
    if not Path(text).is_file():
        raise argparse.ArgumentTypeError(f"{text}: no such file")
    return text


def output_file(text: str) -> str:
    """A file to write at the end of a run: its folder must exist now, not after the run."""
    path = Path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a folder; give a file name inside it")
    if not path.parent.is_dir():
        raise argparse.ArgumentTypeError(f"folder {path.parent} does not exist; create it first")
    return text


def log_location(text: str) -> str:
    """A log's SQLite path or SQLAlchemy URL; a folder is refused with what to give instead."""
    import sqlalchemy as sa  # here, not at the top: a command that logs nothing never loads it

    from kvledger.events.log.schema import check_log_url, database_url

    try:
        parsed = sa.make_url(database_url(text))
    except sa.exc.ArgumentError:
        raise argparse.ArgumentTypeError(f"not a SQLite path or SQLAlchemy URL: {text!r}") from None
    try:  # a database kind SQLAlchemy lacks, or one whose driver is missing: said now, by name
        check_log_url(database_url(text))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    folder = Path(parsed.database or "")
    if parsed.get_backend_name() == "sqlite" and parsed.database and folder.is_dir():
        raise argparse.ArgumentTypeError(
            f"{folder} is a folder; give the log file, e.g. {folder / 'events.db'}"
        )
    return text


def _last_digit(iso: str) -> float:
    """The length of time the last digit of an ISO time stands for (a day for a bare date)."""
    _, _, time_part = iso.replace(" ", "T", 1).partition("T")
    clock = re.match(r"(\d\d(?::\d\d){0,2})(?:[.,](\d+))?", time_part)
    if clock is None:
        return 86400.0
    if clock.group(2):
        return 10.0 ** -len(clock.group(2))
    return (3600.0, 60.0, 1.0)[clock.group(1).count(":")]


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None


def add_zmq_args(parser: argparse.ArgumentParser) -> None:
    """The ZMQ stream's flags of ``simulate`` and ``worker``."""
    parser.add_argument(
        "--zmq-endpoint",
        metavar="ENDPOINT",
        help="publish every event as vLLM KVEventBatch on a ZMQ PUB socket bound here",
    )
    parser.add_argument(
        "--zmq-replay-endpoint", metavar="ENDPOINT", help="bind the ZMQ replay socket here"
    )
    parser.add_argument(
        "--zmq-thread",
        action="store_true",
        help="publish from a thread of this process, not from a child process fed by the "
        "log's commits (which keeps the sends off this process's interpreter)",
    )


def zmq_settings(args: argparse.Namespace) -> dict[str, object]:
    """The settings ``add_zmq_args``'s flags give (those not given are left to the
    environment; a replay endpoint without an endpoint is refused by the settings)."""
    values: dict[str, object] = {}
    if getattr(args, "zmq_endpoint", None) is not None:
        values["zmq_endpoint"] = args.zmq_endpoint
        values["zmq_process"] = not args.zmq_thread
    if getattr(args, "zmq_replay_endpoint", None) is not None:
        values["zmq_replay_endpoint"] = args.zmq_replay_endpoint
    return values


def publishing_line(publisher: ZmqPublisher | ZmqPublisherProcess) -> str:
    """The line a command prints once its ZMQ publisher is bound: the endpoints with the ports
    the system picked for ``:*``, where subscribers must connect."""
    where = str(publisher.endpoint)
    if publisher.replay_endpoint is not None:
        where += f" (replay: {publisher.replay_endpoint})"
    return f"publishing KV events on {where}"
