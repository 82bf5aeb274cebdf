"""ZMQ event publishing: kvledger's ``ZmqPublisher`` against vLLM's ``ZmqEventPublisher``, and
how fast Dynamo's standalone indexer ingests our stream.

1. Publish rate (encode + send). The events are a worker's real stream: a ``TieredPools``
   (G1 + G2 + G3, lineage) serving prompts with shared prefixes, tokens and a LoRA adapter on
   some, so stores, removals, offloads and onboards all occur. Both publishers get the same
   events, one per batch (what our publisher sends; our sequence numbers are event ids):
   kvledger's gets our event objects, vLLM's gets the ``KVEventBatch`` structs of the same
   vLLM events, built before the clock starts (an engine builds them as it schedules). Each
   publisher binds a TCP socket with one subscriber draining it, in its own process; the clock
   runs from the first ``publish`` until the publisher's thread has sent the last batch. vLLM
   lives in .bench-venv (bench/setup_bench_venv.sh), so its side runs this file under
   .bench-venv/bin/python (``--vllm-side``). Rounds alternate between the two.
2. Dynamo ingest. ``python -m dynamo.indexer`` subscribes to our publisher inside a private
   network namespace (its HTTP server binds every interface); the clock runs from the first
   publish until a query sees the last event's blocks.
3. Memory: what keeping token ids costs per live block (tracemalloc over pools holding the same
   blocks with and without tokens), and what the publisher's per-tier view adds.
4. Emit to send: a producer appends a worker's stream to a SQLite event log at ``--rate``
   events/s (15k, the engine-on simulation's rate) with a publisher fed by the log's commits,
   in a child process as ``kvledger worker`` runs it (``--zmq-thread``: a ``ZmqPublisher``
   thread of the producer's process), at the CLI's switch interval (``--switch-interval``);
   a subscriber in its own process stamps each batch as it arrives. Each event's time
   from its append until a router had it (p50/p99, ``bench/emit_latency.py``; target p99 <=
   the log's ``max_delay`` + 20 ms).

    .venv/bin/python bench/zmq_bench.py [--requests N] [--rounds R]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
BENCH_PYTHON = REPO / ".bench-venv" / "bin" / "python"
BLOCK = 16


# -- both sides: a subscriber that drains a PUB socket -------------------------------------


def _drain(endpoint: str, expected: int, stamp: bool = False) -> subprocess.Popen[str]:
    """A subscriber in its own process (as a router is) that reads ``expected`` messages."""
    proc = subprocess.Popen(
        [sys.executable, __file__, "--drain", endpoint, "--expected", str(expected)]
        + (["--stamp"] if stamp else []),
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    proc.stdout.readline()  # "ready": connected and subscribed
    time.sleep(0.3)  # the subscription reaches the publisher
    return proc


def drain_side(endpoint: str, expected: int, stamp: bool = False) -> None:
    """Read ``expected`` messages; with ``stamp``, print each one's (sequence number, arrival
    ``time.monotonic()``) as JSON at the end."""
    import zmq

    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.RCVHWM, 0)
    sub.connect(endpoint)
    print("ready", flush=True)
    got = 0
    arrivals: list[tuple[int, float]] = []
    while got < expected and sub.poll(5000):
        frames = sub.recv_multipart()
        if stamp:
            arrivals.append((int.from_bytes(frames[1], "big"), time.monotonic()))
        got += 1
    sub.close(0)
    if stamp:
        print(json.dumps(arrivals), flush=True)


# -- the vLLM side (runs under .bench-venv/bin/python; imports nothing of kvledger) ---------


def vllm_side(events_path: str, rounds: int) -> None:
    import msgspec
    import zmq
    from vllm.distributed.kv_events import (
        AllBlocksCleared,
        BlockRemoved,
        BlockStored,
        KVEventBatch,
        ZmqEventPublisher,
    )

    raw = msgspec.msgpack.decode(Path(events_path).read_bytes())
    kinds = {"BlockStored": BlockStored, "BlockRemoved": BlockRemoved}
    batches = []
    for ts, events, rank in raw:
        built = []
        for e in events:
            kind = e.pop("type")
            built.append(AllBlocksCleared() if kind == "AllBlocksCleared" else kinds[kind](**e))
        batches.append(KVEventBatch(ts=ts, events=built, data_parallel_rank=rank))
    rates = []
    for _ in range(rounds):
        publisher = ZmqEventPublisher(0, endpoint="tcp://127.0.0.1:*")
        endpoint = publisher._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        drainer = _drain(endpoint, len(batches))
        started, cpu = time.perf_counter(), time.process_time()
        for batch in batches:
            publisher.publish(batch)
        publisher._event_queue.join()
        n = len(batches)
        rates.append((n / (time.perf_counter() - started), n / (time.process_time() - cpu)))
        drainer.wait(30)
        publisher.shutdown()
    print(json.dumps({"rates": rates}))


# -- the kvledger side ----------------------------------------------------------------------


def make_events(requests: int, seed: int = 0) -> list[Any]:
    """A worker's event stream: prompts sharing prefixes through G1, G2 and G3."""
    import random

    from kvledger.registry.emitter import EventEmitter
    from kvledger.registry.hashing import TokenBlockSequence
    from kvledger.registry.tiered import TieredPools

    events: list[Any] = []
    reg = TieredPools(
        256,
        512,
        1024,
        policy="lineage",
        offload_filter="always",
        emitter=EventEmitter(events.append),
    )
    rng = random.Random(seed)
    prefixes = [
        [rng.randrange(32000) for _ in range(BLOCK * rng.randrange(4, 24))] for _ in range(64)
    ]
    for i in range(requests):
        tokens = rng.choice(prefixes) + [
            rng.randrange(32000) for _ in range(BLOCK * rng.randrange(1, 8))
        ]
        seq = TokenBlockSequence(tokens, BLOCK, lora_name="adapter-a" if i % 10 == 0 else None)
        hashes = seq.sequence_hashes
        match = reg.match(hashes)
        reg.note_request(hashes)
        held = reg.g1.match(hashes[: match.g1])
        for plan in reg.plan_onboard(hashes, match):
            reg.complete(plan)
            held += plan.landed
        start = len(held)
        fresh = reg.g1.allocate_upto(len(hashes) - start)
        blocks = list(
            zip(hashes[start : start + len(fresh)], seq.local_hashes[start:], strict=False)
        )
        if fresh:
            held += reg.g1.register(
                fresh,
                blocks,
                hashes[start - 1] if start else None,
                seq.block_tokens(start, start + len(fresh)),
                seq.hash_key,
            )
            todo = reg.plan_offload(held[start:])
            while todo:
                todo = [follow for plan in todo for follow in reg.complete(plan)]
        reg.release(reg.g1.tier, reversed(held))
    return events


