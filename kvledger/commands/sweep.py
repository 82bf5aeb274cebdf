"""``kvledger sweep``: the same workload at several G1 capacities (and policies), hit rate
against capacity, with the infinite-cache ceiling.

Runs keep no event log (only the hit rates matter here), so a sweep costs little more than
the replays themselves.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from kvledger.commands.args import output_file
from kvledger.commands.simulate import (
    add_workload_args,
    build_cache,
    engine_clock,
    load_workload,
    run_workload,
    settings_from_args,
)
from kvledger.mocker.stats import EventCounter, infinite_cache
from kvledger.progress import Progress
from kvledger.registry.emitter import EventEmitter


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "sweep",
        help="prefix-hit rate of a workload at several G1 capacities",
        description=__doc__,
    )
    add_workload_args(p, engine_default="off", several_policies=True)
    p.add_argument(
        "--capacities",
        metavar="N,N,...",
        help="G1 sizes in blocks (default: 1/8, 1/4, 1/2, 1 and 2 times settings' g1_blocks)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.add_argument(
        "--plot", metavar="FILE.png", type=output_file, help="chart hit rate against capacity"
    )
    p.set_defaults(func=run)


def parse_capacities(text: str | None, g1_blocks: int) -> list[int]:
    if text is None:
        return sorted(
            {n for n in (g1_blocks // 8, g1_blocks // 4, g1_blocks // 2) if n}
            | {
                g1_blocks,
                2 * g1_blocks,
            }
        )
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ValueError(f"--capacities takes comma-separated block counts, got {text!r}") from None
    if not values or min(values) <= 0:
        raise ValueError(f"--capacities must be positive block counts, got {text!r}")
    return sorted(set(values))


def run(args: argparse.Namespace) -> int:
    if args.g1_blocks is not None:
        raise ValueError("sweep sets G1 itself; give --capacities instead of --g1-blocks")
    policies: list[str | None] = list(args.policy or [None])
    args.policy = None
    base = settings_from_args(args)
    requests, workload = load_workload(args, base)
    capacities = parse_capacities(args.capacities, base.g1_blocks)
    points: list[dict[str, Any]] = []
    for policy, capacity in ((p, c) for p in policies for c in capacities):
        update: dict[str, Any] = {"g1_blocks": capacity}
        if policy is not None:
            update["eviction_policy"] = policy
        settings = base.replace(**update)
        counter = EventCounter()
        clock = engine_clock(args)
        emitter = EventEmitter(
            counter, worker_id=settings.worker_id, clock=time.time if clock is None else clock
        )
        cache = build_cache(settings, emitter)
        progress = Progress(len(requests), f"G1 {capacity:>7}")
        try:
            stats = run_workload(
                cache,
                requests,
                settings,
                clock=clock,
                speedup=args.speedup,
                progress=progress,
            )
        finally:
            progress.close()
        s = stats.summary(cache, counter)
        point = {
            "policy": settings.eviction_policy,
            "g1_blocks": capacity,
            "hit_rate": s["hit_rate"],
            "token_hit_rate": s["token_hit_rate"],
            "hits_by_tier": s["hits_by_tier"],
        }
        for key in ("ttft_ms_p50", "ttft_ms_p99", "preemptions"):
            if key in s:
                point[key] = s[key]
        points.append(point)
    ceiling_blocks, ceiling_tokens = infinite_cache(requests, base.block_size)
    out: dict[str, Any] = {
        "workload": workload,
        "requests": len(requests),
        "block_size": base.block_size,
        "policy": ",".join(sorted({p["policy"] for p in points})),
        "engine": args.engine,
        "points": points,
        "ceiling": {
            "hit_rate": round(ceiling_blocks, 6),
            "token_hit_rate": round(ceiling_tokens, 6),
        },
    }
    if args.plot:
        from kvledger.plots import plot_hit_rate_lines  # matplotlib: only --plot loads it

        series: dict[str, list[tuple[int, float, float | None]]] = {}
        for p in points:
            series.setdefault(p["policy"], []).append(
                (p["g1_blocks"], p["hit_rate"], p["token_hit_rate"])
            )
        lower = [f"G2 {base.g2_capacity}"] if base.g2_capacity else []
        lower += [f"G3 {base.g3_capacity} ({base.offload_filter})"] if base.g3_capacity else []
        plot_hit_rate_lines(
            series,
            args.plot,
            title=f"kvledger sweep: {workload}",
            subtitle=(
                f"{len(requests)} requests, blocks of {base.block_size} tokens, engine "
                f"{args.engine}; " + (", ".join(lower) + " blocks below G1" if lower else "G1 only")
            ),
            ceiling=ceiling_blocks,
        )
        out["plot"] = args.plot
    if args.json:
        print(json.dumps(out, sort_keys=True))
        return 0
    print(
        f"{workload}: {len(requests)} requests, block size {base.block_size}, "
        f"engine {args.engine}; an infinite cache would hit {ceiling_blocks:.2%} of blocks, "
        f"{ceiling_tokens:.2%} of tokens"
    )
    header = f"{'policy':>9}  {'G1 blocks':>10}  {'hit rate':>8}  {'token hit':>9}"
    if args.engine == "on":
        header += f"  {'TTFT p50 ms':>11}  {'p99 ms':>9}"
    print(header)
    for p in points:
        line = (
            f"{p['policy']:>9}  {p['g1_blocks']:>10}  {p['hit_rate']:>8.2%}  "
            f"{p['token_hit_rate']:>9.2%}"
        )
        if "ttft_ms_p50" in p:
            line += f"  {p['ttft_ms_p50']:>11.1f}  {p['ttft_ms_p99']:>9.1f}"
        print(line)
    if args.plot:
        print(f"plot: {args.plot}", file=sys.stdout)
    return 0
