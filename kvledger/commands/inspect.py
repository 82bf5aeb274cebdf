"""``kvledger inspect LOG``: what a log holds (events by kind and tier, workers, time span)."""

from __future__ import annotations

import argparse
import datetime as dt
import json

from kvledger.commands.args import log_location
from kvledger.events.log import EventLog
from kvledger.events.schema import shown_url


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("inspect", help="summarise an event log")
    p.add_argument(
        "log", metavar="LOG", type=log_location, help="SQLite file path or SQLAlchemy URL"
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run)


def _when(ts: float | None) -> str:
    if ts is None:
        return "-"
    return dt.datetime.fromtimestamp(ts, dt.UTC).isoformat(timespec="milliseconds")


def run(args: argparse.Namespace) -> int:
    with EventLog(args.log, read_only=True) as log:
        s = log.summary()
        url = shown_url(log.url)
    if args.json:
        print(
            json.dumps(
                {
                    "log": url,
                    "events": s.rows,
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
                },
                sort_keys=True,
            )
        )
        return 0
    print(f"log: {url}")
    print(f"events: {s.rows} (positions {s.first_position}..{s.last_position})")
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
    return 0
