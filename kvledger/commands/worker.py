"""``kvledger worker``: a mock engine that logs its KV events and publishes them to Redis.

Several of these, each its own process, share one Redis namespace: that is the shared-registry
setup in miniature. Each worker writes its own durable log first and hands the same events to a
Redis publisher, so Redis can always be rebuilt from the logs.

It prints one JSON line when its workload is done (``{"done": ...}``) and, with ``--linger``,
keeps its lease alive until SIGTERM/SIGINT, then drains and exits.
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import signal
import sys
import threading
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from kvledger.builder import open_worker
from kvledger.commands.args import (
    add_zmq_args,
    linger_seconds,
    log_location,
    non_negative_int,
    positive_int,
    publishing_line,
    zmq_settings,
)
from kvledger.config import Settings
from kvledger.events.log.schema import database_url
from kvledger.events.shared.publish import RedisPublisher
from kvledger.mocker.g1_pool import Deref, FullBlock, MockG1Pool, Use
from kvledger.registry.hashing import TokenBlockSequence


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("worker", help="run a mock engine that publishes to the shared registry")
    p.add_argument("--worker-id", type=non_negative_int, required=True)
    p.add_argument("--dp-rank", type=non_negative_int, default=0)
    p.add_argument(
        "--redis-url",
        default=None,
        help="default: KVLEDGER_REDIS_URL, else redis://127.0.0.1:6379/0",
    )
    p.add_argument(
        "--namespace", default=None, help="default: KVLEDGER_REDIS_NAMESPACE, else 'kvledger'"
    )
    p.add_argument(
        "--shards",
        type=positive_int,
        default=None,
        help="split a new namespace's index over N shards (default: as recorded, else 1)",
    )
    p.add_argument(
        "--log",
        type=log_location,
        required=True,
        help="event log URL or SQLite path of this worker",
    )
    p.add_argument("--requests", type=non_negative_int, default=1000)
    p.add_argument("--blocks", type=positive_int, default=512, help="G1 capacity in blocks")
    p.add_argument("--block-size", type=positive_int, default=16)
    p.add_argument(
        "--prefixes", type=positive_int, default=8, help="distinct shared prompt prefixes"
    )
    p.add_argument("--interval", type=float, default=0.0, help="seconds between requests")
    p.add_argument("--lease-ttl", type=float, default=10.0, help="lease TTL in seconds")
    p.add_argument(
        "--publish-linger",
        type=linger_seconds,
        default=0.0,
        metavar="S",
        help="let a batch wait up to S seconds to fill before it is sent (default 0)",
    )
    p.add_argument(
        "--publish-timeout",
        type=float,
        default=30.0,
        metavar="S",
        help="after the workload, how long to wait for Redis to take every event (default 30)",
    )
    p.add_argument("--seed", type=int, default=0, help="workload seed (prefixes are shared)")
    p.add_argument("--linger", action="store_true", help="stay alive until SIGTERM")
    add_zmq_args(p)
    p.add_argument("--release-on-exit", action="store_true", help="drop entries when leaving")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    _report_publisher_warnings()
    settings = _settings(args)
    if args.zmq_replay_endpoint is not None and args.zmq_endpoint is None:
        raise ValueError("--zmq-replay-endpoint needs --zmq-endpoint")
    # the log, the views (claiming the worker id and bringing the shared registry in step with
    # the log before any event; a reset is said in one line on stderr), as every entry point
    worker = open_worker(settings)
    publisher = worker.publisher
    assert publisher is not None  # a worker always has a Redis URL here
    if worker.zmq is not None:
        _note(publishing_line(worker.zmq))
    drained = False
    drain_timeout = 10.0
    try:
        mgr = MockG1Pool(
            args.blocks,
            args.block_size,
            eviction="lru",
            sink=worker.sink,
            worker_id=args.worker_id,
            dp_rank=args.dp_rank,
        )
        stop = threading.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: stop.set())
        # A restarted worker continues its own event ids and says its old cache is gone.
        worker.resume(mgr.emitter)
        _workload(mgr, args, stop, publisher)
        worker.flush()
        drained = publisher.wait_applied(timeout=args.publish_timeout)
        if not drained and publisher.error is None:
            drain_timeout = 0.0  # waited already
            _note(
                f"Redis at {_shown(settings.redis_url or '')} has events up to "
                f"{publisher.applied_id} of {mgr.emitter.next_event_id - 1} after waiting "
                f"{args.publish_timeout:g} s (--publish-timeout); the rest are in {args.log} "
                "only, and a worker restarted with this log re-sends them"
            )
        if publisher.error is None:
            found = publisher.reconciled
            _report(
                done=True,
                worker_id=args.worker_id,
                last_event_id=mgr.emitter.next_event_id - 1,
                applied_id=publisher.applied_id,
                drained=drained,
                caught_up=publisher.caught_up,
                outages=publisher.outages,
                dropped=publisher.dropped,
                reconciled=None if found is None else found.action,
            )
            if args.linger:
                while not stop.wait(0.2) and publisher.error is None:
                    pass
    finally:
        worker.close(drain_timeout=0.0 if publisher.error is not None else drain_timeout)
        if args.release_on_exit and publisher.error is None:
            publisher.registry.release(args.worker_id, publisher.token)
    if publisher.error is not None:
        _note(f"stopped: {publisher.error}")
        return 1
    return 0 if drained else 1


def _workload(
    mgr: MockG1Pool, args: argparse.Namespace, stop: threading.Event, publisher: RedisPublisher
) -> None:
    """Requests that share a few long prompt prefixes, each with its own random tail. Ends
    early when the publisher stopped (another process took the worker id)."""
    shared = random.Random(args.seed)
    prefixes = [
        [shared.randrange(32000) for _ in range(args.block_size * shared.randrange(4, 32))]
        for _ in range(args.prefixes)
    ]
    rng = random.Random(args.seed * 1_000_003 + args.worker_id)
    for _ in range(args.requests):
        if stop.is_set() or publisher.error is not None:
            return
        tail = [rng.randrange(32000) for _ in range(args.block_size * rng.randrange(1, 16))]
        tokens = rng.choice(prefixes) + tail
        seq = TokenBlockSequence(tokens, args.block_size)
        blocks = [FullBlock(h) for h in seq.sequence_hashes]
        size = args.block_size
        token_ids = [tokens[i * size : (i + 1) * size] for i in range(len(blocks))]
        placed = mgr.process(Use(blocks, local_hashes=seq.local_hashes, token_ids=token_ids))
        mgr.process(Deref(blocks[:placed]))
        if args.interval:
            stop.wait(args.interval)


def _report(**fields: Any) -> None:
    print(json.dumps(fields), flush=True)


def _note(message: str) -> None:
    print(f"kvledger worker: {message}", file=sys.stderr, flush=True)


def _settings(args: argparse.Namespace) -> Settings:
    """The worker's settings: its flags over the ``KVLEDGER_*`` variables, as ``BlockManager``
    reads them (an operator who exports ``KVLEDGER_REDIS_NAMESPACE`` once gets the same
    namespace in every worker; ``token_ids`` and the ZMQ sockets' CurveZMQ keys come from
    there too). Redis defaults to the local server."""
    flags = {
        "worker_id": args.worker_id,
        "dp_rank": args.dp_rank,
        "block_size": args.block_size,
        "event_log_url": database_url(args.log),
        "redis_url": args.redis_url,
        "redis_namespace": args.namespace,
        "redis_shards": args.shards,
        "redis_lease_s": args.lease_ttl,
        "redis_linger_s": args.publish_linger,
        **zmq_settings(args),
    }
    settings = Settings.load(**{k: v for k, v in flags.items() if v is not None})
    if settings.redis_url is None:
        settings = Settings.load(
            **{k: v for k, v in flags.items() if v is not None},
            redis_url="redis://127.0.0.1:6379/0",
        )
    return settings


def _report_publisher_warnings() -> None:
    """The publisher logs when Redis goes away and comes back (once each, not per retry);
    show those lines on stderr in the worker's own voice."""
    publish_log = logging.getLogger("kvledger.events.shared.publish")
    if any(h.get_name() == "kvledger worker" for h in publish_log.handlers):
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.set_name("kvledger worker")
    handler.setFormatter(logging.Formatter("kvledger worker: %(message)s"))
    publish_log.addHandler(handler)
    publish_log.propagate = False


def _shown(url: str) -> str:
    """A Redis URL without its password."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.replace(f":{parts.password}@", ":***@")
    return urlunsplit(parts._replace(netloc=netloc))
