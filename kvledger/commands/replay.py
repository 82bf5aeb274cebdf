"""``kvledger replay LOG``: rebuild the registry from a log and print what it holds."""

from __future__ import annotations

import argparse
import json
import shlex
import sys

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
            return replay_report(
                log,
                until_event_id=args.until,
                until_ts=args.until_ts,
                until_position=args.until_position,
                use_checkpoints=not args.no_checkpoints,
                on_progress=lambda report: progress(report.last_position),
            )
        finally:
            progress.close()


def run(args: argparse.Namespace) -> int:
    try:
        report = _replay(args)
    except (CodecError, RowOrderError) as exc:
        # a damaged row: say where, and how to replay what comes before it
        hint = ""
        if exc.last_good is not None:
            hint = (
                f"; `kvledger replay {shlex.quote(args.log)} --until-position {exc.last_good}` "
                f"replays the log up to it"
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
    if args.verify:
        out["verify"] = differences
    if args.json:
        print(json.dumps(out, sort_keys=True))
    else:
        print(f"replayed {report.rows_folded} events from position {report.start_position}")
        for key, n in out["counts"].items():  # type: ignore[attr-defined]
            print(f"  worker {key.replace(':', ' ')}: {n} blocks")
        print(f"  total: {out['blocks']} blocks, digest {out['digest']}")
        if args.verify:
            print("verify: " + ("states agree" if not differences else "STATES DIFFER"))
            for line in differences:
                print(f"  {line}")
    return 1 if differences else 0
