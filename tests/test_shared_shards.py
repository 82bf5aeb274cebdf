"""The shared registry split over several shards, on the single test Redis server."""

from __future__ import annotations

import random
import time
import uuid
from typing import cast

import pytest
from event_streams import prompt_pool, worker_events
from hypothesis import example, given, settings
from hypothesis import strategies as st
from services import redis_or_skip

from kvledger.events.shared.keys import KeySpace
from kvledger.events.shared.publish import RedisPublisher
from kvledger.events.shared.registry import SharedRegistry
from kvledger.events.shared.subscribe import StreamSubscriber, decode_stream_entry
from kvledger.events.types import AnyEvent
from kvledger.registry.index import holders_from_state
from kvledger.registry.state import RegistryState

pytestmark = pytest.mark.redis


def _fold(events: list[AnyEvent]) -> dict[int, dict[int, int]]:
    return holders_from_state(RegistryState.from_events(events))


@settings(max_examples=15, deadline=None)
@example(seed=838, shards=1, per_call=1)  # worker 3 sent its whole stream before the loss
@given(
    seed=st.integers(0, 10_000),
    shards=st.sampled_from([1, 2, 3, 6]),
    per_call=st.sampled_from([1, 5, 128]),
)
def test_sharded_index_equals_the_fold_with_replays_and_a_lost_shard(
    seed: int, shards: int, per_call: int
) -> None:
    """Three workers' streams in random overlapping batches; half way, one shard loses all its
    keys (a node that came back empty): the next applies report the gap, the worker re-sends
    from its log, and the index equals the fold with no event applied twice in any shard."""
    reg = SharedRegistry(
        redis_or_skip(), f"s-{uuid.uuid4().hex[:12]}", shards=shards, events_per_call=per_call
    )
    try:
        rng = random.Random(seed)
        prompts = prompt_pool(seed)
        streams = {w: worker_events(seed, w, 60, prompts) for w in (1, 2, 3)}
        cursors = dict.fromkeys(streams, 0)
        lost = False
        while any(cursors[w] < len(s) for w, s in streams.items()):
            w = rng.choice([w for w in streams if cursors[w] < len(streams[w])])
            if not lost and sum(cursors.values()) > 60:
                lost = True
                shard = reg.shard_keys[rng.randrange(shards)]
                reg.client.delete(*reg.client.scan_iter(match=shard.all_keys()))
            start = max(0, cursors[w] - rng.randrange(0, 4))
            end = min(len(streams[w]), cursors[w] + rng.randrange(1, 12))
            result = reg.apply(w, streams[w][start:end])
            if result.gap_at is not None:  # what the publisher does: read the log from there
                assert result.last_event_id < result.gap_at - 1
                result = reg.apply(w, streams[w][reg.applied_event_id(w) + 1 : end])
            assert result.gap_at is None and result.last_event_id == end - 1
            cursors[w] = end
        for w, s in streams.items():
            # what the publisher's heartbeat does: a worker that sent its last event before the
            # loss never hears of a gap, so it compares the applied id with what it sent
            applied = reg.applied_event_id(w)
            if applied < len(s) - 1:
                assert lost
                result = reg.apply(w, s[applied + 1 :])
                assert result.gap_at is None and result.last_event_id == len(s) - 1
        every = [e for s in streams.values() for e in s]
        assert reg.snapshot() == _fold(every)
        hashes = list(reg.snapshot())
        assert dict(zip(hashes, reg.who_has(hashes), strict=True)) == reg.snapshot()
        for w, s in streams.items():
            assert reg.applied_event_id(w) == len(s) - 1
            assert reg.applied_count(w) == len(s)
    finally:
        reg.delete_namespace()


def test_each_event_reaches_one_stream_once_in_order() -> None:
    reg = SharedRegistry(redis_or_skip(), f"s-{uuid.uuid4().hex[:12]}", shards=3)
    try:
        streams = {w: worker_events(5, w, 40, prompt_pool(5)) for w in (1, 2, 3, 4)}
        for w, events in streams.items():
            reg.apply(w, events[:25])
            reg.apply(w, events[20:])
        seen: dict[int, list[int]] = {}
        purged: list[int] = []
        sub = StreamSubscriber(
            reg,
            "routers",
            "r1",
            on_event=lambda e: seen.setdefault(e.worker_id, []).append(e.event_id),
            on_purge=purged.append,
            on_baseline=lambda b: pytest.fail(f"no reset here, got {b}"),
        )
        while sub.poll(block_ms=10):
            pass
        assert seen == {w: list(range(len(s))) for w, s in streams.items()}
        for shard, stream in enumerate(reg.stream_keys):  # each worker in its home shard only
            homes = {w for w in streams if reg.home_shard(w) == shard}
            entries = cast(list[tuple[bytes, dict[bytes, bytes]]], reg.client.xrange(stream))
            found = {e.worker_id for _, f in entries for e in decode_stream_entry(f[b"e"])}
            assert found == homes
        assert reg.release(2) > 0 and sub.poll() == 1 and purged == [2]  # one notice, not 3
        assert all(2 not in holders for holders in reg.snapshot().values())
    finally:
        reg.delete_namespace()


