"""RouterIndex against Dynamo's RadixTree: folding events and answering prefix queries.

Workload: the first ``--requests`` requests of the Mooncake conversation trace, dealt round
robin to ``--workers`` mock engines (``MockEngine`` over a G1-only ``SimulatedCache``, LRU,
``--g1-blocks`` blocks of ``--block-size`` tokens each), whose event streams are merged in
simulated-time order. Every request's prompt is then one query, by local hashes (what a
router computes from a prompt's tokens).

Sides, on the same events and queries in the same run:
- apply: ``RouterIndex.apply`` on each event vs ``RadixTree.apply_event`` on the JSON that
  ``encode_dynamo`` makes of it (encoded before timing; parsing it is part of RadixTree's
  work, as decoding its own wire record would be part of a router's). RadixTree applies on a
  background thread, so its timing ends with one query, which waits for the queue to drain;
- find_matches: ``RouterIndex.find_matches(local)`` (every tier of every worker) vs
  ``RadixTree.find_matches(local)`` (G1 only), and that plus reading ``.scores``, which is
  what a Python router has to do to use the answer.
Before timing, the bench checks that both give the same G1 overlap scores for every query.
Each repetition times every side once, in turn (apply into fresh indexes); the median of
``--repeat`` is reported, with the spread. Ratios: kvledger's rate over Dynamo's, in wall-clock
time (the headline: what a router waits) and in process CPU time (steadier on a shared machine;
it counts RadixTree's background thread too). Exit status 2 when a wall ratio is below 1.

Run: .venv/bin/python bench/router_bench.py
"""

from __future__ import annotations

import argparse
import heapq
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

from kvledger.config import Settings
from kvledger.events.types import AnyEvent, Stored, Tier
from kvledger.events.wire import encode_dynamo
from kvledger.mocker.cache import SimulatedCache
from kvledger.mocker.engine import EngineConfig, MockEngine, SimClock
from kvledger.mocker.traces import load_mooncake, request_hashes
from kvledger.registry.emitter import EventEmitter
from kvledger.registry.index import RouterIndex, overlap_scores

# The shared data folder sits beside the checkout; KVLEDGER_SHARED_DATA points elsewhere.
SHARED_DATA = Path(
    os.environ.get("KVLEDGER_SHARED_DATA", Path(__file__).resolve().parents[2] / "shared/data")
)
TRACE = SHARED_DATA / "mooncake/conversation_trace.jsonl"


def worker_streams(
    trace: Path, requests: int, workers: int, block_size: int, g1_blocks: int
) -> tuple[list[AnyEvent], list[list[int]]]:
    """The merged G1 event streams of ``workers`` mock engines, and every prompt's local hashes."""
    reqs = load_mooncake(trace)[:requests]
    settings = Settings.load(block_size=block_size, g1_blocks=g1_blocks)
    streams: list[list[AnyEvent]] = []
    for worker in range(workers):
        events: list[AnyEvent] = []
        clock = SimClock()
        emitter = EventEmitter(events.append, worker_id=worker, clock=clock)
        cache = SimulatedCache.build(g1_blocks, policy="lru", emitter=emitter)
        MockEngine(cache, EngineConfig.from_settings(settings), clock=clock).run(
            reqs[worker::workers]
        )
        streams.append(events)
    merged = list(heapq.merge(*streams, key=lambda e: e.ts))
    queries = [request_hashes(req, block_size)[1] for req in reqs]
    return merged, queries


class Timing(NamedTuple):
    wall: float
    cpu: float  # this process's CPU time, every thread: RadixTree's included


def timed(run: Callable[[], object]) -> Timing:
    wall, cpu = time.perf_counter(), time.process_time()
    run()
    return Timing(time.perf_counter() - wall, time.process_time() - cpu)


def apply_ours(events: Sequence[AnyEvent]) -> None:
    index = RouterIndex()
    for event in events:
        index.apply(event)


def apply_theirs(tree: Any, payloads: Sequence[tuple[int, bytes]]) -> None:
    for worker, payload in payloads:
        tree.apply_event(worker, payload)
    tree.find_matches([0])  # waits until its background thread has applied everything


