"""A cluster of kvledger's mock engines against Dynamo's multi-worker replay, then what Dynamo's
replay cannot show: lower tiers under the KV router, and the router's feed.

Agreement. For each Mooncake trace (conversation, synthetic), N = 2, 4 and 8 workers of
``--g1-blocks`` (4,096) blocks of 512 tokens each, Dynamo's engine defaults, and arrivals N
times faster than the trace (so each worker sees the trace's own rate, as one worker does in
``mocker_agreement_bench.py``), the bench runs Dynamo's ``run_mocker_trace_replay(...,
num_workers=N, router_mode=round_robin|kv_router, arrival_speedup_ratio=N)`` and ``kvledger
simulate --workers N --router round_robin|kv --arrival-speedup N --dynamo --no-log``, each as
a fresh process (``dynamo_replay.py`` beside this file says how), and compares TTFT p50 and
p99, mean TPOT and the token reuse over every admission (Dynamo's
``prefix_cache_reused_ratio``): within 5%.

Ties. Round robin is deterministic, and both give the same figures run after run. Dynamo's KV
router breaks ties between equally cheap workers at random, from an unseeded generator, and a
tie early on (every worker empty) changes what follows; kvledger's breaks them with a seeded
one. So for the KV router each side runs ``--seeds`` times (Dynamo: that many fresh processes;
kvledger: ``--seed 0..S-1``; default 10 on the conversation trace, 30 on the synthetic one,
whose outcomes split between two basins) and the means are compared; the spread (min to max)
of each side is printed beside them.

Speed: the wall and CPU (user + system) time of each whole process (start, trace load,
replay, report): for round robin the best of ``--repeat`` runs, for the KV router the sum over
its runs, on each side; the ratio is Dynamo's over kvledger's (1 or more: kvledger is at least
as fast). Dynamo's cluster replays run with ``DYN_LOG=warn`` (its KV router logs each
decision at INFO otherwise).

Beyond Dynamo (``--beyond``, on by default), at N = 8 on the conversation trace with the KV
router: G1 alone against G1 + G2 + G3 (``--g2-blocks``, ``--g3-blocks``: host and disk hits
weighed 0.75 and 0.25 by the router), and the router fed in memory, in memory with a
simulated delay, through the real ZMQ publishers, and through the shared registry in Redis
(``--redis-url``, default ``KVLEDGER_REDIS_URL``; the row is skipped without one), with the
index staleness each feed left at routing time.

Run: .venv/bin/python bench/cluster_bench.py [--seeds N] [--repeat 3] [--requests N] [--no-beyond]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from dynamo_replay import Cluster, child_env, run_dynamo, run_kvledger, warm_up

SHARED_DATA = Path(
    os.environ.get("KVLEDGER_SHARED_DATA", Path(__file__).resolve().parents[2] / "shared/data")
)
TRACES = ("conversation_trace.jsonl", "synthetic_trace.jsonl")
WORKERS = (2, 4, 8)
TOLERANCE = 0.05
METRICS = (
    ("TTFT p50 ms", "ttft_p50"),
    ("TTFT p99 ms", "ttft_p99"),
    ("TPOT mean ms", "tpot_mean"),
    ("token reuse, all admissions", "hits_all"),
)


def agrees(ours: float, theirs: float) -> bool:
    if theirs == 0:
        return ours == 0
    return abs(ours - theirs) / abs(theirs) <= TOLERANCE


def agreement(args: argparse.Namespace) -> tuple[int, list[str]]:
    failures = 0
    rows: list[str] = []
    for name in args.trace or TRACES:
        trace = SHARED_DATA / "mooncake" / name
        warm_up(trace)
        for n in args.workers or WORKERS:
            for router in ("round_robin", "kv"):
                # round robin: the same figures every run, so the runs only time it (best of
                # --repeat); KV router: --seeds runs whose figures are averaged, time summed
                seeds = args.seeds or (30 if name.startswith("synthetic") else 10)
                runs = args.repeat if router == "round_robin" else seeds
                dyn: list[dict[str, Any]] = []
                ours: list[dict[str, Any]] = []
                dyn_walls: list[float] = []
                kv_walls: list[float] = []
                for seed in range(runs):
                    cluster = Cluster(n, router, float(n), seed)
                    wall, figures = run_dynamo(
                        trace, args.g1_blocks, args.requests, cluster=cluster
                    )
                    dyn.append(figures)
                    dyn_walls.append(wall)
                    wall, figures = run_kvledger(trace, args.g1_blocks, args.requests, cluster)
                    ours.append(figures)
                    kv_walls.append(wall)
                if router == "round_robin":
                    dyn_wall, kv_wall = min(dyn_walls), min(kv_walls)
                    dyn_cpu = min(d["cpu_s"] for d in dyn)
                    kv_cpu = min(o["cpu_s"] for o in ours)
                else:
                    dyn_wall, kv_wall = sum(dyn_walls), sum(kv_walls)
                    dyn_cpu = sum(d["cpu_s"] for d in dyn)
                    kv_cpu = sum(o["cpu_s"] for o in ours)
                label = (
                    f"round_robin, best of {runs}"
                    if router == "round_robin"
                    else f"kv, {runs} runs each (figures: their mean)"
                )
                print(
                    f"\n{name}, {n} workers x G1 {args.g1_blocks} blocks, arrivals x{n}, "
                    f"{label} ({dyn[0]['requests']} requests)"
                )
                print(f"  {'metric':<29}{'Dynamo':>12}{'kvledger':>12}{'diff':>8}  within 5%")
                row_ok = True
                for label_, key in METRICS:
                    theirs = statistics.mean(d[key] for d in dyn)
                    mine = statistics.mean(o[key] for o in ours)
                    ok = agrees(mine, theirs)
                    row_ok = row_ok and ok
                    fmt = ".4f" if key == "hits_all" else ".1f"
                    spread = ""
                    if router == "kv" and runs > 1:
                        spread = (
                            f"   Dynamo {min(d[key] for d in dyn):{fmt}}-"
                            f"{max(d[key] for d in dyn):{fmt}}, kvledger "
                            f"{min(o[key] for o in ours):{fmt}}-{max(o[key] for o in ours):{fmt}}"
                        )
                    diff = (mine - theirs) / theirs if theirs else 0.0
                    print(
                        f"  {label_:<29}{theirs:>12{fmt}}{mine:>12{fmt}}{diff:>+8.1%}  "
                        f"{'yes' if ok else 'NO'}{spread}"
                    )
                failures += not row_ok
                ratio = dyn_wall / kv_wall
                cpu_ratio = dyn_cpu / kv_cpu
                how = "best run" if router == "round_robin" else f"{runs} runs"
                print(
                    f"  whole processes ({how}): Dynamo {dyn_wall:.2f} s wall, {dyn_cpu:.2f} s "
                    f"cpu; kvledger {kv_wall:.2f} s wall, {kv_cpu:.2f} s cpu; ratio Dynamo / "
                    f"kvledger {ratio:.2f} wall, {cpu_ratio:.2f} cpu"
                )
                rows.append(
                    f"| {name.split('_')[0]} | {n} | {router} | "
                    + " | ".join(
                        f"{statistics.mean(d[k] for d in dyn):.4g} / "
                        f"{statistics.mean(o[k] for o in ours):.4g}"
                        for _, k in METRICS
                    )
                    + f" | {ratio:.2f} | {cpu_ratio:.2f} |"
                )
    return failures, rows


def simulate(args: argparse.Namespace, *extra: str) -> dict[str, Any]:
    trace = SHARED_DATA / "mooncake" / "conversation_trace.jsonl"
    cmd = [sys.executable, "-m", "kvledger.cli", "simulate", "--trace", str(trace), "--dynamo"]
    cmd += ["--g1-blocks", str(args.g1_blocks), "--no-log", "--json", "--workers", "8"]
    cmd += ["--router", "kv", "--arrival-speedup", "8"]
    if args.requests is not None:
        cmd += ["--requests", str(args.requests)]
    proc = subprocess.run(cmd + list(extra), capture_output=True, text=True, env=child_env())
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd + list(extra))} failed:\n{proc.stderr}")
    out: dict[str, Any] = json.loads(proc.stdout)
    return out["cluster"]


def beyond(args: argparse.Namespace) -> None:
    runs = args.beyond_runs
    print(
        f"\nBeyond Dynamo's replay: conversation trace, 8 workers, KV router, arrivals x8, "
        f"G1 {args.g1_blocks} blocks per worker; each line the mean of {runs} runs "
        f"(--seed 0..{runs - 1}; a real feed's lag differs run to run), TTFT p50 range beside it"
    )
    print(
        f"  {'configuration':<42}{'TTFT p50 (range)':>22}{'p99':>7}{'TPOT':>6}{'hit':>7}"
        f"{'G1':>6}{'G2':>6}{'G3':>6}{'reuse':>7}  {'index behind: p99 events, stale':<33}"
        f"{'loop s':>6}"
    )
    tiers = ("--g2-blocks", str(args.g2_blocks), "--g3-blocks", str(args.g3_blocks))
    configs: list[tuple[str, tuple[str, ...]]] = [
        ("G1 only, memory feed", ()),
        (f"G1 + G2 {args.g2_blocks} + G3 {args.g3_blocks}, memory", tiers),
        ("G1 only, memory feed + 1 s delay", ("--feed-delay-ms", "1000")),
        ("G1 only, memory feed + 10 s delay", ("--feed-delay-ms", "10000")),
        ("G1 only, memory feed + 60 s delay", ("--feed-delay-ms", "60000")),
        ("G1 only, ZMQ feed (unpaced)", ("--router-feed", "zmq")),
    ]
    redis_url = args.redis_url or os.environ.get("KVLEDGER_REDIS_URL")
    if redis_url:
        configs.append(
            ("G1 only, Redis feed (unpaced)", ("--router-feed", "redis", "--redis-url", redis_url))
        )
    else:
        print("  (Redis feed skipped: give --redis-url or set KVLEDGER_REDIS_URL)")
    for label, extra in configs:
        out = [simulate(args, *extra, "--seed", str(seed)) for seed in range(runs)]

        def mean(key: str, results: list[dict[str, Any]] = out) -> float:
            return statistics.mean(float(c[key]) for c in results)

        p50 = [c["ttft_ms_p50"] for c in out]
        by = {t: statistics.mean(c["hit_rate_by_tier"][t] for c in out) for t in ("G1", "G2", "G3")}
        stale = "-"
        if "router_events_behind" in out[0]:
            b99 = statistics.mean(c["router_events_behind"]["p99"] for c in out)
            share = statistics.mean(c["router_events_behind"]["stale_decisions"] for c in out)
            stale = f"{b99:.0f}, {100 * share:.0f}% of decisions"
        print(
            f"  {label:<42}{mean('ttft_ms_p50'):>9.0f} ({min(p50):.0f}-{max(p50):.0f})"
            f"{mean('ttft_ms_p99'):>7.0f}{mean('tpot_ms_mean'):>6.1f}"
            f"{100 * mean('hit_rate'):>6.1f}%"
            + "".join(f"{100 * by[t]:>5.1f}%" for t in ("G1", "G2", "G3"))
            + f"{100 * mean('token_hit_rate_all_admissions'):>6.1f}%  {stale:<33}"
            f"{mean('wall_s'):>6.2f}"
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--seeds",
        type=int,
        help="runs per side of a KV-router row (default: 10 on the conversation trace, 30 on "
        "the synthetic one, whose runs are shorter and whose outcomes under ties are bimodal)",
    )
    parser.add_argument("--beyond-runs", type=int, default=3, help="runs per beyond line")
    parser.add_argument("--repeat", type=int, default=3, help="runs per side of a round-robin row")
    parser.add_argument("--requests", type=int, help="only the first N requests of each trace")
    parser.add_argument("--trace", action="append", help="trace file name (default: both)")
    parser.add_argument("--workers", type=int, action="append", help="default: 2, 4, 8")
    parser.add_argument("--g1-blocks", type=int, default=4096)
    parser.add_argument("--g2-blocks", type=int, default=16384)
    parser.add_argument("--g3-blocks", type=int, default=65536)
    parser.add_argument("--redis-url")
    parser.add_argument("--no-beyond", dest="beyond", action="store_false")
    parser.add_argument("--no-agreement", dest="agreement", action="store_false")
    args = parser.parse_args()

    load = os.getloadavg()
    print(f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    failures = 0
    if args.agreement:
        failures, rows = agreement(args)
        print(
            "\n| trace | N | router | "
            + " | ".join(f"{m} (Dynamo / kvledger)" for m, _ in METRICS)
            + " | wall ratio | cpu ratio |"
        )
        print("|---|---|---|" + "---|" * len(METRICS) + "---|---|")
        print("\n".join(rows))
        print("\nall rows agree within 5%" if not failures else f"\n{failures} ROWS DISAGREE")
    if args.beyond:
        beyond(args)
    load = os.getloadavg()
    print(f"\nload average at the end {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