def test_a_lease_lost_in_one_shard_is_no_lapse() -> None:
    """A fail-over to a replica that missed the last heartbeat leaves the worker's lease gone
    from that shard only (deleted here, as the promoted replica has it): the worker is alive,
    so nothing is purged and routers get no purge notice; gone from every shard, it is."""
    reg = SharedRegistry(redis_or_skip(), f"s-{uuid.uuid4().hex[:12]}", shards=3)
    try:
        events = worker_events(9, 1, 40, prompt_pool(9))
        assert reg.heartbeat(1) and reg.apply(1, events).gap_at is None
        before = reg.snapshot()
        home = reg.home_shard(1)
        reg.client.delete(reg.shard_keys[home].lease(1))
        assert reg.purge_expired() == {}
        assert reg.snapshot() == before and reg.applied_event_id(1) == len(events) - 1
        stream = reg.stream_keys[home]
        entries = cast(list[tuple[bytes, dict[bytes, bytes]]], reg.client.xrange(stream))
        assert all(b"e" in fields for _, fields in entries)  # no purge notice
        reg.client.delete(*(k.lease(1) for k in reg.shard_keys))
        assert reg.purge_expired()[1] > 0
        assert reg.snapshot() == {} and reg.applied_event_id(1) == -1
    finally:
        reg.delete_namespace()


def test_the_shard_count_is_fixed_and_one_shard_is_the_unsharded_layout() -> None:
    client = redis_or_skip()
    namespace = f"s-{uuid.uuid4().hex[:12]}"
    events = worker_events(2, 1, 30, prompt_pool(2))
    reg = SharedRegistry(client, namespace)
    try:
        assert reg.shard_count == 1 and reg.shard_keys == [KeySpace(namespace)]
        reg.apply(1, events)
        written = {k.decode() for k in client.scan_iter(match=f"kvl:{{{namespace}*")}
        assert written <= {KeySpace(namespace).prefix + n for n in (
            "idx", "gens", "held", "applied", "count", "workers", "events", "events:size",
            "sweep", "tips", "fence", "shards", "lease:1")}  # fmt: skip
        client.delete(reg.keys.shard_count)  # as a namespace written before shards existed
        older = SharedRegistry(client, namespace)
        assert older.shard_count == 1 and older.snapshot() == _fold(events)
        client.delete(reg.keys.shard_count)
        with pytest.raises(ValueError, match="unsharded registry; it cannot be split over 3"):
            SharedRegistry(client, namespace, shards=3)
        assert SharedRegistry(client, namespace, shards=1).shard_count == 1  # and recorded
        with pytest.raises(ValueError, match="split over 1 shards, not 4"):
            SharedRegistry(client, namespace, shards=4)
    finally:
        reg.delete_namespace()
    reg = SharedRegistry(client, namespace, shards=4)
    try:
        assert SharedRegistry(client, namespace).shard_count == 4
        with pytest.raises(ValueError, match="split over 4 shards, not 2"):
            SharedRegistry(client, namespace, shards=2)
    finally:
        reg.delete_namespace()
    for bad in (0, 5000):
        with pytest.raises(ValueError, match=r"shards must be 1\.\.1024"):
            SharedRegistry(client, namespace, shards=bad)


def test_shard_tags_spread_over_the_slots() -> None:
    """Shards of a namespace sit on evenly spaced slots, so the usual even split of slots over
    the masters of a cluster puts the same number of shards on each."""
    from redis.crc import key_slot

    for namespace in ("prod", "kvledger", "a"):
        for count in (3, 6):
            spaces = KeySpace(namespace).shards(count)
            assert len({k.prefix for k in spaces}) == count
            slots = [key_slot(k.index.encode()) for k in spaces]
            assert len({k.index for k in spaces}) == count
            masters = [slot * 3 // 16384 for slot in slots]  # three equal runs of slots
            assert sorted(masters.count(m) for m in range(3)) == [count // 3] * 3


def test_a_lingering_publisher_sends_fuller_batches() -> None:
    """With ``linger_s`` a few events wait for each other (nothing reaches Redis before the
    linger ends) and then go out together; without it each goes at once."""
    reg = SharedRegistry(redis_or_skip(), f"s-{uuid.uuid4().hex[:12]}", shards=3)
    events = worker_events(3, 1, 30, prompt_pool(3))
    publisher = RedisPublisher(reg, 1, log=None, linger_s=1.0).start()
    try:
        for event in events[:5]:
            publisher(event)
        time.sleep(0.3)
        assert reg.applied_event_id(1) == -1  # still filling
        assert publisher.wait_applied(timeout=5) and reg.applied_event_id(1) == 4
        for event in events[5:]:  # stop() drains what is still lingering
            publisher(event)
    finally:
        publisher.stop()
    assert reg.applied_event_id(1) == len(events) - 1 and publisher.error is None
    assert reg.snapshot() == _fold(events)
    reg.delete_namespace()
    for bad in (-0.1, 60.0):
        with pytest.raises(ValueError, match="linger_s must be 0 or more and under 60"):
            RedisPublisher(reg, 1, log=None, linger_s=bad)