def ask_all(find: Callable[[list[int]], object], queries: Sequence[list[int]]) -> None:
    for local in queries:
        find(local)


def rate_line(what: str, n: int, ours: list[Timing], theirs: list[Timing]) -> float:
    """Print median rates and ratios (wall clock and CPU time); return the wall ratio."""

    def median(xs: list[Timing], field: str) -> float:
        return statistics.median(x.cpu if field == "cpu" else x.wall for x in xs)

    def spread(xs: list[Timing]) -> str:
        return f"{n / max(x.wall for x in xs):,.0f}-{n / min(x.wall for x in xs):,.0f}"

    wall = median(theirs, "wall") / median(ours, "wall")
    cpu = median(theirs, "cpu") / median(ours, "cpu")
    print(
        f"{what:<24} {n / median(ours, 'wall'):>10,.0f} {n / median(theirs, 'wall'):>10,.0f}"
        f" {wall:>6.2f}x {cpu:>6.2f}x   (spread {spread(ours)} / {spread(theirs)})"
    )
    return wall


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", type=Path, default=TRACE)
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--block-size", type=int, default=512)
    parser.add_argument("--g1-blocks", type=int, default=1024)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args(argv)
    try:
        from dynamo.llm import RadixTree
    except ImportError:
        print("ai-dynamo-runtime is not installed: pip install ai-dynamo-runtime==1.6.1")
        return 1

    if not args.trace.is_file():
        print(f"no trace at {args.trace}: set KVLEDGER_SHARED_DATA to the shared data folder")
        return 1
    events, queries = worker_streams(
        args.trace, args.requests, args.workers, args.block_size, args.g1_blocks
    )
    payloads = [(e.worker_id, p) for e in events for p in encode_dynamo(e, tier=Tier.G1)]
    stored = sum(len(e.blocks) for e in events if isinstance(e, Stored))
    print(
        f"{args.workers} workers, {len(events):,} events ({stored:,} stored blocks), "
        f"{len(queries):,} queries of {statistics.mean(map(len, queries)):.1f} blocks on average"
    )

    # same answers first: a fast wrong index is no result
    index = RouterIndex.from_events(events)
    tree = RadixTree()
    for worker, payload in payloads:
        tree.apply_event(worker, payload)
    matched = 0
    for local in queries:
        ours = overlap_scores(index.find_matches(local), Tier.G1)
        theirs: object = tree.find_matches(local).scores
        if ours != theirs:
            print(f"DISAGREE on {local[:4]}...: ours {ours}, dynamo {theirs}")
            return 1
        matched += bool(ours)
    print(f"same G1 overlap scores for all {len(queries):,} queries ({matched:,} match a worker)")

    runs: dict[str, list[Timing]] = {k: [] for k in ("ao", "at", "fo", "ft", "fs")}
    for _ in range(args.repeat):
        runs["ao"].append(timed(lambda: apply_ours(events)))
        runs["at"].append(timed(lambda: apply_theirs(RadixTree(), payloads)))
        runs["fo"].append(timed(lambda: ask_all(index.find_matches, queries)))
        runs["ft"].append(timed(lambda: ask_all(tree.find_matches, queries)))
        runs["fs"].append(timed(lambda: ask_all(lambda q: tree.find_matches(q).scores, queries)))

    print(f"{'per second':<24} {'kvledger':>10} {'dynamo':>10} {'ratio':>7} {'cpu':>7}")
    ratios = [
        rate_line("apply (events)", len(events), runs["ao"], runs["at"]),
        rate_line("find_matches (queries)", len(queries), runs["fo"], runs["ft"]),
    ]
    rate_line("  dynamo + .scores", len(queries), runs["fo"], runs["fs"])
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    print(
        f"ratio: kvledger's rate / dynamo's, median of {args.repeat} (>= 1: kvledger is no "
        f"slower); cpu: the same in process CPU time; spread: wall rates, ours / theirs; "
        f"load {load}"
    )
    return 0 if min(ratios) >= 1.0 else 2


if __name__ == "__main__":
    sys.exit(main())
