"""kvledger's mock engine against Dynamo's mocker: the same figures, and at least its speed.

For each Mooncake trace (conversation, synthetic) and G1 size (4,096 and 16,384 blocks of 512
tokens), one worker, the bench runs Dynamo's ``run_mocker_trace_replay`` and ``kvledger
simulate --dynamo --no-log``, each as a fresh process, as ``dynamo_replay.py`` (beside this
file) describes; it checks that Dynamo's figures are the same without the explicit engine
arguments (they are its defaults).

Agreement: TTFT p50 and p99, mean TPOT, preemptions and the token hit rate over every
admission (Dynamo's ``prefix_cache_reused_ratio``) must be within 5% of Dynamo's; preemption
counts under 20 may instead differ by at most 1. The first-admission hit rate is shown too.

Speed: the wall time of each whole process (start, trace load, replay, report), best of
``--repeat``; the ratio is Dynamo's over kvledger's (1 or more: kvledger is at least as fast).
Dynamo's in-call time (after its import) is shown as well.

Run: .venv/bin/python bench/mocker_agreement_bench.py [--repeat 3] [--requests N]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path
from typing import Any

from dynamo_replay import BLOCK, run_dynamo, run_kvledger, warm_up

# The shared data folder sits beside the checkout; KVLEDGER_SHARED_DATA points elsewhere.
SHARED_DATA = Path(
    os.environ.get("KVLEDGER_SHARED_DATA", Path(__file__).resolve().parents[2] / "shared/data")
)
TRACES = ("conversation_trace.jsonl", "synthetic_trace.jsonl")
CAPACITIES = (4096, 16384)
TOLERANCE = 0.05
METRICS = (
    ("TTFT p50 ms", "ttft_p50"),
    ("TTFT p99 ms", "ttft_p99"),
    ("TPOT mean ms", "tpot_mean"),
    ("preemptions", "preemptions"),
    ("token hits, all admissions", "hits_all"),
    ("token hits, first admission", "hits_first"),
)
CHECKED = ("ttft_p50", "ttft_p99", "tpot_mean", "preemptions", "hits_all")


def agrees(key: str, ours: float, theirs: float) -> bool:
    if key == "preemptions" and max(ours, theirs) < 20:
        return abs(ours - theirs) <= 1
    if theirs == 0:
        return ours == 0
    return abs(ours - theirs) / abs(theirs) <= TOLERANCE


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} s (min {min(values):.2f}, max {max(values):.2f})"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--requests", type=int, help="only the first N requests of each trace")
    parser.add_argument("--trace", action="append", help="trace file name (default: both)")
    parser.add_argument("--g1-blocks", type=int, action="append", help="default: 4096, 16384")
    args = parser.parse_args()

    load = os.getloadavg()
    print(
        f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}; best and median of {args.repeat}"
    )
    failures = 0
    for name in args.trace or TRACES:
        trace = SHARED_DATA / "mooncake" / name
        warm_up(trace)
        for g1 in args.g1_blocks or CAPACITIES:
            # the explicit engine arguments are Dynamo's defaults: same figures either way
            _, default_run = run_dynamo(trace, g1, args.requests, explicit=False)
            dyn_walls, kv_walls, calls, loops, dyn_cpu, kv_cpu = [], [], [], [], [], []
            dyn: dict[str, Any] = {}
            ours: dict[str, Any] = {}
            for _ in range(args.repeat):
                wall, dyn = run_dynamo(trace, g1, args.requests)
                dyn_walls.append(wall)
                calls.append(dyn["call_s"])
                dyn_cpu.append(dyn["cpu_s"])
                wall, ours = run_kvledger(trace, g1, args.requests)
                kv_walls.append(wall)
                loops.append(ours["loop_s"])
                kv_cpu.append(ours["cpu_s"])
            same = all(default_run[k] == dyn[k] for k, _ in ((k, 0) for _, k in METRICS))
            print(
                f"\n{name}, G1 {g1} blocks of {BLOCK} tokens, {dyn['requests']} requests "
                f"(Dynamo's defaults give the same figures: {'yes' if same else 'NO'})"
            )
            print(f"  {'metric':<30}{'Dynamo':>12}{'kvledger':>12}{'diff':>9}  within 5%")
            for label, key in METRICS:
                theirs, mine = dyn[key], ours[key]
                diff = (mine - theirs) / theirs if theirs else 0.0
                ok = agrees(key, mine, theirs)
                mark = ("yes" if ok else "NO") if key in CHECKED else "(shown)"
                failures += key in CHECKED and not ok
                fmt = ".4f" if key.startswith("hits") else ".1f"
                print(f"  {label:<30}{theirs:>12{fmt}}{mine:>12{fmt}}{diff:>+9.1%}  {mark}")
            failures += not same
            print(
                f"  Dynamo process      wall {spread(dyn_walls)}, cpu {spread(dyn_cpu)}; "
                f"its replay call {spread(calls)}"
            )
            print(
                f"  kvledger process    wall {spread(kv_walls)}, cpu {spread(kv_cpu)}; "
                f"its engine loop {spread(loops)}"
            )
            print(
                f"  ratio Dynamo / kvledger, whole process (best): wall "
                f"{min(dyn_walls) / min(kv_walls):.2f}, cpu {min(dyn_cpu) / min(kv_cpu):.2f}; "
                f"Dynamo's replay call / kvledger process wall: {min(calls) / min(kv_walls):.2f}"
            )
    print("\nall figures agree within 5%" if not failures else f"\n{failures} DISAGREEMENTS")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