def kvledger_round(events: list[Any]) -> tuple[float, float]:
    from kvledger.events.shared.zmq_publish import ZmqPublisher

    publisher = ZmqPublisher("tcp://127.0.0.1:*", worker_id=0, block_size=BLOCK)
    drainer = _drain(publisher.endpoint, len(events))
    started, cpu = time.perf_counter(), time.process_time()
    for event in events:
        publisher(event)
    publisher.wait_sent(60)
    n = len(events)
    rate = (n / (time.perf_counter() - started), n / (time.process_time() - cpu))
    drainer.wait(30)
    publisher.close()
    return rate


def emit_to_send(
    rate: float, seconds: float, switch_interval: float | None, *, thread: bool = False
) -> str:
    """Append ``rate`` events/s to a log for ``seconds``; each event's time until a subscriber
    in another process received it. ``switch_interval``: the interpreter's for the run (None:
    kvledger's CLI's). The publisher runs in a child process, as ``kvledger worker`` runs it;
    with ``thread``, in a thread of this process (``--zmq-thread``)."""
    from emit_latency import delays, paced, summary

    from kvledger.cli import CLI_SWITCH_INTERVAL_S
    from kvledger.events.log import EventLog
    from kvledger.events.shared.zmq_process import ZmqPublisherProcess
    from kvledger.events.shared.zmq_publish import open_publisher

    events: list[Any] = []
    requests = 200
    while len(events) < rate * seconds:
        events = make_events(requests)
        requests *= 2
    events = events[: int(rate * seconds)]
    interval = CLI_SWITCH_INTERVAL_S if switch_interval is None else switch_interval
    sys.setswitchinterval(interval)
    with tempfile.TemporaryDirectory() as tmp:
        log = EventLog(str(Path(tmp) / "events.db"))
        publisher: Any = (
            open_publisher("tcp://127.0.0.1:*", log=log, worker_id=0, block_size=BLOCK)
            if thread
            else ZmqPublisherProcess("tcp://127.0.0.1:*", log=log, worker_id=0, block_size=BLOCK)
        )
        drainer = _drain(publisher.endpoint, len(events), stamp=True)
        try:
            emitted = paced(log.append, events, rate)
            got = len(emitted) / (emitted[-1] - emitted[0])
            publisher.wait_sent(60)
            committed = [(n - 1, at) for n, at in log.commit_times]
            out, _ = drainer.communicate(timeout=60)
            arrivals = [tuple(a) for a in json.loads(out.strip().splitlines()[-1])]
        finally:
            publisher.close()
            log.close()
    seen = sorted(arrivals)
    where = "a thread" if thread else "a child process"
    name = f"emit -> ZMQ received (publisher in {where}, switch interval {interval * 1e3:g} ms)"
    return "\n".join(
        (
            summary("emit -> committed (log)", delays(emitted, committed), got, log.max_delay),
            summary(name, delays(emitted, seen), got, log.max_delay),
        )
    )


