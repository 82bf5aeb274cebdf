"""The ``token_ids`` setting: prompts' token ids kept out of everything persisted or shared
(the log, the Redis stream records, ZMQ replays), on a real BlockManager with G2 and G3, the
shared Redis, and a ZMQ PUB socket with its replay socket.

Token ids are chosen so that their bytes are found wherever they were written, in the encodings
each place uses (big-endian u32 in the log's records, in msgpack's uint32 of Redis records and
ZMQ batches), so the checks read the raw bytes as well as the decoded events.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import pytest
import redis
import sqlalchemy as sa
from services import REDIS_URL, redis_or_skip

from kvledger import BlockManager, Settings
from kvledger.events.log import EventLog
from kvledger.events.shared import SharedRegistry
from kvledger.events.shared.subscribe import decode_stream_record
from kvledger.events.shared.zmq_subscribe import ZmqSubscriber
from kvledger.events.types import Stored
from kvledger.events.wire import unpack_stream_entry

pytestmark = [pytest.mark.redis, pytest.mark.usefixtures("clean_env")]
BLOCK = 4
BASE = 0x5EC7E000  # every token id of the test: 0x5EC7E000 + small numbers


def tokens_of(prompt: int) -> list[int]:
    return [BASE + 64 * prompt + t for t in range(3 * BLOCK)]


def needles() -> list[bytes]:
    """The first token id of every prompt as a u32, in either byte order."""
    out = []
    for prompt in range(6):
        first = tokens_of(prompt)[0]
        out += [first.to_bytes(4, "big"), first.to_bytes(4, "little")]
    return out


@pytest.fixture
def namespace() -> Iterator[str]:
    name = f"privacy-{uuid.uuid4().hex[:10]}"
    yield name
    SharedRegistry(redis_or_skip(), name).delete_namespace()


def run_manager(tmp_path: Path, namespace: str, token_ids: str) -> dict[str, Any]:
    """Six prompts through a manager; what a live subscriber, a replay, the log and Redis hold."""
    settings = Settings.load(
        block_size=BLOCK, num_layers=1, outer_dim=1, inner_dim=4, dtype="float32",
        g1_blocks=8, g2_blocks=8, g3_blocks=16, offload_filter="always",
        data_dir=tmp_path / "data", worker_id=5,
        redis_url=REDIS_URL, redis_namespace=namespace,
        zmq_endpoint="tcp://127.0.0.1:*", zmq_replay_endpoint="tcp://127.0.0.1:*",
        token_ids=token_ids,
    )  # fmt: skip
    redis_or_skip()
    with BlockManager(settings) as mgr:
        publisher = mgr.zmq_publisher
        assert publisher is not None
        live = ZmqSubscriber(publisher.endpoint)
        time.sleep(0.3)  # the subscription reaches the publisher
        for prompt in range(6):
            seq = mgr.sequence(tokens_of(prompt))
            held = mgr.onboard(seq)
            held += mgr.register(mgr.allocate(len(seq) - len(held)), seq, start=len(held))
            mgr.release(held)
        mgr.wait_idle(10)
        assert publisher.wait_sent()
        assert mgr.publisher is not None and mgr.publisher.wait_applied(10)
        last = mgr.next_event_id - 1
        live_batches = []
        for seq_no, batch in live.batches(timeout=2):
            live_batches.append(batch)
            if seq_no == last:
                break
        live.close()
        replayed = ZmqSubscriber(publisher.endpoint, replay_endpoint=publisher.replay_endpoint)
        replay_batches = [batch for _, batch in replayed.replay(0)]
        replayed.close()
        log_url = mgr.settings.log_url
    db = sa.create_engine(log_url)
    with db.connect() as conn:
        payloads = [bytes(row[0]) for row in conn.exec_driver_sql("SELECT payload FROM events")]
    db.dispose()
    with EventLog(log_url, read_only=True) as log:
        logged = list(log.read(worker_id=5))
    client = redis.Redis.from_url(REDIS_URL)
    stream = cast(
        list[tuple[bytes, dict[bytes, bytes]]],
        client.xrange(SharedRegistry(client, namespace).stream_keys[0]),
    )
    records = [
        r for _, fields in stream if b"e" in fields for r in unpack_stream_entry(fields[b"e"])
    ]
    return {
        "live": live_batches,
        "replay": replay_batches,
        "payloads": payloads,
        "logged": logged,
        "records": records,
    }


def stored_tokens(batches: list[Any]) -> list[list[int]]:
    return [
        e["token_ids"] for _, events, _ in batches for e in events if e["type"] == "BlockStored"
    ]


def test_drop_keeps_token_ids_out_of_the_log_redis_and_every_zmq_message(
    tmp_path: Path, namespace: str
) -> None:
    seen = run_manager(tmp_path, namespace, "drop")
    assert stored_tokens(seen["live"]) and stored_tokens(seen["replay"])  # blocks did go out
    assert not any(stored_tokens(seen["live"])) and not any(stored_tokens(seen["replay"]))
    assert all(e.token_ids is None for e in seen["logged"] if isinstance(e, Stored))
    recorded = [decode_stream_record(r) for r in seen["records"]]
    assert all(e.token_ids is None for e in recorded if isinstance(e, Stored))
    assert len(seen["records"]) == len(seen["logged"])
    for needle in needles():
        assert not any(needle in p for p in seen["payloads"]), "a token id is in the log"
        assert not any(needle in r for r in seen["records"]), "a token id is in Redis"


def test_live_only_sends_token_ids_live_but_never_persists_or_replays_them(
    tmp_path: Path, namespace: str
) -> None:
    seen = run_manager(tmp_path, namespace, "live_only")
    live = stored_tokens(seen["live"])
    assert any(tokens == tokens_of(0)[: len(tokens)] for tokens in live if tokens)
    assert not any(stored_tokens(seen["replay"]))  # the ring and the log serve none
    assert all(e.token_ids is None for e in seen["logged"] if isinstance(e, Stored))
    for needle in needles():
        assert not any(needle in p for p in seen["payloads"])
        assert not any(needle in r for r in seen["records"])


def test_keep_the_default_carries_them_everywhere_for_routers_that_hash_tokens(
    tmp_path: Path, namespace: str
) -> None:
    assert Settings.load().token_ids == "keep"
    seen = run_manager(tmp_path, namespace, "keep")
    assert any(stored_tokens(seen["live"])) and any(stored_tokens(seen["replay"]))
    assert any(e.token_ids for e in seen["logged"] if isinstance(e, Stored))
    assert any(needle in p for needle in needles() for p in seen["payloads"])
    assert any(needle in r for needle in needles() for r in seen["records"])
