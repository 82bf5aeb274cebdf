"""``kvledger replay LOG``: rebuild the registry from a log and print what it holds."""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import shlex
import sys
import warnings

from kvledger.commands.args import (
    input_file,
    log_location,
    non_negative_int,
    output_file,
    timestamp,
)
from kvledger.events.codec import CodecError
from kvledger.events.log import EventLog
from kvledger.events.log.replay import (
    ReplayReport,
    RowOrderError,
    load_state,
    replay_report,
    save_state,
    verify,
)
from kvledger.events.log.schema import database_url, paste_note, shown_url
from kvledger.progress import Progress
from kvledger.registry.state import RegistryState


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("replay", help="rebuild the registry from an event log")
    p.add_argument(
        "log", metavar="LOG", type=log_location, help="SQLite file path or SQLAlchemy URL"
    )
    p.add_argument(
        "--until", type=non_negative_int, metavar="N", help="stop after each worker's event N"
    )
    p.add_argument(
        "--until-ts",
        type=timestamp,
        metavar="T",
        help="stop at the first event after T (seconds since the epoch, or an ISO time as "
        "`kvledger inspect` prints it)",
    )
    p.add_argument(
        "--until-position",
        type=non_negative_int,
        metavar="P",
        help="stop after the row at position P (a damaged row's error names the last good one)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--no-checkpoints", action="store_true", help="fold the whole log")
    p.add_argument(
        "--verify",
        metavar="DUMP",
        type=input_file,
        help="compare with a state dump; exit 1 if differs",
    )
    p.add_argument(
        "--dump", metavar="FILE", type=output_file, help="write the replayed state to FILE"
    )
    p.set_defaults(func=run)


def summary(state: RegistryState) -> dict[str, object]:
    return {
        "counts": {f"{worker}:{tier.name}": n for (worker, tier), n in state.counts().items()},
        "blocks": sum(state.counts().values()),
        "digest": state.digest(),
        "last_event_id": {str(w): i for w, i in sorted(state.last_event_id.items())},
    }


def _replay(args: argparse.Namespace) -> ReplayReport:
    with EventLog(args.log, read_only=True) as log:
        # The bar shows the position reached in the log (a replay from a checkpoint starts part
        # way): positions can skip and --until stops earlier, so it ends where replay does.
        progress = Progress(log.last_position(), "replay", unit="rows")
        try:
            report = replay_report(
                log,
                until_event_id=args.until,
                until_ts=args.until_ts,
                until_position=args.until_position,
                use_checkpoints=not args.no_checkpoints,
                on_progress=lambda report: progress(report.last_position),
            )
        finally:
            progress.close()
        if not report.state.last_event_id and log.last_position():
            _warn_nothing_selected(args, log)
        return report


def _warn_nothing_selected(args: argparse.Namespace, log: EventLog) -> None:
    """A bound that selects none of a log's events is most likely a mistake (a time from
    another day, another zone): say so, with the log's span, rather than print an empty
    state as if the log were empty."""
    bounds = [
        f"{flag} {value}"
        for flag, value in (
            ("--until", args.until),
            ("--until-ts", None if args.until_ts is None else _when(args.until_ts, floor=True)),
            ("--until-position", args.until_position),
        )
        if value is not None
    ]
    if not bounds:
        return
    s = log.summary()
    span = f"positions {s.first_position}..{s.last_position}"
    if s.first_ts is not None and s.last_ts is not None:
        span += f", {_when(s.first_ts)} .. {_when(s.last_ts)}"
    warnings.warn(
        f"{' '.join(bounds)} selects none of the log's events ({span}; "
        "`kvledger inspect` prints it): the state below is empty",
        stacklevel=2,
    )


def _when(ts: float, *, floor: bool = False) -> str:
    """``ts`` as ``kvledger inspect`` prints times (``floor``: a bound that covers its last
    millisecond, shown as that millisecond)."""
    if floor:
        ts = math.floor(ts * 1000) / 1000
    return dt.datetime.fromtimestamp(ts, dt.UTC).isoformat(timespec="milliseconds")


def run(args: argparse.Namespace) -> int:
    try:
        report = _replay(args)
    except (CodecError, RowOrderError) as exc:
        # a damaged row: say where, and how to replay what comes before it
        hint = ""
        if exc.last_good is not None:
            url = database_url(args.log)
            # the log as the operator gave it, unless that shows a password
            shown = shown_url(url) if paste_note(url) else args.log
            hint = (
                f"; `kvledger replay {shlex.quote(shown)} --until-position "
                f"{exc.last_good}`{paste_note(url)} replays the log up to it"
            )
        print(f"kvledger replay: error: {exc}{hint}", file=sys.stderr)
        return 2
    state = report.state
    if args.dump:
        save_state(args.dump, state)
    differences = verify(state, load_state(args.verify)) if args.verify else []
    out = summary(state)
    out["start_position"] = report.start_position
    out["rows_folded"] = report.rows_folded
    out["events"] = report.events
    out["lookup_records"] = report.lookup_records
    if args.verify:
        out["verify"] = differences
    if args.json:
        print(json.dumps(out, sort_keys=True))
    else:
        print(
            f"replayed {report.events} events and {report.lookup_records} lookup records "
            f"({report.rows_folded} rows) from position {report.start_position}"
        )
        for key, n in out["counts"].items():  # type: ignore[attr-defined]
            print(f"  worker {key.replace(':', ' ')}: {n} blocks")
        print(f"  total: {out['blocks']} blocks, digest {out['digest']}")
        if args.verify:
            print("verify: " + ("states agree" if not differences else "STATES DIFFER"))
            for line in differences:
                print(f"  {line}")
    return 1 if differences else 0
