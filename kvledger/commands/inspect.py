"""``kvledger inspect LOG``: what a log holds (events by kind and tier, workers, time span);
with ``--check``, every damaged row in it."""

from __future__ import annotations

import argparse
import datetime as dt
import json

from kvledger.commands.args import log_location
from kvledger.events.codec import LOG_RECORD_VERSION, UNCHECKED_VERSION
from kvledger.events.log import EventLog
from kvledger.events.log.check import CheckReport, check_log, record_versions
from kvledger.events.log.reader import LogSummary
from kvledger.events.log.schema import shown_url
from kvledger.events.types import LOOKUP_KINDS
from kvledger.progress import Progress


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("inspect", help="summarise an event log")
    p.add_argument(
        "log", metavar="LOG", type=log_location, help="SQLite file path or SQLAlchemy URL"
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument(
        "--check",
        action="store_true",
        help="read every row, verify its checksum and columns; exit 1 if any row is damaged",
    )
    p.set_defaults(func=run)


def _when(ts: float | None) -> str:
    if ts is None:
        return "-"
    return dt.datetime.fromtimestamp(ts, dt.UTC).isoformat(timespec="milliseconds")


def _versions(first: int | None, last: int | None) -> str:
    """What the record versions of the first and last rows mean for checking the log."""
    if first is None and last is None:
        return "-"
    if first == last == LOG_RECORD_VERSION:
        return f"version {LOG_RECORD_VERSION}, every row with a checksum"
    if first == last == UNCHECKED_VERSION:
        return (
            f"version {UNCHECKED_VERSION}, written before checksums: damage to a row cannot be "
            f"detected (--check still checks every row's structure and columns)"
        )
    if first == UNCHECKED_VERSION and last == LOG_RECORD_VERSION:
        return (
            f"versions {UNCHECKED_VERSION} then {LOG_RECORD_VERSION}: "
            "the older rows carry no checksum"
        )
    return f"first row version {first!r}, last row version {last!r}"


def _check(log: EventLog, last_position: int) -> CheckReport:
    progress = Progress(last_position, "check", unit="rows")
    try:
        return check_log(log, on_progress=progress)
    finally:
        progress.close()


def run(args: argparse.Namespace) -> int:
    with EventLog(args.log, read_only=True) as log:
        url = shown_url(log.url)
        try:
            s = log.summary()
        except ValueError as exc:  # a damaged column (a tier that is none)
            if not args.check:
                raise ValueError(
                    f"cannot summarise {url} ({exc}); `kvledger inspect --check` lists its "
                    f"damaged rows"
                ) from None
            return _damaged_summary(args, url, str(exc), _check(log, log.last_position()))
        versions = _versions(*record_versions(log))
        check = _check(log, s.last_position or 0) if args.check else None
    status = 1 if check is not None and check.damaged else 0
    if args.json:
        print(
            json.dumps(
                {
                    "log": url,
                    "rows": s.rows,
                    "events": s.rows - _lookup_records(s),
                    "lookup_records": _lookup_records(s),
                    "positions": [s.first_position, s.last_position],
                    "time_span": [s.first_ts, s.last_ts],
                    "by_kind_tier": {
                        f"{k}:{t.name}": n for (k, t), n in sorted(s.by_kind_tier.items())
                    },
                    "workers": {
                        str(w): {"events": n, "first_id": lo, "last_id": hi}
                        for w, (n, lo, hi) in sorted(s.workers.items())
                    },
                    "checkpoints": s.checkpoints,
                    "records": versions,
                    **({} if check is None else {"check": _check_json(check)}),
                },
                sort_keys=True,
            )
        )
        return status
    print(f"log: {url}")
    lookups = _lookup_records(s)
    print(
        f"rows: {s.rows} (positions {s.first_position}..{s.last_position}): "
        f"{s.rows - lookups} events, {lookups} lookup records"
    )
    span = (s.last_ts - s.first_ts) if s.first_ts is not None and s.last_ts is not None else 0.0
    print(f"time: {_when(s.first_ts)} .. {_when(s.last_ts)} ({span:.3f} s)")
    print("by kind and tier:")
    for (kind, tier), n in sorted(s.by_kind_tier.items()):
        print(f"  {kind:<10} {tier.name}: {n}")
    print(f"workers: {len(s.workers)}")
    for worker, (n, lo, hi) in sorted(s.workers.items()):
        gap = "" if hi - lo + 1 == n else f"  ({hi - lo + 1 - n} ids missing)"
        print(f"  worker {worker}: {n} events, ids {lo}..{hi}{gap}")
    print(
        f"checkpoints: {len(s.checkpoints)}"
        + (f" (newest at {s.checkpoints[-1]})" if s.checkpoints else "")
    )
    print(f"records: {versions}")
    if check is not None:
        _print_check(check)
    return status


def _lookup_records(s: LogSummary) -> int:
    """Rows that are lookup records (lookup, release, run), not events."""
    return sum(n for (kind, _tier), n in s.by_kind_tier.items() if kind in LOOKUP_KINDS)


def _damaged_summary(args: argparse.Namespace, url: str, error: str, check: CheckReport) -> int:
    """The check's findings when the summary itself failed on a damaged column."""
    if args.json:
        print(json.dumps({"log": url, "summary_error": error, "check": _check_json(check)}))
        return 1
    print(f"log: {url}")
    print(f"summary: cannot be made ({error})")
    _print_check(check)
    return 1


def _print_check(check: CheckReport) -> None:
    print(
        f"check: {check.rows} rows read, {check.with_checksum} checksums verified, "
        f"{check.without_checksum} rows without one, {len(check.damaged)} damaged"
    )
    for row in check.damaged:
        print(f"  position {row.position}: {row.problem}")


def _check_json(check: CheckReport) -> dict[str, object]:
    return {
        "rows": check.rows,
        "with_checksum": check.with_checksum,
        "without_checksum": check.without_checksum,
        "damaged": [{"position": r.position, "problem": r.problem} for r in check.damaged],
    }
