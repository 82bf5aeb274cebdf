"""``kvledger tail LOG``: print a log's newest events, then follow new ones as they commit.

``kvledger tail --zmq tcp://HOST:PORT`` follows a vLLM-compatible ZMQ event stream instead (a
kvledger worker's or an engine's), asking ``--zmq-replay`` for what came before or was missed.
"""

from __future__ import annotations

import argparse
import time

from kvledger.commands.args import input_file, log_location, non_negative_int, positive_int
from kvledger.events.log import EventLog
from kvledger.events.types import AnyEvent, Cleared, Offloaded, Onboarded, Removed, Stored


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("tail", help="print the newest events of a log and follow new ones")
    p.add_argument(
        "log",
        metavar="LOG",
        type=log_location,
        nargs="?",
        help="SQLite file path or SQLAlchemy URL (or --zmq)",
    )
    p.add_argument("--zmq", metavar="ENDPOINT", help="follow a ZMQ KV event stream (PUB socket)")
    p.add_argument(
        "--zmq-replay", metavar="ENDPOINT", help="its replay socket: start from the first batch"
    )
    p.add_argument("--zmq-topic", default="", help="topic to subscribe to (default: all)")
    p.add_argument(
        "--zmq-server-key",
        metavar="FILE",
        type=input_file,
        help="the publisher's CurveZMQ public certificate (NAME.key), when it speaks CurveZMQ",
    )
    p.add_argument(
        "--zmq-client-key",
        metavar="FILE",
        type=input_file,
        help="this subscriber's CurveZMQ secret certificate, when the publisher lists its "
        "subscribers (default: a fresh key pair)",
    )
    p.add_argument(
        "--worker-id", type=non_negative_int, default=0, help="worker id to show for a ZMQ stream"
    )
    p.add_argument("-n", "--lines", type=non_negative_int, default=10, help="events to show first")
    p.add_argument("--no-follow", action="store_true", help="print and exit")
    p.add_argument("--interval", type=float, default=0.2, help="seconds between polls")
    p.add_argument(
        "--max-events", type=positive_int, help="exit after following this many new events"
    )
    p.set_defaults(func=run)


def describe(position: int, event: AnyEvent) -> str:
    head = f"{position:>8} w{event.worker_id}#{event.event_id} {event.tier.name} {event.ts:.6f}"
    if isinstance(event, Stored):
        parent = "-" if event.parent_hash is None else f"{event.parent_hash:016x}"
        body = f"stored {len(event.blocks)} after {parent}: " + _hashes(event.sequence_hashes)
    elif isinstance(event, Removed):
        body = f"removed {len(event.sequence_hashes)}: " + _hashes(event.sequence_hashes)
    elif isinstance(event, Offloaded | Onboarded):
        kind = "offloaded" if isinstance(event, Offloaded) else "onboarded"
        body = f"{kind} {len(event.blocks)} from {event.src_tier.name}: " + _hashes(
            event.sequence_hashes
        )
    elif isinstance(event, Cleared):
        body = "cleared"
    return f"{head} {body}"


def _hashes(hashes: tuple[int, ...], shown: int = 3) -> str:
    text = " ".join(f"{h:016x}" for h in hashes[:shown])
    return text + (f" (+{len(hashes) - shown})" if len(hashes) > shown else "")


def run(args: argparse.Namespace) -> int:
    if (args.log is None) == (args.zmq is None):
        raise ValueError("tail takes a LOG or --zmq ENDPOINT (one of them)")
    if args.zmq is not None:
        return _tail_zmq(args)
    with EventLog(args.log, read_only=True) as log:
        last = log.last_position()
        start = min(log.tail_start(args.lines), last)
        for position, event in log.read_positions(after_position=start, until_position=last):
            print(describe(position, event), flush=True)
        if args.no_follow:
            return 0
        followed = 0
        while args.max_events is None or followed < args.max_events:
            new = False
            for position, event in log.read_positions(after_position=last):
                print(describe(position, event), flush=True)
                last = position
                followed += 1
                new = True
                if args.max_events is not None and followed >= args.max_events:
                    break
            if not new:
                time.sleep(args.interval)
    return 0


def _tail_zmq(args: argparse.Namespace) -> int:
    """Follow a ZMQ stream; events are numbered as read (a vLLM batch has no event ids)."""
    # pyzmq and msgspec: only --zmq loads them
    from kvledger.events.shared.zmq_subscribe import ZmqSubscriber
    from kvledger.events.vllm_events import to_events

    with ZmqSubscriber(
        args.zmq,
        replay_endpoint=args.zmq_replay,
        topic=args.zmq_topic,
        curve_server_key=args.zmq_server_key,
        curve_client_key=args.zmq_client_key,
    ) as subscriber:
        batches = subscriber.replay(0) if args.zmq_replay is not None else iter(())
        followed, next_id = 0, 0
        timeout = 0.0 if args.no_follow else None
        for source in (batches, subscriber.batches(timeout=timeout)):
            for seq, batch in source:
                subscriber.next_seq = max(subscriber.next_seq, seq + 1)
                for event in to_events(args.worker_id, next_id, batch):
                    print(describe(seq, event), flush=True)
                    next_id += 1
                followed += 1
                if args.max_events is not None and followed >= args.max_events:
                    return 0
    return 0
