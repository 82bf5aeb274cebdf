"""Simulated requests/s on the Mooncake conversation trace, against vLLM 0.33's BlockPool.

Sides, all on the same 12031 requests in arrival order, block size 512 (the trace's), one
G1 pool of ``--g1-blocks`` with LRU eviction:
- kvledger engine off: ``replay_cache`` (match, admit, release per request) with every event
  built and counted; this includes hashing each request's block chain;
- kvledger engine off + log: the same, every event handed to a SQLite event log in a temp
  folder the way ``kvledger simulate --engine off --log`` hands them: a worker from the
  builder (``open_worker``, without the Redis and ZMQ views), whose sink puts each event into
  the log's append buffer; the worker and the log are closed, i.e. everything committed,
  inside the timing;
- kvledger engine on: the mock engine (batching, chunked prefill, decode blocks,
  preemption) over the same trace, events built and counted;
- vLLM 0.33 BlockPool, engine-off style (find cached prefix, touch, allocate,
  cache_full_blocks, free), run in .bench-venv by bench/vllm_reference.py on the same
  sequence hashes.
The engine-off hit counts of kvledger and vLLM must agree exactly (both are LRU over the same
hashes with the same release order): the bench checks it. Each repetition runs every side
once, in turn, with fresh pools; the best of ``--repeat`` is reported. Ratios: kvledger
requests/s over vLLM's.

The log's cost is printed as the engine-off requests/s with the log over those without it
(the same run; 1.0 would be a free log), and again by the CPU time of the engine's own thread
(the log's writer runs on another; on a shared machine the wall clock also carries the wait for
the interpreter and other load). ``--no-vllm`` leaves the vLLM side out (no
.bench-venv needed).

Run: bash bench/setup_bench_venv.sh   (once)
     .venv/bin/python bench/simulate_bench.py [--no-vllm]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from vllm_reference import run_block_pool

from kvledger.builder import open_worker
from kvledger.config import Settings
from kvledger.mocker.cache import SimulatedCache
from kvledger.mocker.engine import EngineConfig, MockEngine, SimClock
from kvledger.mocker.engine_off import replay_cache
from kvledger.mocker.stats import EventCounter
from kvledger.mocker.traces import TraceRequest, iter_arrivals, load_mooncake, request_hashes
from kvledger.registry.emitter import EventEmitter

# The shared data folder sits beside the checkout; KVLEDGER_SHARED_DATA points elsewhere
# (a clone in another folder).
SHARED_DATA = Path(
    os.environ.get("KVLEDGER_SHARED_DATA", Path(__file__).resolve().parents[2] / "shared/data")
)
TRACE = SHARED_DATA / "mooncake/conversation_trace.jsonl"
BLOCK = 512


Run = tuple[float, int, float]
"""A side's wall seconds, blocks hit, and the CPU seconds of the thread that ran the engine."""


def engine_off(requests: list[TraceRequest], g1: int) -> Run:
    cache = SimulatedCache.build(g1, policy="lru", emitter=EventEmitter(EventCounter()))
    start, cpu = time.perf_counter(), time.thread_time()
    stats = replay_cache(requests, cache, BLOCK)
    return time.perf_counter() - start, stats.blocks_hit, time.thread_time() - cpu


def engine_off_logged(requests: list[TraceRequest], g1: int) -> Run:
    with tempfile.TemporaryDirectory() as tmp:
        settings = Settings.load(event_log_url=f"sqlite:///{tmp}/events.db", block_size=BLOCK)
        worker = open_worker(settings, redis=False, zmq=False)
        cache = SimulatedCache.build(g1, policy="lru", emitter=worker.emitter())
        start, cpu = time.perf_counter(), time.thread_time()
        stats = replay_cache(requests, cache, BLOCK)
        worker.close()
        return time.perf_counter() - start, stats.blocks_hit, time.thread_time() - cpu


def engine_on(requests: list[TraceRequest], g1: int) -> Run:
    clock = SimClock()
    emitter = EventEmitter(EventCounter(), clock=clock)
    cache = SimulatedCache.build(g1, policy="lru", emitter=emitter)
    config = EngineConfig.from_settings(Settings.load(block_size=BLOCK, g1_blocks=g1))
    start, cpu = time.perf_counter(), time.thread_time()
    stats = MockEngine(cache, config, clock=clock).run(requests)
    return time.perf_counter() - start, stats.blocks_hit, time.thread_time() - cpu


def machine() -> str:
    out = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
    model = next(
        (ln.split(":", 1)[1].strip() for ln in out.splitlines() if "Model name" in ln), "?"
    )
    return model


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trace", type=Path, default=TRACE)
    parser.add_argument("--g1-blocks", type=int, default=4096)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--no-vllm", action="store_true", help="leave vLLM's BlockPool out")
    args = parser.parse_args()

    requests = list(iter_arrivals(load_mooncake(args.trace)))
    rows = [request_hashes(r, BLOCK)[0] for r in requests]
    sides: dict[str, Callable[[list[TraceRequest], int], Run]] = {
        "kvledger engine off": engine_off,
        "kvledger engine off + log": engine_off_logged,
        "kvledger engine on": engine_on,
    }
    best: dict[str, Run] = {}
    engine_cpu: dict[str, float] = {}  # the least CPU the engine's thread took, per side
    for _ in range(args.repeat):
        for name, side in sides.items():
            result = side(requests, args.g1_blocks)
            if name not in best or result[0] < best[name][0]:
                best[name] = result
            engine_cpu[name] = min(engine_cpu.get(name, result[2]), result[2])
        if args.no_vllm:
            continue
        vllm = run_block_pool(rows, args.g1_blocks, BLOCK)[0]
        result = (vllm["seconds"], int(vllm["hits"]), vllm["seconds"])
        if "vLLM 0.33 BlockPool" not in best or result[0] < best["vLLM 0.33 BlockPool"][0]:
            best["vLLM 0.33 BlockPool"] = result

    n, blocks = len(requests), sum(len(r) for r in rows)
    print(
        f"{args.trace.name}: {n} requests, {blocks} blocks of {BLOCK} tokens, "
        f"G1 {args.g1_blocks} blocks (LRU); best of {args.repeat}; {machine()}"
    )
    print(f"{'side':<28} {'hit rate':>8} {'requests/s':>11} {'s':>7}")
    for name, (seconds, hits, _cpu) in best.items():
        print(f"{name:<28} {hits / blocks:>8.2%} {n / seconds:>11.0f} {seconds:>7.3f}")
    off, logged = best["kvledger engine off"][0], best["kvledger engine off + log"][0]
    print(f"ratio kvledger engine off + log / engine off (requests/s): {off / logged:.2f}")
    # The same by the CPU time of the engine's own thread: what the log costs the engine, less
    # what waiting for the interpreter and the machine's other load add to the wall clock
    cpu_off, cpu_logged = engine_cpu["kvledger engine off"], engine_cpu["kvledger engine off + log"]
    print(
        "ratio kvledger engine off + log / engine off (the engine thread's CPU time, least of "
        f"{args.repeat}): {cpu_off / cpu_logged:.2f}"
    )
    if args.no_vllm:
        return 0
    vllm_s, vllm_hits, _ = best["vLLM 0.33 BlockPool"]
    if best["kvledger engine off"][1] != vllm_hits:
        print(f"MISMATCH: engine-off hits {best['kvledger engine off'][1]} != vLLM {vllm_hits}")
        return 1
    for name in sides:
        print(f"ratio {name} / vLLM BlockPool (requests/s): {vllm_s / best[name][0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
