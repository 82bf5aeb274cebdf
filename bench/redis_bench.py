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

Emit to apply: a producer appends the same kind of stream to a SQLite event log at
``--rate`` events/s (15k, the engine-on simulation's rate) with a ``RedisPublisher`` fed by the
log's commits; each event's time from its append until the registry confirmed it applied
(p50/p99, ``bench/emit_latency.py``; target p99 <= the log's ``max_delay`` + 20 ms).

    .venv/bin/python bench/redis_bench.py [--events 20000] [--batch 512] [--queries 2000]

``--cluster`` measures the sharded registry on a Redis Cluster instead: the one at
``--cluster-url``, or a 3-master, 3-replica cluster started for the run (the one the tests use,
``tests/redis_cluster.py``). For N = 1, 3 and 6 shards, six workers' events are applied in
batches taken from each worker in turn, against raw pipelined XADDs of the same records to one
stream per shard on the same nodes: through redis-py's cluster pipeline ("raw"), and packed by
hand and written straight to the stream's node ("hand"), as the registry sends its calls. Redis
CPU time per event is read from ``INFO commandstats`` and ``INFO cpu`` of every master: the
total, and the busiest master's, which is what bounds the events/s a cluster holds when each
node has its own core.

    .venv/bin/python bench/redis_bench.py --cluster [--cluster-url redis://127.0.0.1:17000]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

import redis
from emit_latency import delays, paced, summary

from kvledger.events import codec
from kvledger.events.log import EventLog
from kvledger.events.shared.keys import KeySpace
from kvledger.events.shared.publish import RedisPublisher
from kvledger.events.shared.registry import ApplyResult, SharedRegistry
from kvledger.events.types import AnyEvent, Stored, Tier
from kvledger.mocker.g1_pool import Deref, FullBlock, MockG1Pool, Use
from kvledger.registry.hashing import TokenBlockSequence


def engine_events(n_events: int, seed: int = 0, worker_id: int = 1) -> list[AnyEvent]:
    rng = random.Random(seed)
    events: list[AnyEvent] = []
    mgr = MockG1Pool(4096, 16, eviction="lineage", sink=events.append, worker_id=worker_id)
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
    ap.add_argument("--cluster", action="store_true", help="the sharded registry on a cluster")
    ap.add_argument("--cluster-url", default=None, help="a running cluster (default: start one)")
    ap.add_argument("--shards", type=int, nargs="+", default=[1, 3, 6])
    ap.add_argument("--rate", type=float, default=15_000, help="emit-to-apply: events/s")
    ap.add_argument("--seconds", type=float, default=4.0, help="emit-to-apply: run length")
    args = ap.parse_args()
    if args.cluster:
        cluster_main(args)
        return

    client = redis.Redis.from_url(args.url)
    events = engine_events(args.events)
    records = [codec.encode(e) for e in events]
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

            reg.apply(1, [])  # loads the script: not part of the timed run
            before = redis_usec("evalsha")
            t0 = time.perf_counter()
            for i in range(0, len(records), args.batch):
                # as a publisher fed by the log's commits: the events and their log records
                chunk = slice(i, i + args.batch)
                result = reg.apply(1, events[chunk], records=records[chunk])
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
    print(emit_to_apply(client, args.rate, args.seconds))


def emit_to_apply(client: redis.Redis, rate: float, seconds: float) -> str:
    """Append ``rate`` events/s to a log for ``seconds``; each event's time until the shared
    registry confirmed it applied."""
    events = engine_events(int(rate * seconds), seed=3)
    reg = SharedRegistry(client, f"bench-{uuid.uuid4().hex[:8]}")
    applied: list[tuple[int, float]] = []
    apply = reg.apply

    def timed(
        worker_id: int, batch: list[AnyEvent], *, token: int = 0, records: list[bytes]
    ) -> ApplyResult:
        result = apply(worker_id, batch, token=token, records=records)
        applied.append((result.last_event_id, time.monotonic()))
        return result

    reg.apply = timed  # type: ignore[method-assign]
    with tempfile.TemporaryDirectory() as tmp:
        log = EventLog(str(Path(tmp) / "events.db"))
        publisher = RedisPublisher(reg, 1, log=log).start()
        try:
            emitted = paced(log.append, events, rate)
            got = len(emitted) / (emitted[-1] - emitted[0])
            assert publisher.wait_applied(60), publisher.error
            committed = [(n - 1, at) for n, at in log.commit_times]
        finally:
            publisher.stop()
            log.close()
            reg.delete_namespace()
    return "\n".join(
        (
            summary("emit -> committed (log)", delays(emitted, committed), got, log.max_delay),
            summary("emit -> Redis applied", delays(emitted, applied), got, log.max_delay),
        )
    )


CLUSTER_WORKERS = 6


def cluster_main(args: argparse.Namespace) -> None:
    started = None
    url = args.cluster_url
    if url is None:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
        from redis_cluster import LocalCluster

        started = LocalCluster().start()
        url = started.url
    try:
        run_cluster(args, redis.RedisCluster.from_url(url))
    finally:
        if started is not None:
            started.stop()


def run_cluster(args: argparse.Namespace, client: redis.RedisCluster) -> None:
    per_worker = args.events // CLUSTER_WORKERS
    workers = {w: [codec.encode(e) for e in engine_events(per_worker, w, w)] for w in range(6)}
    total = per_worker * CLUSTER_WORKERS
    # batches taken from each worker in turn, as a fleet's publishers would send them
    batches = [
        (w, workers[w][i : i + args.batch])
        for i in range(0, per_worker, args.batch)
        for w in range(CLUSTER_WORKERS)
    ]
    masters = client.get_primaries()

    def usec(command: str) -> dict[str, int]:
        out = {}
        for node in masters:
            stats = client.info("commandstats", target_nodes=node).get(f"cmdstat_{command}", {})
            out[node.name] = int(stats.get("usec", 0))
        return out

    def cpu_usec() -> dict[str, int]:
        """Each master process's CPU time (user + system): what commandstats' wall time
        inside commands inflates when the machine has fewer cores than busy processes."""
        out = {}
        for node in masters:
            info = client.info("cpu", target_nodes=node)
            out[node.name] = int(1e6 * (info["used_cpu_user"] + info["used_cpu_sys"]))
        return out

    def spent(before: dict[str, int], after: dict[str, int]) -> tuple[float, float]:
        """Redis microseconds per event: all masters together, and the busiest master."""
        per_node = [after[n] - before[n] for n in after]
        return sum(per_node) / total, max(per_node) / total

    print(
        f"cluster: {len(masters)} masters; {CLUSTER_WORKERS} workers x {per_worker} events, "
        f"batch {args.batch}; {args.repeats} repeats: events/s their median, us the lowest"
    )
    print(
        "Redis us/event: commandstats (XADD for raw, EVALSHA for apply) summed over the masters"
        " and on the busiest one; cpu: the masters' process CPU time (INFO cpu) during apply"
    )
    print(
        "shards  raw ev/s  hand ev/s  apply ev/s  ratio  ratio/hand  raw us  apply us  "
        "busiest  per shard  cpu us  cpu busiest  apply spread"
    )
    for shards in args.shards:
        raw_rates: list[float] = []
        hand_rates: list[float] = []
        apply_rates: list[float] = []
        raw_us, apply_us, busiest, cpu_all, cpu_top = [], [], [], [], []
        for _ in range(args.repeats):
            ns = f"bench-{uuid.uuid4().hex[:8]}"
            reg = SharedRegistry(client, ns, shards=shards, stream_maxlen=total + 1)
            raw_keys = [k.prefix + "raw" for k in KeySpace(ns).shards(shards)]
            try:
                before = usec("xadd")
                t0 = time.perf_counter()
                for w, batch in batches:
                    pipe = client.pipeline()
                    for rec in batch:
                        pipe.xadd(
                            raw_keys[w % shards],
                            {"w": str(w), "r": rec},
                            maxlen=total,
                            approximate=True,
                        )
                    pipe.execute()
                raw_rates.append(total / (time.perf_counter() - t0))
                raw_us.append(spent(before, usec("xadd"))[0])
                for key in raw_keys:
                    client.delete(key)
                t0 = time.perf_counter()
                for w, batch in batches:
                    xadd_by_hand(client, raw_keys[w % shards], w, batch, total)
                hand_rates.append(total / (time.perf_counter() - t0))
                for w in workers:
                    reg.apply_records(w, [])  # loads the scripts: not part of the timed run
                before, cpu_before = usec("evalsha"), cpu_usec()
                t0 = time.perf_counter()
                for w, batch in batches:
                    assert reg.apply_records(w, batch).gap_at is None
                apply_rates.append(total / (time.perf_counter() - t0))
                cpu = spent(cpu_before, cpu_usec())
                cpu_all.append(cpu[0])
                cpu_top.append(cpu[1])
                all_us, top_us = spent(before, usec("evalsha"))
                apply_us.append(all_us)
                busiest.append(top_us)
                assert all(reg.applied_count(w) == per_worker for w in workers)
            finally:
                reg.delete_namespace()
                for key in raw_keys:
                    client.delete(key)
        raw, applied = statistics.median(raw_rates), statistics.median(apply_rates)
        hand = statistics.median(hand_rates)
        spread = (max(apply_rates) - min(apply_rates)) / applied
        print(
            f"{shards:6d}  {raw:8,.0f}  {hand:9,.0f}  {applied:10,.0f}  {applied / raw:5.2f}  "
            f"{applied / hand:10.2f}  "
            f"{min(raw_us):6.1f}  {min(apply_us):8.1f}  {min(busiest):7.1f}  "
            f"{min(apply_us) / shards:9.1f}  {min(cpu_all):6.1f}  {min(cpu_top):11.1f}  "
            f"{spread:12.0%}"
        )
    for shards in args.shards:
        who_has_latency(args, client, shards)


def xadd_by_hand(
    client: redis.RedisCluster, stream: str, worker: int, records: list[bytes], maxlen: int
) -> None:
    """The raw XADDs packed by hand and written straight to the stream's node, as the
    registry sends its calls: the reference without redis-py's cluster pipeline (several us
    of Python a command)."""
    node = client.get_node_from_key(stream)
    pool = client.get_redis_connection(node).connection_pool
    conn = pool.get_connection()
    try:
        head = (b"XADD", stream.encode(), b"MAXLEN", b"~", b"%d" % maxlen, b"*", b"w")
        args = (*head, b"%d" % worker, b"r")
        conn.send_packed_command(conn.pack_commands([(*args, rec) for rec in records]))
        for _ in records:
            conn.read_response()
    finally:
        pool.release(conn)


def who_has_latency(args: argparse.Namespace, client: redis.RedisCluster, shards: int) -> None:
    """who_has of 32-block prefixes (one call per shard that owns some of them, the nodes in
    parallel) against a PING round trip to one node, measured alternately."""
    rng = random.Random(1)
    reg = SharedRegistry(client, f"bench-{uuid.uuid4().hex[:8]}", shards=shards)
    node = client.get_primaries()[0]
    try:
        prefixes = []
        for i in range(200):
            seq = TokenBlockSequence([rng.randrange(32000) for _ in range(16 * 32)], 16)
            prefixes.append(seq.sequence_hashes)
            ev = Stored(
                event_id=i,
                worker_id=1,
                dp_rank=0,
                tier=Tier.G1,
                ts=0.0,
                parent_hash=None,
                blocks=tuple(zip(seq.sequence_hashes, seq.local_hashes, strict=True)),
            )
            reg.apply(1, [ev])
        ping, who = [], []
        for i in range(args.queries):
            t0 = time.perf_counter()
            client.ping(target_nodes=node)
            ping.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            reg.who_has(prefixes[i % len(prefixes)])
            who.append(time.perf_counter() - t0)
        p50, q50 = percentile(who, 0.5) * 1e6, percentile(ping, 0.5) * 1e6
        p99 = percentile(who, 0.99) * 1e6
        print(
            f"who_has(32 blocks), {shards} shards: p50 {p50:6.0f} us  p99 {p99:6.0f} us;  "
            f"PING one node p50 {q50:4.0f} us;  ratio p50 {p50 / q50:5.2f}"
        )
    finally:
        reg.delete_namespace()


if __name__ == "__main__":
    main()
