"""Shared registry throughput and ``who_has`` latency against the real Redis.

Throughput: a mock engine's event stream (Stored/Removed of 16-token blocks, shared prefixes) is
encoded once; the same records are then (a) XADDed raw in pipelines and (b) given to
``SharedRegistry.apply_records`` (checks and per-batch reduction in Python, then the Lua script:
index update + XADD + idempotence bookkeeping), in batches of the same size. The ratio (b)/(a)
is the price of the shared index over a bare stream. Redis's own time per event (``INFO
commandstats`` before and after each side; EVALSHA includes the commands it runs) shows how
much of each side is server work.

Latency: ``who_has`` of 32-block prefixes in one round trip, against a PING round trip measured
in the same run.

    .venv/bin/python bench/redis_bench.py [--events 20000] [--batch 512] [--queries 2000]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
import uuid

import redis

from kvledger.events.shared.registry import SharedRegistry
from kvledger.events.types import AnyEvent, Stored, Tier
from kvledger.events.wire import encode_record
from kvledger.mocker.kv_manager import Deref, FullBlock, KvManager, Use
from kvledger.registry.hashing import TokenBlockSequence


def engine_events(n_events: int, seed: int = 0) -> list[AnyEvent]:
    rng = random.Random(seed)
    events: list[AnyEvent] = []
    mgr = KvManager(4096, 16, eviction="lineage", sink=events.append, worker_id=1)
    heads = [[rng.randrange(32000) for _ in range(16 * rng.randrange(8, 64))] for _ in range(32)]
    while len(events) < n_events:
        tokens = rng.choice(heads) + [
            rng.randrange(32000) for _ in range(16 * rng.randrange(1, 32))
        ]
        seq = TokenBlockSequence(tokens, 16)
        blocks = [FullBlock(h) for h in seq.sequence_hashes]
        placed = mgr.process(Use(blocks, local_hashes=seq.local_hashes))
        mgr.process(Deref(blocks[:placed]))
    return events[:n_events]


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", default="redis://127.0.0.1:6379/0")
    ap.add_argument("--events", type=int, default=20_000)
    ap.add_argument("--batch", type=int, default=512)
    ap.add_argument("--queries", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()

    client = redis.Redis.from_url(args.url)
    events = engine_events(args.events)
    records = [encode_record(e) for e in events]
    blocks = sum(len(getattr(e, "sequence_hashes", ())) for e in events)
    stored = sum(isinstance(e, Stored) for e in events)
    print(
        f"events {len(events)} ({stored} stored), {blocks / len(events):.1f} blocks/event, "
        f"{sum(map(len, records)) / len(records):.0f} bytes/record, batch {args.batch}"
    )

    def redis_usec(command: str) -> int:
        stats = client.info("commandstats").get(f"cmdstat_{command}", {})
        return int(stats.get("usec", 0))

    raw_rates, apply_rates, raw_server, apply_server = [], [], [], []
    for _ in range(args.repeats):
        ns = f"bench-{uuid.uuid4().hex[:8]}"
        reg = SharedRegistry(client, ns, stream_maxlen=len(records) + 1)
        try:
            before = redis_usec("xadd")
            t0 = time.perf_counter()
            for i in range(0, len(records), args.batch):
                pipe = client.pipeline(transaction=False)
                for rec in records[i : i + args.batch]:
                    pipe.xadd(
                        reg.prefix + "raw",
                        {"w": "1", "r": rec},
                        maxlen=len(records),
                        approximate=True,
                    )
                pipe.execute()
            raw_rates.append(len(records) / (time.perf_counter() - t0))
            raw_server.append((redis_usec("xadd") - before) / len(records))

            reg.apply_records(1, [])  # loads the script: not part of the timed run
            before = redis_usec("evalsha")
            t0 = time.perf_counter()
            for i in range(0, len(records), args.batch):
                result = reg.apply_records(1, records[i : i + args.batch])
                assert result.gap_at is None
            apply_rates.append(len(records) / (time.perf_counter() - t0))
            apply_server.append((redis_usec("evalsha") - before) / len(records))
            assert reg.applied_count(1) == len(records)
        finally:
            reg.delete_namespace()
    raw, applied = max(raw_rates), max(apply_rates)
    print(f"raw pipelined XADD        {raw:12,.0f} events/s (best of {args.repeats})")
    block_rate = applied * blocks / len(events)
    print(f"shared registry apply     {applied:12,.0f} events/s  ({block_rate:,.0f} blocks/s)")
    print(f"ratio apply / raw XADD    {applied / raw:12.2f}   (target >= 0.5)")
    print(
        f"Redis time per event      raw {min(raw_server):.1f} us, apply {min(apply_server):.1f} us"
        f"  (wall: raw {1e6 / raw:.1f} us, apply {1e6 / applied:.1f} us)"
    )

    # who_has: 32-block prefixes, held by some of 3 workers
    rng = random.Random(1)
    reg = SharedRegistry(client, f"bench-{uuid.uuid4().hex[:8]}")
    try:
        prefixes = []
        for _ in range(200):
            seq = TokenBlockSequence([rng.randrange(32000) for _ in range(16 * 32)], 16)
            prefixes.append(seq.sequence_hashes)
            for w in rng.sample([1, 2, 3], rng.randrange(1, 4)):
                depth = rng.randrange(1, 33)
                ev = Stored(
                    event_id=reg.applied_event_id(w) + 1,
                    worker_id=w,
                    dp_rank=0,
                    tier=Tier.G1,
                    ts=0.0,
                    parent_hash=None,
                    blocks=tuple(
                        zip(seq.sequence_hashes[:depth], seq.local_hashes[:depth], strict=True)
                    ),
                )
                reg.apply(w, [ev])
        ping, who = [], []
        for i in range(args.queries):
            t0 = time.perf_counter()
            client.ping()
            ping.append(time.perf_counter() - t0)
            hashes = prefixes[i % len(prefixes)]
            t0 = time.perf_counter()
            reg.who_has(hashes)
            who.append(time.perf_counter() - t0)
        for name, values in (("PING round trip", ping), ("who_has(32 blocks)", who)):
            p50, p99 = percentile(values, 0.5) * 1e6, percentile(values, 0.99) * 1e6
            mean = statistics.fmean(values) * 1e6
            print(f"{name:25s} p50 {p50:7.1f} us  p99 {p99:7.1f} us  (mean {mean:.1f} us)")
        print(f"ratio who_has / PING p50  {percentile(who, 0.5) / percentile(ping, 0.5):7.2f}")
    finally:
        reg.delete_namespace()


if __name__ == "__main__":
    main()
