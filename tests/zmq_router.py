"""A router's index fed over ZMQ: what a router operator runs, as a script for the tests.

    python tests/zmq_router.py ENDPOINT REPLAY_ENDPOINT WORKER_ID BATCHES

subscribes to a worker's vLLM-compatible stream (catching up through the replay socket on the
gap its first message shows), folds every event into a ``RouterIndex`` until it has read
``BATCHES`` batches (30 s at most), and prints ``{"batches": n, "holders": {seq: {worker:
tier mask}}}`` as JSON. It imports only what the light install has (no torch).
"""

from __future__ import annotations

import json
import sys
import time

from kvledger.events.shared.zmq_subscribe import ZmqSubscriber
from kvledger.events.vllm_events import to_events
from kvledger.registry.index import RouterIndex


def follow(endpoint: str, replay_endpoint: str, worker_id: int, batches: int) -> RouterIndex:
    index = RouterIndex()
    next_id = 0
    deadline = time.monotonic() + 30
    with ZmqSubscriber(endpoint, replay_endpoint=replay_endpoint) as subscriber:
        while subscriber.next_seq < batches and time.monotonic() < deadline:
            for _seq, batch in subscriber.batches(timeout=1.0):
                for event in to_events(worker_id, next_id, batch):
                    index.apply(event)
                    next_id += 1
                if subscriber.next_seq >= batches:
                    break
        print(
            json.dumps(
                {
                    "batches": subscriber.next_seq,
                    "holders": {
                        str(seq): {str(w): mask for w, mask in held.items()}
                        for seq, held in index.holders().items()
                    },
                }
            )
        )
    return index


if __name__ == "__main__":
    follow(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
