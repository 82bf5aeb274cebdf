"""``kvledger whatif LOG``: what a recorded run would have hit with other cache settings.

Re-runs the run's lookup records (what each request asked for, in recorded order) through a
simulated cache, first with the settings the run had (the baseline, which must give back every
recorded hit count), then with each combination of the values given: several values of a flag
make a sweep. ``--since`` / ``--until`` (an event position or an ISO time) pick the lookups that
count; everything before ``--since`` is re-run too, so the cache is as warm as it was.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from typing import Any, TextIO

from kvledger.commands.args import (
    LogBound,
    choices,
    log_bound,
    log_location,
    non_negative_int,
    non_negative_ints,
    output_file,
    positive_ints,
)
from kvledger.commands.cluster_args import is_cluster_folder
from kvledger.commands.simulate import POLICIES
from kvledger.events.log import EventLog
from kvledger.events.log.schema import database_url, shown_url
from kvledger.mocker.rerun import CacheSettings, alternatives, ceiling, load_run, recorded, rerun
from kvledger.mocker.routing import ROUTERS
from kvledger.progress import Progress
from kvledger.registry.tiered import OFFLOAD_FILTERS


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "whatif",
        help="re-run a recorded run's lookups under other cache settings",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "log",
        metavar="LOG",
        type=log_or_cluster,
        help="event log (SQLite file or URL), or a cluster run's log folder",
    )
    p.add_argument("--worker", type=non_negative_int, metavar="N", help="whose lookups")
    p.add_argument(
        "--workers",
        type=positive_ints,
        metavar="N[,N...]",
        help="a cluster folder: re-run the cluster with N workers",
    )
    p.add_argument(
        "--router",
        type=choices(ROUTERS),
        metavar="|".join(ROUTERS),
        help="a cluster folder: re-run the cluster with this router",
    )
    p.add_argument("--g1-blocks", type=positive_ints, metavar="N[,N...]")
    p.add_argument("--g2-blocks", type=non_negative_ints, metavar="N[,N...]", help="0: no G2")
    p.add_argument("--g3-blocks", type=non_negative_ints, metavar="N[,N...]", help="0: no G3")
    p.add_argument("--policy", type=choices(POLICIES), metavar="|".join(POLICIES))
    p.add_argument(
        "--offload-filter", type=choices(OFFLOAD_FILTERS), metavar="|".join(OFFLOAD_FILTERS)
    )
    p.add_argument("--since", type=log_bound, metavar="POS|TIME", help="count lookups from here")
    p.add_argument("--until", type=log_bound, metavar="POS|TIME", help="stop after here")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.add_argument("--plot", metavar="FILE.png", type=output_file, help="chart the hit rates")
    p.set_defaults(func=run)


def log_or_cluster(text: str) -> str:
    """An event log, or a cluster run's log folder (one log per worker and its manifest)."""
    if is_cluster_folder(text):
        return text
    return log_location(text)


def whatif(args: argparse.Namespace) -> dict[str, Any]:
    since: LogBound = args.since or LogBound()
    until: LogBound = args.until or LogBound()
    url = database_url(args.log)
    with EventLog(url, read_only=True) as log:
        # progress as replay's: the rows read, then the lookup records re-run
        reading = Progress(until.position or log.last_position(), "whatif: read", unit="rows")
        try:
            run = load_run(
                log,
                worker=args.worker,
                since_position=since.position or 1,
                since_ts=since.since,
                until_position=until.position,
                until_ts=until.until,
                on_progress=reading,
            )
        finally:
            reading.close()
    base = run.settings
    others = [
        alt
        for alt in alternatives(
            base,
            g1_blocks=args.g1_blocks,
            g2_blocks=args.g2_blocks,
            g3_blocks=args.g3_blocks,
            policies=args.policy,
            offload_filters=args.offload_filter,
        )
        if alt != base
    ]
    per_run = len(run.records)
    progress = Progress(per_run * (1 + len(others)), "whatif", unit="lookup records")
    started = time.perf_counter()
    try:
        runs = [rerun(run, base, compare=True, on_progress=progress)]
        for i, alt in enumerate(others, 1):
            runs.append(rerun(run, alt, on_progress=_from(i * per_run, progress)))
    finally:
        progress.close()
    baseline = runs[0]
    elapsed = time.perf_counter() - started
    lookups = sum(1 for _ in run.records) * len(runs)
    had = recorded(run)
    out: dict[str, Any] = {
        "log": shown_url(url),
        "worker": run.worker,
        "block_size": run.block_size,
        "records": len(run.records),
        "recorded": {"settings": _settings(base), **had.summary()},
        "ceiling": ceiling(run).summary(),
        "baseline_reproduces": not baseline.mismatches,
        "lookups_compared": baseline.compared,
        "runs": [r.summary() for r in runs],
        "wall_s": round(elapsed, 3),
        "records_per_s": round(lookups / elapsed) if elapsed else None,
    }
    if args.plot:
        from kvledger.plots import plot_whatif  # matplotlib: only --plot loads it

        plot_whatif(out, args.plot)
        out["plot"] = args.plot
    return out


