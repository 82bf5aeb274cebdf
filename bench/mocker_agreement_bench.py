"""kvledger's mock engine against Dynamo's mocker: the same figures, and at least its speed.

For each Mooncake trace (conversation, synthetic) and G1 size (4,096 and 16,384 blocks of 512
tokens), one worker, the bench runs, each as a fresh process:

- Dynamo: ``run_mocker_trace_replay`` from ``ai-dynamo-runtime`` (offline replay, vLLM
  scheduler, its default polynomial timing), with every engine argument that matters given
  explicitly: ``num_gpu_blocks``, ``block_size`` 512, ``max_num_seqs`` 256,
  ``max_num_batched_tokens`` 8192, ``speedup_ratio`` 1, prefix caching and chunked prefill on
  (the bench checks that these are Dynamo's defaults: a run with only the block size and
  count gives the same figures);
- kvledger: ``kvledger simulate --trace T --g1-blocks N --dynamo --no-log --json``, the
  settings for the same model (``--dynamo`` = dynamo timing, whole-prompt admission, partial
  blocks not cached, LRU; the scheduler limits above are kvledger's defaults too).

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
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

# The shared data folder sits beside the checkout; KVLEDGER_SHARED_DATA points elsewhere.
SHARED_DATA = Path(
    os.environ.get("KVLEDGER_SHARED_DATA", Path(__file__).resolve().parents[2] / "shared/data")
)
TRACES = ("conversation_trace.jsonl", "synthetic_trace.jsonl")
CAPACITIES = (4096, 16384)
BLOCK = 512
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


def engine_args(g1_blocks: int, *, explicit: bool = True) -> dict[str, Any]:
    engine: dict[str, Any] = {"num_gpu_blocks": g1_blocks, "block_size": BLOCK}
    if explicit:
        engine.update(
            max_num_seqs=256,
            max_num_batched_tokens=8192,
            speedup_ratio=1.0,
            enable_prefix_caching=True,
            enable_chunked_prefill=True,
        )
    return {"engine": engine}


def dynamo_child(trace: str, g1_blocks: int, explicit: bool, requests: int | None) -> None:
    """Run Dynamo's replay in this process and print its figures as one JSON line."""
    from dynamo._core import run_mocker_trace_replay

    path = trace
    if requests is not None:
        path = _head(trace, requests)
    start = time.perf_counter()
    result = run_mocker_trace_replay(
        [path],
        extra_engine_args=engine_args(g1_blocks, explicit=explicit),
        capture_telemetry=True,
        telemetry_sample_interval_ms=1e12,  # a baseline and a final sample: the totals
    )
    call_s = time.perf_counter() - start
    s = result.summary
    telemetry = result.telemetry
    assert telemetry is not None
    preemptions = sum(
        sample["decode_interval_metrics"]["preemptions"]
        + sample["prefill_interval_metrics"]["preemptions"]
        for sample in telemetry["samples"]
    )
    out = {
        "ttft_p50": s["median_ttft_ms"],
        "ttft_p99": s["p99_ttft_ms"],
        "tpot_mean": s["mean_tpot_ms"],
        "preemptions": preemptions,
        "hits_all": s["prefix_cache_reused_ratio"],
        "hits_first": s["first_admission_prefix_cache_reused_ratio"],
        "requests": s["completed_requests"],
        "call_s": call_s,
    }
    print(json.dumps(out))


def _head(trace: str, requests: int) -> str:
    """The first ``requests`` lines of a trace, in a temporary file (deleted at exit)."""
    import atexit
    import tempfile

    fd, name = tempfile.mkstemp(suffix=".jsonl")
    with open(trace) as src, os.fdopen(fd, "w") as dst:
        for i, line in enumerate(src):
            if i >= requests:
                break
            dst.write(line)
    atexit.register(os.unlink, name)
    return name


def timed(cmd: list[str]) -> tuple[float, dict[str, Any]]:
    """Run ``cmd``; its wall time, and its last output line as JSON with ``cpu_s`` added (user
    + system time of the process: on a shared machine, what it cost rather than how long it
    waited for a core)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stderr}")
    out: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    out["cpu_s"] = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, out


def run_dynamo(
    trace: Path, g1: int, requests: int | None, *, explicit: bool = True
) -> tuple[float, dict[str, Any]]:
    cmd = [sys.executable, __file__, "--dynamo-child", str(trace), str(g1)]
    if not explicit:
        cmd.append("--defaults")
    if requests is not None:
        cmd += ["--requests", str(requests)]
    return timed(cmd)


def run_kvledger(trace: Path, g1: int, requests: int | None) -> tuple[float, dict[str, Any]]:
    cmd = [sys.executable, "-m", "kvledger.cli", "simulate", "--trace", str(trace)]
    cmd += ["--g1-blocks", str(g1), "--dynamo", "--no-log", "--json"]
    if requests is not None:
        cmd += ["--requests", str(requests)]
    wall, s = timed(cmd)
    return wall, {
        "ttft_p50": s["ttft_ms_p50"],
        "ttft_p99": s["ttft_ms_p99"],
        "tpot_mean": s["tpot_ms_mean"],
        "preemptions": s["preemptions"],
        "hits_all": s["token_hit_rate_all_admissions"],
        "hits_first": s["token_hit_rate"],
        "requests": s["requests"],
        "loop_s": s["wall_s"],
        "cpu_s": s["cpu_s"],
    }


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
    parser.add_argument("--dynamo-child", nargs=2, metavar=("TRACE", "BLOCKS"), help="internal")
    parser.add_argument("--defaults", action="store_true", help="internal")
    args = parser.parse_args()
    if args.dynamo_child:
        trace, blocks = args.dynamo_child
        dynamo_child(trace, int(blocks), not args.defaults, args.requests)
        return 0

    load = os.getloadavg()
    print(
        f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}; best and median of {args.repeat}"
    )
    failures = 0
    for name in args.trace or TRACES:
        trace = SHARED_DATA / "mooncake" / name
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
