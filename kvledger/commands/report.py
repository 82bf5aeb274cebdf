"""``kvledger report LOG``: a recorded run over time.

Per window of time: the hit rate per tier of the lookups that arrived, rows per kind, blocks
evicted, offloaded and onboarded, and the requests holding blocks at its end; then the totals
and the hottest prefixes. ``--since`` / ``--until`` take an event position (as ``kvledger
inspect`` prints them) or an ISO time. ``--plot`` draws one PNG with aligned panels.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
from typing import Any, TextIO

from kvledger.commands.args import (
    LogBound,
    log_bound,
    log_location,
    non_negative_int,
    output_file,
    positive_int,
)
from kvledger.events.log import EventLog
from kvledger.events.log.schema import database_url, shown_url
from kvledger.progress import Progress
from kvledger.report import build_report, percent


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "report",
        help="a recorded run over time: hit rates, evictions, copies, hottest prefixes",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("log", metavar="LOG", type=log_location, help="event log: SQLite file or URL")
    p.add_argument("--since", type=log_bound, metavar="POS|TIME", help="start here")
    p.add_argument("--until", type=log_bound, metavar="POS|TIME", help="end here")
    p.add_argument("--windows", type=positive_int, default=20, metavar="N", help="default 20")
    p.add_argument("--worker", type=non_negative_int, metavar="N", help="one worker only")
    p.add_argument("--top", type=positive_int, default=10, metavar="N", help="hottest prefixes")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.add_argument("--plot", metavar="FILE.png", type=output_file, help="one PNG, aligned panels")
    p.set_defaults(func=run)


def report(args: argparse.Namespace) -> dict[str, Any]:
    since: LogBound = args.since or LogBound()
    until: LogBound = args.until or LogBound()
    url = database_url(args.log)
    with EventLog(url, read_only=True) as log:
        # the bar shows the position reached, as replay's does
        progress = Progress(until.position or log.last_position(), "report", unit="rows")
        try:
            out = build_report(
                log,
                since_position=since.position or 1,
                until_position=until.position,
                since_ts=since.since,
                until_ts=until.until,
                windows=args.windows,
                worker=args.worker,
                top=args.top,
                on_progress=progress,
            )
        finally:
            progress.close()
    out["log"] = shown_url(url)
    if args.plot:
        from kvledger.plots import plot_report  # matplotlib: only --plot loads it

        plot_report(out, args.plot)
        out["plot"] = args.plot
    return out


def _when(ts: float) -> str:
    return dt.datetime.fromtimestamp(ts, dt.UTC).isoformat(timespec="milliseconds")


def print_table(out: dict[str, Any], file: TextIO | None = None) -> None:
    file = sys.stdout if file is None else file  # the stdout of now, not of import
    t = out["totals"]
    print(
        f"{out['log']}: positions {t['first_position']}..{t['last_position']}, "
        f"{_when(out['since_ts'])} .. {_when(out['until_ts'])}, "
        f"{len(out['windows'])} windows of {out['window_s']:.3g} s",
        file=file,
    )
    for r in out["runs"]:
        print(
            f"run at position {r['position']}: worker {r['worker']}, G1 {r['g1_blocks']} "
            f"G2 {r['g2_blocks']} G3 {r['g3_blocks']} blocks of {r['block_size']} tokens, "
            f"policy {r['policy']}, offload filter {r['offload_filter']}",
            file=file,
        )
    print(
        f"\n{'window from':<12} {'lookups':>7} {'hit':>6} {'G1':>6} {'G2':>6} {'G3':>6} "
        f"{'evicted':>8} {'offload':>8} {'onboard':>8} {'in flight':>9} {'rows':>7}",
        file=file,
    )
    for w in [*out["windows"], None]:
        name = "total" if w is None else f"+{w['start_ts'] - out['since_ts']:.3f} s"
        w = t if w is None else w
        tiers = " ".join(f"{percent(w['hit_rate_by_tier'][k]):>6}" for k in ("G1", "G2", "G3"))
        print(
            f"{name:<12} {w['lookups']:>7} {percent(w['hit_rate']):>6} {tiers} "
            f"{sum(w['evicted_blocks'].values()):>8} {sum(w['offloaded_blocks'].values()):>8} "
            f"{sum(w['onboarded_blocks'].values()):>8} {w['requests_in_flight']:>9} "
            f"{sum(w['rows_by_kind'].values()):>7}",
            file=file,
        )
    kinds = ", ".join(f"{k} {n}" for k, n in t["rows_by_kind"].items())
    print(f"\nrows by kind: {kinds}", file=file)
    if out["hottest_prefixes"]:
        print("\nhottest prefixes (asked, hit, block index, sequence hash):", file=file)
        for p in out["hottest_prefixes"]:
            print(f"  {p['asked']:>7} {p['hit']:>7}  block {p['block']:>4}  {p['sequence_hash']}",
                  file=file)  # fmt: skip
    if "plot" in out:
        print(f"\nplot: {out['plot']}", file=file)


def run(args: argparse.Namespace) -> int:
    out = report(args)
    if args.json:
        print(json.dumps(out, sort_keys=True))
    else:
        print_table(out)
    return 0
