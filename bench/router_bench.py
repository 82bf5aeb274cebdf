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
Each repetition times every side once, in turn, with fresh indexes; the median of
``--repeat`` is reported, with the spread. Ratios: kvledger's rate over Dynamo's.

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
from typing import Any

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


def apply_ours(events: Sequence[AnyEvent]) -> float:
    index = RouterIndex()
    start = time.perf_counter()
    for event in events:
        index.apply(event)
    return time.perf_counter() - start


def apply_theirs(radix_tree: Callable[[], Any], payloads: Sequence[tuple[int, bytes]]) -> float:
    tree = radix_tree()
    start = time.perf_counter()
    for worker, payload in payloads:
        tree.apply_event(worker, payload)
    tree.find_matches([0])  # waits until its background thread has applied everything
    return time.perf_counter() - start


def timed_queries(find: Callable[[list[int]], object], queries: Sequence[list[int]]) -> float:
    start = time.perf_counter()
    for local in queries:
        find(local)
    return time.perf_counter() - start


def rate_line(what: str, unit: str, n: int, ours: list[float], theirs: list[float]) -> float:
    o, t = statistics.median(ours), statistics.median(theirs)

    def spread(xs: list[float]) -> str:
        return f"{n / max(xs):,.0f}..{n / min(xs):,.0f}"

    ratio = t / o
    print(
        f"{what:<28} {n / o:>10,.0f} {n / t:>10,.0f} {ratio:>6.2f}x"
        f"   ({unit}/s; spread ours {spread(ours)}, dynamo {spread(theirs)})"
    )
    return ratio


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

    timings: dict[str, list[float]] = {k: [] for k in ("ao", "at", "fo", "ft", "fs")}
    for _ in range(args.repeat):
        timings["ao"].append(apply_ours(events))
        timings["at"].append(apply_theirs(RadixTree, payloads))
        timings["fo"].append(timed_queries(index.find_matches, queries))
        timings["ft"].append(timed_queries(tree.find_matches, queries))
        timings["fs"].append(timed_queries(lambda q: tree.find_matches(q).scores, queries))

    print(f"{'':<28} {'kvledger':>10} {'dynamo':>10} {'ratio':>7}")
    ratios = [
        rate_line("apply", "events", len(events), timings["ao"], timings["at"]),
        rate_line("find_matches", "queries", len(queries), timings["fo"], timings["ft"]),
    ]
    rate_line("find_matches + .scores", "queries", len(queries), timings["fo"], timings["fs"])
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"ratio = kvledger rate / dynamo rate (>= 1: kvledger is no slower); load {load}")
    return 0 if min(ratios) >= 1.0 else 2


if __name__ == "__main__":
    sys.exit(main())