def _from(offset: int, progress: Progress) -> Callable[[int], None]:
    """A re-run's progress as part of the whole sweep's: its records start at ``offset``."""
    return lambda done: progress(offset + done)


def _settings(s: CacheSettings) -> dict[str, Any]:
    return {
        "g1_blocks": s.g1_blocks,
        "g2_blocks": s.g2_blocks,
        "g3_blocks": s.g3_blocks,
        "policy": s.policy,
        "offload_filter": s.offload_filter,
    }


def _row(name: str, s: dict[str, Any], ref: float | None = None, width: int = 44) -> str:
    tiers = "  ".join(f"{100 * s['hit_rate_by_tier'][t]:6.2f}" for t in ("G1", "G2", "G3"))
    token = s["token_hit_rate"]
    token_text = f"{100 * token:8.2f}" if token is not None else f"{'-':>8}"
    delta = f"{100 * (s['hit_rate'] - ref):+7.2f}" if ref is not None else f"{'':>7}"
    return f"{name:<{width}} {100 * s['hit_rate']:7.2f}  {tiers}  {token_text}  {delta}"


def print_table(out: dict[str, Any], file: TextIO | None = None) -> None:
    file = sys.stdout if file is None else file  # the stdout of now, not of import
    rec = out["recorded"]
    names = [f"the run had ({CacheSettings(**rec['settings']).label()})"] + [
        ("baseline: " if i == 0 else "") + CacheSettings(**r["settings"]).label()
        for i, r in enumerate(out["runs"])
    ]
    width = max(map(len, names)) + 1
    print(
        f"{out['log']}, worker {out['worker']}: {rec['lookups']} lookups counted "
        f"({out['records']} lookup records), block size {out['block_size']}",
        file=file,
    )
    print(
        f"{'hit rate, % of blocks asked':<{width}} {'total':>7}  {'G1':>6}  {'G2':>6}  {'G3':>6}  "
        f"{'tokens':>8}  {'vs run':>7}",
        file=file,
    )
    ref = rec["hit_rate"]
    print(_row(names[0], rec, width=width), file=file)
    for name, r in zip(names[1:], out["runs"], strict=True):
        print(_row(name, r, ref, width), file=file)
    print(_row("infinite cache (ceiling)", out["ceiling"], ref, width), file=file)
    if out["baseline_reproduces"]:
        print(
            f"\nThe baseline reproduces all {out['lookups_compared']} recorded lookups' hits.",
            file=file,
        )
    else:
        base = out["runs"][0]
        print(
            f"\nBASELINE DIFFERS: {base['lookups_differing']} of {out['lookups_compared']} "
            f"lookups hit otherwise than recorded (first: {base['first_differences'][0]}); "
            "the run did something the re-run does not model (see docs/whatif.md).",
            file=file,
        )
    if "plot" in out:
        print(f"plot: {out['plot']}", file=file)


def run(args: argparse.Namespace) -> int:
    if is_cluster_folder(args.log):
        if args.policy or args.offload_filter or args.since or args.until or args.worker:
            raise ValueError(
                "a cluster folder is re-run whole: --workers, --router and the tier sizes "
                "apply to it; --worker, --policy, --offload-filter, --since and --until "
                "apply to one worker's log (give LOG/worker-N.db)"
            )
        from kvledger.commands.cluster import print_whatif_cluster, whatif_cluster

        cluster = whatif_cluster(args)
        if args.plot:
            from kvledger.plots import plot_cluster

            plot_cluster(cluster["runs"], args.plot, title=f"kvledger whatif: {args.log}")
            cluster["plot"] = args.plot
        if args.json:
            print(json.dumps(cluster, sort_keys=True))
        else:
            print_whatif_cluster(cluster)
        return 0 if cluster["baseline_reproduces"] or cluster["feed_recorded"] != "memory" else 1
    if args.workers or args.router:
        raise ValueError("--workers and --router re-run a cluster: give its log folder")
    out = whatif(args)
    if args.json:
        print(json.dumps(out, sort_keys=True))
    else:
        print_table(out)
    return 0 if out["baseline_reproduces"] else 1