def vllm_batches(events: list[Any]) -> list[Any]:
    """The vLLM events our publisher sends, one batch per event, decoded to plain data."""
    from kvledger.events.vllm_events import VllmMapper, decode_batch

    mapper = VllmMapper(BLOCK)
    return [list(decode_batch(mapper.payload(e))) for e in events]


def publish_bench(events: list[Any], rounds: int) -> dict[str, Any]:
    import msgpack

    if not BENCH_PYTHON.exists():
        return {"skipped": "no .bench-venv (bash bench/setup_bench_venv.sh builds it)"}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "events.msgpack"
        path.write_bytes(msgpack.packb(vllm_batches(events)))
        ours, theirs = [], []
        for _ in range(rounds):
            ours.append(kvledger_round(events))
            out = subprocess.run(
                [str(BENCH_PYTHON), __file__, "--vllm-side", str(path), "--rounds", "1"],
                capture_output=True,
                text=True,
                check=True,
                timeout=600,
                env={**os.environ, "VLLM_LOGGING_LEVEL": "ERROR"},
            )
            theirs += json.loads(out.stdout.strip().splitlines()[-1])["rates"]
    return {"kvledger": ours, "vllm": theirs}


# -- Dynamo ingest (inside a private network namespace) -----------------------------------


def dynamo_side(requests: int, rounds: int) -> None:
    import urllib.request

    from kvledger.events.shared.zmq_publish import ZmqPublisher
    from kvledger.events.types import Stored, Tier

    events = make_events(requests, seed=1)
    n = len(events)
    final_tokens = list(range(1, BLOCK * 2 + 1))
    from kvledger.registry.hashing import TokenBlockSequence

    seq = TokenBlockSequence(final_tokens, BLOCK)
    last = Stored(
        event_id=n,
        worker_id=0,
        dp_rank=0,
        tier=Tier.G1,
        ts=time.time(),
        parent_hash=None,
        blocks=tuple(zip(seq.sequence_hashes, seq.local_hashes, strict=True)),
        token_ids=(tuple(final_tokens[:BLOCK]), tuple(final_tokens[BLOCK:])),
    )

    def post(path: str, body: dict[str, Any]) -> Any:
        req = urllib.request.Request(
            "http://127.0.0.1:8090" + path,
            json.dumps(body).encode(),
            {"content-type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=5) as resp:
            return json.loads(resp.read())

    rates = []
    for r in range(rounds):
        indexer = subprocess.Popen(
            [sys.executable, "-m", "dynamo.indexer", "--port", "8090", "--threads", "1"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        publisher = ZmqPublisher(
            f"tcp://127.0.0.1:{5800 + r}",
            replay_endpoint=f"tcp://127.0.0.1:{5900 + r}",
            worker_id=0,
            block_size=BLOCK,
            ring_size=n + 10,
        )
        try:
            for _ in range(300):
                try:
                    urllib.request.urlopen("http://127.0.0.1:8090/health", timeout=1).close()
                    break
                except OSError:
                    time.sleep(0.1)
            post(
                "/register",
                {
                    "instance_id": 0,
                    "endpoint": publisher.endpoint,
                    "replay_endpoint": publisher.replay_endpoint,
                    "block_size": BLOCK,
                    "model_name": "default",
                },
            )
            time.sleep(1.0)
            started = time.perf_counter()
            for event in [*events, last]:
                publisher(event)
            while True:
                got = post("/query", {"token_ids": final_tokens, "model_name": "default"})
                if got.get("instances", {}).get("0", {}).get("gpu") == 2 * BLOCK:
                    break
                time.sleep(0.02)
            rates.append((n + 1) / (time.perf_counter() - started))
        finally:
            publisher.close()
            indexer.kill()
            indexer.wait()
    print(json.dumps({"rates": rates, "events": n + 1}))


def dynamo_bench(requests: int, rounds: int) -> dict[str, Any]:
    unshare = shutil.which("unshare")
    if unshare is None:
        return {"skipped": "needs unshare(1) for a private network namespace"}
    cmd = [
        unshare,
        "-rn",
        "sh",
        "-c",
        'ip link set lo up 2>/dev/null; exec "$@"',
        "sh",
        sys.executable,
        __file__,
        "--dynamo-side",
        "--requests",
        str(requests),
        "--rounds",
        str(rounds),
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900, check=False)
    if done.returncode != 0:
        return {"skipped": f"dynamo side failed: {done.stderr.strip()[-400:]}"}
    return json.loads(done.stdout.strip().splitlines()[-1])


# -- memory --------------------------------------------------------------------------------


def memory_per_block(blocks: int = 20_000) -> dict[str, float]:
    from kvledger.events.types import Stored, Tier
    from kvledger.events.vllm_events import VllmMapper
    from kvledger.registry.hashing import TokenBlockSequence
    from kvledger.registry.pool import BlockPool

    seqs = [
        TokenBlockSequence([i * 7919 + t for t in range(BLOCK * 8)], BLOCK)
        for i in range(blocks // 8)
    ]

    def fill(with_tokens: bool) -> int:
        pool = BlockPool(blocks)
        tracemalloc.start()
        before = tracemalloc.get_traced_memory()[0]
        for seq in seqs:
            slots = pool.allocate(8)
            tokens = seq.block_tokens() if with_tokens else None
            pool.register(
                slots, list(zip(seq.sequence_hashes, seq.local_hashes, strict=True)), None, tokens
            )
            pool.release(slots)
        used = tracemalloc.get_traced_memory()[0] - before
        tracemalloc.stop()
        del pool
        return used

    plain, tokens = fill(False), fill(True)
    mapper = VllmMapper(BLOCK)
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    for i, seq in enumerate(seqs):
        chain_ = tuple(zip(seq.sequence_hashes, seq.local_hashes, strict=True))
        mapper.packed(
            Stored(
                event_id=i,
                worker_id=0,
                dp_rank=0,
                tier=Tier.G1,
                ts=0.0,
                parent_hash=None,
                blocks=chain_,
            )
        )
    view = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    return {
        "tokens_bytes_per_block": (tokens - plain) / blocks,
        "publisher_view_bytes_per_block_and_tier": view / blocks,
        "token_payload_bytes": 4 * BLOCK,
    }


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--requests", type=int, default=3000)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--vllm-side", metavar="EVENTS")
    p.add_argument("--dynamo-side", action="store_true")
    p.add_argument("--drain", metavar="ENDPOINT")
    p.add_argument("--expected", type=int, default=0)
    p.add_argument("--stamp", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--rate", type=float, default=15_000, help="emit-to-send: events/s")
    p.add_argument("--seconds", type=float, default=4.0, help="emit-to-send: run length")
    p.add_argument("--emit-only", action="store_true", help="only the emit-to-send run")
    p.add_argument(
        "--zmq-thread",
        action="store_true",
        help="emit-to-send with the publisher in a thread of the producer's process",
    )
    p.add_argument(
        "--switch-interval",
        type=float,
        default=None,
        help="the interpreter's switch interval (s) for the run: by default kvledger's CLI's "
        "(0.0005); 0.005, Python's default, is what an engine's process that leaves it has",
    )
    args = p.parse_args()
    if args.drain:
        drain_side(args.drain, args.expected, args.stamp)
        return
    if args.vllm_side:
        vllm_side(args.vllm_side, args.rounds)
        return
    if args.dynamo_side:
        dynamo_side(args.requests, args.rounds)
        return
    if args.emit_only:
        print(f"load average {os.getloadavg()[0]:.2f}")
        print(emit_to_send(args.rate, args.seconds, args.switch_interval, thread=args.zmq_thread))
        return
    events = make_events(args.requests)
    kinds: dict[str, int] = {}
    for e in events:
        kinds[type(e).__name__] = kinds.get(type(e).__name__, 0) + 1
    print(
        f"events: {len(events)} ({', '.join(f'{k} {v}' for k, v in sorted(kinds.items()))}), "
        f"block size {BLOCK}; load average {os.getloadavg()[0]:.2f}"
    )
    pub = publish_bench(events, args.rounds)
    if "skipped" in pub:
        print(f"publish: skipped ({pub['skipped']})")
    else:
        for i, what in enumerate(("wall clock", "CPU time of the publishing process")):
            ours = [r[i] for r in pub["kvledger"]]
            theirs = [r[i] for r in pub["vllm"]]
            print(f"by {what}:")
            for name, rates in (
                ("kvledger ZmqPublisher", ours),
                ("vLLM ZmqEventPublisher", theirs),
            ):
                print(
                    f"  {name}: {statistics.median(rates):,.0f} events/s median "
                    f"(min {min(rates):,.0f}, max {max(rates):,.0f})"
                )
            ratio = statistics.median(ours) / statistics.median(theirs)
            print(f"  ratio kvledger / vLLM: {ratio:.2f}x")
    dyn = dynamo_bench(args.requests, max(1, args.rounds // 2))
    if "skipped" in dyn:
        print(f"dynamo ingest: skipped ({dyn['skipped']})")
    else:
        rates = dyn["rates"]
        print(
            f"Dynamo indexer ingests our stream: {statistics.median(rates):,.0f} events/s median "
            f"(min {min(rates):,.0f}, max {max(rates):,.0f}; {dyn['events']} events)"
        )
    mem = memory_per_block()
    print(
        f"token ids kept per live block: {mem['tokens_bytes_per_block']:.0f} bytes "
        f"({mem['token_payload_bytes']} of them the ids); publisher's per-tier view: "
        f"{mem['publisher_view_bytes_per_block_and_tier']:.0f} bytes per block and tier"
    )
    print(emit_to_send(args.rate, args.seconds, args.switch_interval, thread=args.zmq_thread))
    print(f"load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
