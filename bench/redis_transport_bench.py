"""The shared registry's transport against redis-py's own ways of sending the same calls.

``events/shared/transport.py`` sends through redis-py's pipeline on one server and writes a
cluster's commands to its nodes itself; this bench measures each choice against what redis-py
offers instead, with the same registry and the same calls, alternating call by call so that a
slow spell of a shared machine hits every variant alike:

- one server: the transport (redis-py's pipeline, ``execute_command`` for one command) against
  redis-py ``Script`` objects called in a redis-py pipeline (which asks ``SCRIPT EXISTS`` before
  every execute);
- ``--cluster``: the transport (straight to the nodes of redis-py's slot map) against redis-py's
  cluster pipeline with each command's node named, and with its own routing (which asks the
  default node ``COMMAND GETKEYS`` for every script call).

Applies: a mock engine's events in batches of 512 (six workers taken in turn on a cluster),
events/s and the client's CPU time per event. ``who_has`` of 32-block prefixes: p50 / p99, with
a PING round trip (to one node) measured alongside.

    .venv/bin/python bench/redis_transport_bench.py [--events 20000] [--queries 3000]
    .venv/bin/python bench/redis_transport_bench.py --cluster [--cluster-url redis://...]
"""

from __future__ import annotations

import argparse
import random
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import redis
from redis_bench import engine_events, percentile

from kvledger.events import codec
from kvledger.events.shared.registry import SharedRegistry
from kvledger.events.shared.transport import Command, Transport, _first_key
from kvledger.events.types import Stored, Tier
from kvledger.registry.hashing import TokenBlockSequence

Sender = Callable[[Transport, Sequence[Command]], list[Any]]


def scripts_in_a_pipeline(t: Transport, commands: Sequence[Command]) -> list[Any]:
    """redis-py ``Script`` objects called in a redis-py pipeline."""
    by_sha = {s.sha: s for s in t._scripts.values()}
    pipe = t.client.pipeline(transaction=False)  # type: ignore[no-untyped-call]
    for c in commands:
        if c[0] in ("EVALSHA", "EVALSHA_RO"):
            keys = int(c[2])
            by_sha[str(c[1])](keys=c[3 : 3 + keys], args=c[3 + keys :], client=pipe)
        else:
            pipe.execute_command(*c)
    return list(pipe.execute())


def cluster_pipeline_nodes_named(t: Transport, commands: Sequence[Command]) -> list[Any]:
    """redis-py's cluster pipeline, each command's node named (no COMMAND GETKEYS)."""
    assert isinstance(t.client, redis.RedisCluster)
    pipe = t.client.pipeline()  # type: ignore[no-untyped-call]
    for c in commands:
        node = t.client.get_node_from_key(_first_key(c))  # type: ignore[no-untyped-call]
        pipe.execute_command(*c, target_nodes=node)
    return list(pipe.execute())


def cluster_pipeline_own_routing(t: Transport, commands: Sequence[Command]) -> list[Any]:
    """redis-py's cluster pipeline routing by itself."""
    assert isinstance(t.client, redis.RedisCluster)
    pipe = t.client.pipeline()  # type: ignore[no-untyped-call]
    for c in commands:
        pipe.execute_command(*c)
    return list(pipe.execute())


def registry(client: Any, shards: int, maxlen: int, send: Sender | None) -> SharedRegistry:
    reg = SharedRegistry(
        client, f"bench-{uuid.uuid4().hex[:8]}", shards=shards, stream_maxlen=maxlen
    )
    if send is not None:
        transport = reg.transport

        def send_instead(commands: Sequence[Command]) -> list[Any]:
            return send(transport, commands)

        transport._send = send_instead  # type: ignore[method-assign]
    return reg


