"""Shared registry throughput and ``who_has`` latency against the real Redis.

Throughput: a mock engine's event stream (Stored/Removed of 16-token blocks, shared prefixes) is
encoded once; the same records are then (a) XADDed raw in pipelines, one entry each, and (b)
given to ``SharedRegistry.apply_records`` (checks and per-batch reduction in Python, then the
Lua script: index update + one XADD of the call's records + idempotence bookkeeping), in batches
of the same size. The ratio (b)/(a) is the price of the shared index over a bare stream of the
events; a second line puts (b) against XADDs of the registry's own entries (one per batch,
``wire.pack_stream_entry``), which leaves the index's price alone. Redis's own time per event
(``INFO commandstats`` before and after each side; EVALSHA includes the commands it runs) shows
how much of each side is server work.

Latency: ``who_has`` of 32-block prefixes in one round trip, against a PING round trip measured
in the same run.

Emit to apply: a producer appends the same kind of stream to a SQLite event log at
``--rate`` events/s (15k, the engine-on simulation's rate) with a ``RedisPublisher`` fed by the
log's commits; each event's time from its append until the registry confirmed it applied
(p50/p99, ``bench/emit_latency.py``; target p99 <= the log's ``max_delay`` + 20 ms), split into
stages per apply (``Stages``: queued, preparing the call, the Redis call; the publisher
thread's CPU time; Redis's own time), then the same run with the committed records handed
through a pipe to another process that applies them: a reference for a publisher off the
engine's interpreter. ``--emit-only`` runs these two alone. The run uses the switch interval of
kvledger's CLI (0.5 ms); ``--switch-interval 0.005`` shows an engine's process that leaves
Python's default.

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
import bisect
import contextlib
import fcntl
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack
import redis
from emit_latency import delays, paced, summary

from kvledger.cli import CLI_SWITCH_INTERVAL_S
from kvledger.events import codec
from kvledger.events.log import EventLog
from kvledger.events.shared.keys import KeySpace
from kvledger.events.shared.publish import RedisPublisher
from kvledger.events.shared.registry import ApplyResult, SharedRegistry
from kvledger.events.types import AnyEvent, Stored, Tier
from kvledger.events.wire import pack_stream_entry
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
    ap.add_argument(
        "--emit-only", action="store_true", help="only the emit-to-apply run and its reference"
    )
    ap.add_argument("--child-apply", metavar="NAMESPACE", help=argparse.SUPPRESS)
    ap.add_argument(
        "--switch-interval",
        type=float,
        default=CLI_SWITCH_INTERVAL_S,
        help="the interpreter's switch interval (s) for the run: by default kvledger's CLI's "
        "(0.0005); 0.005, Python's default, is what an engine's process that leaves it has",
    )
    args = ap.parse_args()
    sys.setswitchinterval(args.switch_interval)
    if args.child_apply:
        child_apply(args.url, args.child_apply)
        return
    if args.emit_only:
        client = redis.Redis.from_url(args.url)
        print(
            f"load average {os.getloadavg()[0]:.2f}; switch interval "
            f"{args.switch_interval * 1e3:g} ms"
        )
        print(emit_to_apply(client, args.rate, args.seconds))
        print(emit_to_child_apply(args.url, args.rate, args.seconds))
        return
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

    raw_rates, entry_rates, apply_rates, raw_server, apply_server = [], [], [], [], []
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
            t0 = time.perf_counter()
            pipe = client.pipeline(transaction=False)
            for i in range(0, len(records), args.batch):  # the registry's entry format
                entry = pack_stream_entry(records[i : i + args.batch])
                pipe.xadd(reg.prefix + "raw-entries", {"w": "1", "e": entry})
            pipe.execute()
            entry_rates.append(len(records) / (time.perf_counter() - t0))

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
    entries = max(entry_rates)
    print(
        f"raw XADD of one entry per {args.batch} records {entries:,.0f} events/s: "
        f"apply / that {applied / entries:.2f} (the index's price alone)"
    )
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
    print(emit_to_child_apply(args.url, args.rate, args.seconds))


def emit_to_apply(client: redis.Redis, rate: float, seconds: float) -> str:
    """Append ``rate`` events/s to a log for ``seconds``; each event's time until the shared
    registry confirmed it applied, and where that time went (``Stages``)."""
    events = engine_events(int(rate * seconds), seed=3)
    reg = SharedRegistry(client, f"bench-{uuid.uuid4().hex[:8]}")
    stages = Stages(client)
    with tempfile.TemporaryDirectory() as tmp:
        log = EventLog(str(Path(tmp) / "events.db"))
        publisher = RedisPublisher(reg, 1, log=log)
        stages.watch(reg, publisher)
        publisher.start()
        try:
            stages.begin()
            emitted = paced(log.append, events, rate)
            got = len(emitted) / (emitted[-1] - emitted[0])
            assert publisher.wait_applied(60), publisher.error
            stages.end(len(events))
            committed = [(n - 1, at) for n, at in log.commit_times]
        finally:
            publisher.stop()
            log.close()
            reg.delete_namespace()
    applied = [(a.last, a.end) for a in stages.applies]
    return "\n".join(
        (
            summary("emit -> committed (log)", delays(emitted, committed), got, log.max_delay),
            summary("emit -> Redis applied", delays(emitted, applied), got, log.max_delay),
            *stages.lines(),
        )
    )


@dataclass
class _Apply:
    first: int
    last: int
    n: int
    start: float
    send: float
    sent: float
    end: float
    cpu: float


class Stages:
    """Where an event's time from its commit to the registry's confirmation goes, per apply
    of the publisher's thread: waiting in the publisher's queue (from the writer's hand-over to
    the start of the apply that takes it), preparing the call (parse, reduction, packing), the
    Redis call (``Transport.run``: send, Redis's own run, receive), each counted once per event
    the apply carries. The thread's CPU time against its wall time says how much of the apply
    was spent waiting for the interpreter or for Redis rather than running Python; Redis's own
    time per event is read from ``INFO commandstats``."""

    def __init__(self, client: redis.Redis) -> None:
        self.client = client
        self.handed: list[tuple[int, float]] = []  # (newest event id, when) per hand-over
        self.applies: list[_Apply] = []
        self._usec = 0
        self._run: list[float] = [0.0, 0.0]

    def watch(self, reg: SharedRegistry, publisher: RedisPublisher) -> None:
        """Wrap the publisher's hand-over and the registry's apply and transport (before the
        publisher starts: it subscribes its hand-over then)."""
        clock = time.monotonic
        run, apply, committed = reg.transport.run, reg.apply, publisher._committed

        def timed_run(commands: Any) -> Any:
            self._run[0] = clock()
            replies = run(commands)
            self._run[1] = clock()
            return replies

        def timed_apply(
            worker_id: int, batch: list[AnyEvent], *, token: int = 0, records: Any = None
        ) -> ApplyResult:
            start, cpu = clock(), time.thread_time()
            result = apply(worker_id, batch, token=token, records=records)
            end = clock()
            first = batch[0].event_id if batch else -1
            send, sent = self._run if self._run[0] >= start else (start, start)
            cpu = time.thread_time() - cpu
            self.applies.append(
                _Apply(first, result.last_event_id, len(batch), start, send, sent, end, cpu)
            )
            return result

        def timed_committed(batch: Any) -> None:
            self.handed.append((batch[-1][0].event_id, clock()))
            committed(batch)

        reg.transport.run = timed_run  # type: ignore[method-assign]
        reg.apply = timed_apply  # type: ignore[method-assign]
        publisher._committed = timed_committed  # type: ignore[method-assign]

    def _evalsha_usec(self) -> int:
        stats = self.client.info("commandstats").get("cmdstat_evalsha", {})
        return int(stats.get("usec", 0))

    def begin(self) -> None:
        self._usec = self._evalsha_usec()

    def end(self, events: int) -> None:
        self._events = events
        self._usec = self._evalsha_usec() - self._usec

    def lines(self) -> list[str]:
        ids = [eid for eid, _ in self.handed]
        wait, prep, call = [], [], []
        for a in self.applies:
            if not a.n:
                continue
            for eid in range(a.first, a.first + a.n):
                k = bisect.bisect_left(ids, eid)
                if k < len(ids):
                    wait.append(a.start - self.handed[k][1])
            prep += [a.send - a.start] * a.n
            call += [a.sent - a.send] * a.n
        sizes = sorted(a.n for a in self.applies if a.n)
        busy = sum(a.end - a.start for a in self.applies if a.n)
        cpu = sum(a.cpu for a in self.applies if a.n)

        def ms(values: list[float]) -> str:
            p50, p99 = percentile(values, 0.5) * 1e3, percentile(values, 0.99) * 1e3
            return f"p50 {p50:5.1f} / p99 {p99:5.1f} ms"

        return [
            f"  stages per event: queued {ms(wait)}; preparing the call {ms(prep)}; "
            f"the Redis call {ms(call)}",
            f"  {len(sizes)} applies of p50 {sizes[len(sizes) // 2]}, max {sizes[-1]} events; "
            f"the publisher's thread: {busy:.2f} s in applies, {cpu:.2f} s of it on a CPU "
            f"({cpu / max(busy, 1e-9):.0%}); per event {cpu / sum(sizes) * 1e6:.1f} us of its "
            f"CPU, Redis {self._usec / self._events:.1f} us (EVALSHA)",
        ]


def emit_to_child_apply(url: str, rate: float, seconds: float) -> str:
    """The reference for a publisher off the engine's interpreter: the same run, the log's
    writer handing each committed batch's records through a pipe to another process (this
    script with ``--child-apply``) that applies them (``apply_records``) and notes when. No
    claim, catch-up or reconciliation: only the path an event takes, to see what the engine's
    interpreter costs the in-process publisher."""
    events = engine_events(int(rate * seconds), seed=3)
    client = redis.Redis.from_url(url)
    ns = f"bench-{uuid.uuid4().hex[:8]}"
    SharedRegistry(client, ns)  # creates the namespace before the child reads it
    child = subprocess.Popen(
        [sys.executable, __file__, "--url", url, "--child-apply", ns],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=False,
    )
    assert child.stdin is not None
    out = child.stdin.fileno()
    with contextlib.suppress(OSError):  # a pipe of 1 MiB, so the writer does not wait on it
        fcntl.fcntl(out, F_SETPIPE_SZ, 1 << 20)

    def hand_over(batch: Sequence[tuple[AnyEvent, bytes]]) -> None:
        blob = msgpack.packb([record for _, record in batch])
        os.write(out, len(blob).to_bytes(4, "big") + blob)

    try:
        assert child.stdout is not None and child.stdout.readline().strip() == b"ready"
        with tempfile.TemporaryDirectory() as tmp:
            log = EventLog(str(Path(tmp) / "events.db"))
            log.on_commit(hand_over, worker_id=1)
            try:
                emitted = paced(log.append, events, rate)
                got = len(emitted) / (emitted[-1] - emitted[0])
                log.flush()
                committed = [(n - 1, at) for n, at in log.commit_times]
            finally:
                log.close()
        child.stdin.close()
        seen, calls = json.loads(child.stdout.read())
        applied = [tuple(a) for a in seen]
        per_event = [seconds for n, seconds in calls for _ in range(n)]
        child.wait(30)
    finally:
        child.kill()
        SharedRegistry(client, ns).delete_namespace()
    return "\n".join(
        (
            summary("reference, committed", delays(emitted, committed), got, log.max_delay),
            summary(
                "reference, applied by another process",
                delays(emitted, applied),  # type: ignore[arg-type]
                got,
                log.max_delay,
            ),
            f"  the Redis call per event there: p50 {percentile(per_event, 0.5) * 1e3:.1f} / "
            f"p99 {percentile(per_event, 0.99) * 1e3:.1f} ms; {len(calls)} applies of p50 "
            f"{statistics.median(n for n, _ in calls):.0f} events",
        )
    )


def child_apply(url: str, namespace: str) -> None:
    """``--child-apply``: apply the record batches framed on stdin until it closes, all that
    waits in one apply (as the publisher's thread takes all its queue holds); print (newest
    applied id, when) of each apply as JSON."""
    reg = SharedRegistry(redis.Redis.from_url(url), namespace)
    reg.apply_records(1, [])  # loads the script
    run = reg.transport.run
    calls: list[tuple[int, float]] = []  # (events, seconds) of each Redis call

    def timed_run(commands: Any) -> Any:
        start = time.monotonic()
        replies = run(commands)
        calls.append((len(records), time.monotonic() - start))
        return replies

    reg.transport.run = timed_run  # type: ignore[method-assign]
    print("ready", flush=True)
    fd = sys.stdin.fileno()
    seen = []
    buf = b""
    while chunk := os.read(fd, 1 << 20):
        buf += chunk
        records: list[bytes] = []
        while len(buf) >= 4 and len(buf) >= 4 + (size := int.from_bytes(buf[:4], "big")):
            records += msgpack.unpackb(buf[4 : 4 + size])
            buf = buf[4 + size :]
        if records:
            seen.append((reg.apply_records(1, records).last_event_id, time.monotonic()))
    print(json.dumps([seen, calls]), flush=True)


CLUSTER_WORKERS = 6
F_SETPIPE_SZ = 1031  # Linux


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