def measure(client: Any, variants: dict[str, Sender | None], args: argparse.Namespace) -> None:
    cluster = isinstance(client, redis.RedisCluster)
    workers = 6 if cluster else 1
    per_worker = args.events // workers
    records = {
        w: [codec.encode(e) for e in engine_events(per_worker, w, w)] for w in range(workers)
    }
    batches = [
        (w, records[w][i : i + args.batch])
        for i in range(0, per_worker, args.batch)
        for w in range(workers)
    ]
    names = list(variants)
    node = client.get_primaries()[0] if cluster else None
    for shards in args.shards if cluster else [1]:
        regs = {n: registry(client, shards, per_worker + 1, send) for n, send in variants.items()}
        wall, cpu = dict.fromkeys(names, 0.0), dict.fromkeys(names, 0.0)
        try:
            for reg in regs.values():
                for w in records:
                    reg.apply_records(w, [])  # loads the scripts: not timed
            for j, (w, batch) in enumerate(batches):
                for n in names[j % len(names) :] + names[: j % len(names)]:
                    t0, c0 = time.perf_counter(), time.process_time()
                    assert regs[n].apply_records(w, batch).gap_at is None
                    wall[n] += time.perf_counter() - t0
                    cpu[n] += time.process_time() - c0
            for reg in regs.values():
                assert all(reg.applied_count(w) == per_worker for w in records)
        finally:
            for reg in regs.values():
                reg.delete_namespace()
        total = per_worker * workers
        print(f"{shards} shard(s), apply: events/s (client CPU us/event), ratio to the transport")
        for n in names:
            rate = total / wall[n]
            print(
                f"  {n:34s} {rate:9,.0f} ({1e6 * cpu[n] / total:4.1f})"
                f"  {wall[names[0]] / wall[n]:5.2f}"
            )
        who_has(client, node, shards, variants, args.queries)


def who_has(
    client: Any, node: Any, shards: int, variants: dict[str, Sender | None], queries: int
) -> None:
    rng = random.Random(1)
    regs = {n: registry(client, shards, 1000, send) for n, send in variants.items()}
    try:
        prefixes = []
        for i in range(100):
            seq = TokenBlockSequence([rng.randrange(32000) for _ in range(16 * 32)], 16)
            prefixes.append(seq.sequence_hashes)
            blocks = tuple(zip(seq.sequence_hashes, seq.local_hashes, strict=True))
            event = Stored(
                event_id=i,
                worker_id=1,
                dp_rank=0,
                tier=Tier.G1,
                ts=0.0,
                parent_hash=None,
                blocks=blocks,
            )
            for reg in regs.values():
                reg.apply(1, [event])
        times: dict[str, list[float]] = {n: [] for n in ["PING", *regs]}
        names = list(regs)
        for i in range(queries):
            hashes = prefixes[i % len(prefixes)]
            t0 = time.perf_counter()
            client.ping(target_nodes=node) if node is not None else client.ping()
            times["PING"].append(time.perf_counter() - t0)
            for n in names if i % 2 else names[::-1]:
                t0 = time.perf_counter()
                assert all(regs[n].who_has(hashes))
                times[n].append(time.perf_counter() - t0)
    finally:
        for reg in regs.values():
            reg.delete_namespace()
    first = percentile(times[names[0]], 0.5)
    print(f"{shards} shard(s), who_has(32 blocks): p50 / p99 us, p50 ratio to the transport")
    for n, values in times.items():
        p50, p99 = percentile(values, 0.5), percentile(values, 0.99)
        print(f"  {n:34s} {p50 * 1e6:6.0f} / {p99 * 1e6:6.0f}  {p50 / first:5.2f}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", default="redis://127.0.0.1:6379/0")
    ap.add_argument("--events", type=int, default=20_000)
    ap.add_argument("--batch", type=int, default=512)
    ap.add_argument("--queries", type=int, default=3000)
    ap.add_argument("--cluster", action="store_true", help="on a Redis Cluster")
    ap.add_argument("--cluster-url", default=None, help="a running cluster (default: start one)")
    ap.add_argument("--shards", type=int, nargs="+", default=[1, 3, 6])
    args = ap.parse_args()
    if not args.cluster:
        measure(
            redis.Redis.from_url(args.url),
            {"transport": None, "redis-py Script in a pipeline": scripts_in_a_pipeline},
            args,
        )
        return
    started = None
    url = args.cluster_url
    if url is None:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
        from redis_cluster import LocalCluster

        started = LocalCluster().start()
        url = started.url
    try:
        variants: dict[str, Sender | None] = {
            "transport": None,
            "cluster pipeline, nodes named": cluster_pipeline_nodes_named,
            "cluster pipeline, its own routing": cluster_pipeline_own_routing,
        }
        measure(redis.RedisCluster.from_url(url), variants, args)
    finally:
        if started is not None:
            started.stop()


if __name__ == "__main__":
    main()
