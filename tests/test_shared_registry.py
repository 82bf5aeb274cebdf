"""The Redis shared registry, publisher and stream subscriber against a real Redis server."""

from __future__ import annotations

import random
import shutil
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import cast

import msgpack
import pytest
import redis
from event_streams import prompt_pool, worker_events
from hypothesis import given, settings
from hypothesis import strategies as st
from redis.backoff import NoBackoff
from redis.retry import Retry
from services import REDIS_URL, free_port, redis_or_skip, start_redis
from stream_router import stream_router

from kvledger.events import codec
from kvledger.events.log import EventLog
from kvledger.events.shared.publish import RedisPublisher
from kvledger.events.shared.registry import SharedRegistry
from kvledger.events.shared.subscribe import StreamSubscriber, decode_stream_entry
from kvledger.events.types import AnyEvent, BlockInfo, Cleared, Lookup, Tier
from kvledger.registry.emitter import EventEmitter
from kvledger.registry.hashing import TokenBlockSequence
from kvledger.registry.index import RouterIndex, holders_from_state
from kvledger.registry.state import RegistryState

pytestmark = pytest.mark.redis


@pytest.fixture
def registry() -> Iterator[SharedRegistry]:
    reg = SharedRegistry(redis_or_skip(), f"t-{uuid.uuid4().hex[:12]}", lease_ttl_s=5)
    yield reg
    reg.delete_namespace()


def _stream_ids(reg: SharedRegistry) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    entries = cast(list[tuple[bytes, dict[bytes, bytes]]], reg.client.xrange(reg.stream_key))
    for _id, fields in entries:
        for event in decode_stream_entry(fields[b"e"]) if b"e" in fields else ():
            out.setdefault(event.worker_id, []).append(event.event_id)
    return out


def test_apply_is_idempotent_and_stops_at_gaps(registry: SharedRegistry) -> None:
    events = worker_events(3, 4, 40, prompt_pool(3))
    first = registry.apply(4, events[:10])
    assert (first.applied, first.repeated, first.last_event_id, first.gap_at) == (10, 0, 9, None)
    before = registry.snapshot()
    again = registry.apply(4, events[:10])
    assert (again.applied, again.repeated) == (0, 10)
    assert registry.snapshot() == before
    gap = registry.apply(4, events[5:8] + events[12:20])  # 10 and 11 are missing
    assert (gap.applied, gap.repeated, gap.last_event_id, gap.gap_at) == (0, 3, 9, 12)
    assert registry.snapshot() == before  # nothing past the gap was applied
    registry.apply(4, events[10:])
    assert registry.snapshot() == holders_from_state(RegistryState.from_events(events))
    assert registry.applied_count(4) == len(events)
    assert _stream_ids(registry) == {4: list(range(len(events)))}
    with pytest.raises(ValueError, match="is from worker 4, not 5"):
        registry.apply(5, events[:1])
    with pytest.raises(ValueError, match="is from worker 4, not 5"):
        registry.apply_records(5, [codec.encode(events[0])])
    assert registry.applied_event_id(5) == -1


@settings(max_examples=15, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    ops=st.integers(1, 60),
    workers=st.integers(1, 3),
    per_call=st.sampled_from([1, 2, 5, 128]),
)
def test_any_batching_with_replays_equals_the_fold(
    seed: int, ops: int, workers: int, per_call: int
) -> None:
    """Streams cut into random batches, some sent twice, interleaved across workers, each
    batch sent as script calls of ``per_call`` events: the shared index equals the fold of the
    streams and no event is applied twice."""
    reg = SharedRegistry(redis_or_skip(), f"h-{uuid.uuid4().hex[:12]}", events_per_call=per_call)
    try:
        rng = random.Random(seed)
        prompts = prompt_pool(seed)
        streams = {w: worker_events(seed, w, ops, prompts) for w in range(workers)}
        cursors = dict.fromkeys(streams, 0)
        while any(cursors[w] < len(s) for w, s in streams.items()):
            w = rng.choice([w for w in streams if cursors[w] < len(streams[w])])
            start = max(0, cursors[w] - rng.randrange(0, 4))  # overlap: some repeats
            end = min(len(streams[w]), cursors[w] + rng.randrange(1, 12))
            result = reg.apply(w, streams[w][start:end])
            assert result.gap_at is None and result.last_event_id == end - 1
            cursors[w] = end
        every = [e for s in streams.values() for e in s]
        assert reg.snapshot() == holders_from_state(RegistryState.from_events(every))
        for w, s in streams.items():
            assert reg.applied_count(w) == len(s)
        assert _stream_ids(reg) == {w: list(range(len(s))) for w, s in streams.items()}
    finally:
        reg.delete_namespace()


def test_a_batch_split_into_calls_is_refused_from_its_gap_on() -> None:
    """With several script calls per batch, a repeated head that ends inside a call and a gap
    in a later call behave as one call would: the repeats are skipped, nothing at or after
    the gap is applied, and the events before it are applied once."""
    reg = SharedRegistry(redis_or_skip(), f"g-{uuid.uuid4().hex[:12]}", events_per_call=3)
    try:
        events = worker_events(8, 1, 30, prompt_pool(8))
        assert reg.apply(1, events[:5]).last_event_id == 4
        result = reg.apply(1, events[3:12])  # the first call, 3-5, repeats 3 and 4
        assert (result.applied, result.repeated, result.last_event_id) == (7, 2, 11)
        result = reg.apply(1, events[9:14] + events[16:25])  # a gap after 13
        assert (result.applied, result.repeated, result.gap_at) == (2, 3, 16)
        assert result.last_event_id == 13 and reg.applied_event_id(1) == 13
        assert reg.snapshot() == holders_from_state(RegistryState.from_events(events[:14]))
        assert _stream_ids(reg) == {1: list(range(14))}
        result = reg.apply(1, events[20:])  # starts past the gap: refused in every call
        assert (result.applied, result.gap_at, reg.applied_count(1)) == (0, 20, 14)
        reg.apply(1, events[14:])
        assert reg.snapshot() == holders_from_state(RegistryState.from_events(events))
        assert _stream_ids(reg) == {1: list(range(len(events)))}
    finally:
        reg.delete_namespace()


def test_blocks_stored_and_cleared_in_one_batch_leave_nothing_stale() -> None:
    """A batch that stores blocks and then clears their tier writes none of them, and asks
    for no sweep; a Cleared that leaves older entries behind does."""
    reg = SharedRegistry(redis_or_skip(), f"n-{uuid.uuid4().hex[:12]}", sweep_slice=0)
    try:
        events: list[AnyEvent] = []
        emit = EventEmitter(events.append, worker_id=1)
        seq = TokenBlockSequence(list(range(64)), 4)
        _stored(emit, Tier.G1, seq)
        emit.cleared(Tier.G1)
        _stored(emit, Tier.G2, seq)
        assert reg.apply(1, events).applied == 3
        assert reg.who_has(seq.sequence_hashes) == [{1: 2}] * 16
        assert reg.client.exists(reg.prefix + "sweep") == 0
        assert reg.held_count(1, Tier.G1) == 0 and reg.held_count(1, Tier.G2) == 16
        emit.cleared(Tier.G2)  # the G2 entries were stored by an earlier batch
        reg.apply(1, events[-1:])
        assert reg.client.exists(reg.prefix + "sweep") == 1
        assert reg.who_has(seq.sequence_hashes) == [{}] * 16 and reg.snapshot() == {}
        assert reg.held_count(1, Tier.G2) == 0
    finally:
        reg.delete_namespace()


def test_who_has_and_prefix_depths(registry: SharedRegistry) -> None:
    prompts = prompt_pool(11)
    every = []
    for w in range(3):
        events = worker_events(11, w, 50, prompts)
        registry.apply(w, events)
        every += events
    index = RouterIndex.from_events(every)
    holders = index.holders()
    for tokens in prompts:
        seqs = TokenBlockSequence(tokens, 4).sequence_hashes
        assert registry.who_has(seqs) == [holders.get(s, {}) for s in seqs]
        expected = {
            worker: per_tier
            for (worker, _dp), per_tier in index.find_matches(seqs, kind="sequence").items()
        }
        assert registry.prefix_depths(seqs) == expected
    assert registry.who_has([]) == []
    assert registry.who_has([1, 2], stop_at_miss=True) == []


def test_lease_expiry_purges_only_that_worker(registry: SharedRegistry) -> None:
    short = SharedRegistry(registry.client, registry.namespace, lease_ttl_s=0.2)
    prompts = prompt_pool(2)
    a, b = worker_events(2, 1, 40, prompts), worker_events(2, 2, 40, prompts)
    registry.apply(1, a)  # 5 s lease
    short.apply(2, b)  # 0.2 s lease
    assert registry.workers() == {1, 2}
    assert registry.purge_expired() == {}
    time.sleep(0.3)
    purged = registry.purge_expired()
    assert list(purged) == [2] and purged[2] > 0
    assert registry.snapshot() == holders_from_state(RegistryState.from_events(a))
    assert registry.workers() == {1} and registry.applied_event_id(2) == -1
    # the purged worker's next batch finds a gap at its start: it must re-send from its log
    assert short.apply(2, b[-1:]).gap_at == b[-1].event_id
    assert registry.release(1) > 0
    assert registry.snapshot() == {}


def test_bad_configuration_is_refused() -> None:
    client = redis_or_skip()
    with pytest.raises(ValueError, match="namespace"):
        SharedRegistry(client, "has space")
    with pytest.raises(ValueError, match="lease_ttl_s"):
        SharedRegistry(client, "ok", lease_ttl_s=0)
    with pytest.raises(ValueError, match="decode_responses=False"):
        SharedRegistry(redis.Redis.from_url(REDIS_URL, decode_responses=True), "ok")


def test_subscriber_feeds_a_router_index_and_acks(registry: SharedRegistry) -> None:
    prompts = prompt_pool(4)
    streams = {w: worker_events(4, w, 40, prompts) for w in (1, 2)}
    for w, events in streams.items():
        registry.apply(w, events)

    def crash(_what: object) -> None:
        raise RuntimeError("router crashed")

    crashing = StreamSubscriber(
        registry,
        "routers",
        "r1",
        on_event=crash,
        on_purge=crash,
        on_baseline=crash,
    )
    with pytest.raises(RuntimeError):
        crashing.poll()
    index, sub = stream_router(registry, consumer="r2")
    assert sub.claim_pending() > 0  # r1's unacknowledged entries
    while sub.poll(count=7):
        pass
    assert index.holders() == registry.snapshot()
    assert registry.client.xpending(registry.stream_key, "routers")["pending"] == 0
    registry.release(2)
    sub.poll()
    assert index.holders() == registry.snapshot()
    assert all(w == 1 for w, _dp in index.workers())


def test_subscriber_reads_entries_of_one_event_as_earlier_versions_wrote(
    registry: SharedRegistry,
) -> None:
    """A router upgraded before its workers still reads their stream: an entry whose ``r``
    field holds one record, beside the entries of whole apply calls (``e``)."""
    events = worker_events(3, 6, 30, prompt_pool(3))
    for event in events[:10]:
        registry.client.xadd(registry.stream_key, {"w": "6", "r": codec.encode(event)})
    registry.client.hset(registry.keys.applied, "6", "9")
    registry.client.hset(registry.keys.count, "6", "10")
    registry.apply(6, events[10:])
    index, sub = stream_router(registry)
    assert sub.poll() == 11  # ten entries of one event, then one of the other twenty
    assert index.holders() == holders_from_state(RegistryState.from_events(events))


def test_the_stream_keeps_about_stream_maxlen_events() -> None:
    """The bound is in events though an entry holds a call's events: ~11,000 events in calls
    of eight keep 4,000 of them, give or take what Redis trims at once (a node of 100
    entries)."""
    reg = SharedRegistry(
        redis_or_skip(), f"t-{uuid.uuid4().hex[:12]}", stream_maxlen=4000, events_per_call=8
    )
    try:
        events = worker_events(4, 2, 12_000, prompt_pool(4))
        for i in range(0, len(events), 1000):
            reg.apply(2, events[i : i + 1000])
        end = events[-1].event_id + 1
        kept = len(_stream_ids(reg)[2])
        assert end > 8000 and 4000 <= kept <= 4000 + 100 * 8, (end, kept)
        assert _stream_ids(reg)[2] == list(range(end - kept, end))  # the newest
    finally:
        reg.delete_namespace()


def test_a_malformed_stream_entry_is_an_error_that_names_it() -> None:
    for entry, match in (
        (b"\xc1", "one msgpack array of records"),
        (msgpack.packb({"a": 1}), "an array of records"),
        (msgpack.packb([b"x", 3]), "an array of records"),
    ):
        with pytest.raises(codec.CodecError, match=match):
            decode_stream_entry(entry)
    with pytest.raises(codec.CodecError):  # an array of records, one of them damaged
        decode_stream_entry(msgpack.packb([b"\xc1"]))


def test_publisher_catches_up_from_the_log(registry: SharedRegistry, tmp_path: Path) -> None:
    """A queue too small for a burst drops events; the publisher reads them back from the log."""
    log = EventLog(str(tmp_path / "w.db"))
    publisher = RedisPublisher(registry, 6, log=log, batch_size=8, max_pending=16).start()
    replay = worker_events(6, 6, 300, prompt_pool(6))
    log.append_many(replay)  # one commit, far more than the publisher's queue holds
    log.flush()
    assert publisher.dropped > 0
    assert publisher.stop(drain_timeout=20)
    assert publisher.caught_up >= publisher.dropped and publisher.error is None
    assert registry.snapshot() == holders_from_state(RegistryState.from_events(replay))
    assert registry.applied_count(6) == len(replay)
    log.close()


@pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs the redis-server binary")
def test_publisher_survives_a_redis_restart(tmp_path: Path) -> None:
    """A private Redis is killed mid-run and started again empty: publishing never blocks the
    engine, and afterwards the registry is whole again, with no event applied twice."""
    port = free_port()
    server = start_redis(port, tmp_path)
    try:
        reg = SharedRegistry(
            redis.Redis(
                port=port,
                socket_timeout=0.5,
                socket_connect_timeout=0.5,
                retry=Retry(NoBackoff(), 0),  # let the publisher see the outage itself
            ),
            "restart",
            lease_ttl_s=2,
        )
        log = EventLog(str(tmp_path / "w.db"))
        publisher = RedisPublisher(reg, 9, log=log, batch_size=16, retry_s=0.05).start()
        sink = log.append
        stream = worker_events(9, 9, 400, prompt_pool(9))
        for event in stream[:150]:
            sink(event)
        log.flush()  # the publisher takes what the log committed
        assert publisher.wait_applied(10)
        server.kill()
        server.wait()
        for event in stream[150:300]:  # Redis is gone: the engine carries on
            sink(event)
        time.sleep(0.5)  # long enough for the publisher to notice (redis-py retries first)
        server = start_redis(port, tmp_path)
        for event in stream[300:]:
            sink(event)
        log.flush()
        assert publisher.wait_applied(20), (publisher.applied_id, publisher.error)
        publisher.stop()
        assert publisher.outages > 0 and publisher.caught_up >= 150  # re-sent what Redis lost
        expected = holders_from_state(RegistryState.from_events(stream))
        assert reg.snapshot() == expected
        some = sorted(expected)[:8]  # the new server has no scripts loaded until asked
        assert reg.who_has(some) == [expected[h] for h in some]
        assert reg.applied_count(9) == len(stream)  # the new server applied each event once
        assert _stream_ids(reg) == {9: list(range(len(stream)))}
        log.close()
    finally:
        server.kill()
        server.wait()


def _held(holders: dict[int, dict[int, int]], worker: int, tier: Tier) -> set[int]:
    bit = 1 << (int(tier) - 1)
    return {h for h, masks in holders.items() if masks.get(worker, 0) & bit}


def _held_per_tier(events: list[AnyEvent], worker: int) -> dict[Tier, int]:
    state = RegistryState.from_events(events)
    return {t: len(state.snapshot().get((worker, t), {})) for t in Tier}


@pytest.mark.parametrize("per_call", [2, 128])
def test_long_churn_keeps_counts_exact_and_stale_entries_bounded(per_call: int) -> None:
    """A long stream with churn on every tier (Cleared included), applied in small batches:
    after every batch the index and the per-tier counts equal the fold, and the sweep that runs
    with the applies keeps the stored entries (stale ones included) from piling up."""
    reg = SharedRegistry(
        redis_or_skip(), f"c-{uuid.uuid4().hex[:12]}", sweep_slice=64, events_per_call=per_call
    )
    try:
        events = worker_events(21, 1, 600, prompt_pool(21))
        assert any(isinstance(e, Cleared) for e in events)
        batch = 5
        ever: set[int] = set()
        for start in range(0, len(events), batch):
            assert reg.apply(1, events[start : start + batch]).gap_at is None
            done = events[: start + batch]
            live = reg.snapshot()
            expected = holders_from_state(RegistryState.from_events(done))
            assert live == expected
            ever.update(expected)
            assert reg.who_has(sorted(ever)) == [expected.get(h, {}) for h in sorted(ever)]
            assert {t: reg.held_count(1, t) for t in Tier} == _held_per_tier(done, 1)
        while reg.sweep():
            pass
        assert reg.client.hlen(reg.index_key) == len(reg.snapshot())  # nothing stale is left
        # a purge drops every (block, tier) entry of the worker, and says how many
        entries = sum(_held_per_tier(events, 1).values())
        assert entries > 0 and reg.release(1) == entries
        assert reg.snapshot() == {} and reg.who_has(list(live)) == [{}] * len(live)
        assert {t: reg.held_count(1, t) for t in Tier} == dict.fromkeys(Tier, 0)
        while reg.sweep():
            pass
        assert reg.client.hlen(reg.index_key) == 0
    finally:
        reg.delete_namespace()


def _stored(emit: EventEmitter, tier: Tier, seq: TokenBlockSequence) -> None:
    emit.stored(tier, None, list(zip(seq.sequence_hashes, seq.local_hashes, strict=True)))


def test_cleared_then_stored_again_counts_only_the_new_blocks() -> None:
    """Entries written before a Cleared stay stored (stale) until swept, but no reader sees
    them; storing some of the blocks again makes exactly those live, on that tier only."""
    reg = SharedRegistry(redis_or_skip(), f"s-{uuid.uuid4().hex[:12]}", sweep_slice=0)
    try:
        events: list[AnyEvent] = []
        emit = EventEmitter(events.append, worker_id=1)
        seq = TokenBlockSequence(list(range(64)), 4)
        _stored(emit, Tier.G1, seq)
        _stored(emit, Tier.G2, seq)
        emit.cleared(Tier.G1)
        reg.apply(1, events)
        seqs = seq.sequence_hashes
        assert reg.who_has(seqs) == [{1: 2}] * 16  # G2 only: the G1 bits are stale
        again = TokenBlockSequence(list(range(32)), 4)  # the first 8 blocks
        _stored(emit, Tier.G1, again)
        emit.removed(Tier.G2, seqs[:2])
        assert reg.apply(1, events[3:]).applied == 2
        assert reg.who_has(seqs) == [{1: 1}] * 2 + [{1: 3}] * 6 + [{1: 2}] * 8
        assert reg.snapshot() == holders_from_state(RegistryState.from_events(events))
        assert reg.held_count(1, Tier.G1) == 8 and reg.held_count(1, Tier.G2) == 14
        assert reg.prefix_depths(seqs) == {1: {Tier.G1: 8}}
    finally:
        reg.delete_namespace()


def test_a_purged_worker_that_comes_back_sees_none_of_its_old_entries() -> None:
    """After a purge the worker's old entries are stale, not gone: when it comes back and
    re-sends a new stream from event 0, only what that stream holds is live, old blocks it
    does not store again stay invisible, and the other worker is untouched."""
    reg = SharedRegistry(redis_or_skip(), f"p-{uuid.uuid4().hex[:12]}", sweep_slice=0)
    try:
        prompts = prompt_pool(31)
        old, other = worker_events(31, 1, 80, prompts), worker_events(31, 2, 80, prompts)
        reg.apply(1, old)
        reg.apply(2, other)
        assert reg.purge_expired() == {}
        reg.client.delete(reg.prefix + "lease:1")  # the lease lapses
        assert list(reg.purge_expired()) == [1]
        assert reg.snapshot() == holders_from_state(RegistryState.from_events(other))
        stored_keys = reg.client.hlen(reg.index_key)
        assert stored_keys > len(reg.snapshot())  # the old entries are still stored, stale
        back = worker_events(32, 1, 40, prompts)  # a new life of worker 1, ids from 0
        assert reg.apply(1, back).applied == len(back)
        expected = holders_from_state(RegistryState.from_events(back + other))
        assert reg.snapshot() == expected
        old_only = set(holders_from_state(RegistryState.from_events(old))) - set(expected)
        assert old_only and all(h == {} for h in reg.who_has(sorted(old_only)))
        assert {t: reg.held_count(1, t) for t in Tier} == _held_per_tier(back, 1)
    finally:
        reg.delete_namespace()


def test_sweep_removes_stale_entries_and_stops() -> None:
    """Stale entries are removed by the sweep a slice at a time; a pass ends on its own, and
    a Cleared or purge during a pass asks for another one."""
    reg = SharedRegistry(redis_or_skip(), f"w-{uuid.uuid4().hex[:12]}", sweep_slice=0)
    try:
        assert reg.sweep() is False  # nothing to do
        events: list[AnyEvent] = []
        emit = EventEmitter(events.append, worker_id=1)
        others: list[AnyEvent] = []
        emit2 = EventEmitter(others.append, worker_id=2)
        seqs = [TokenBlockSequence(list(range(k, k + 64)), 4) for k in range(0, 6400, 100)]
        for seq in seqs:
            _stored(emit, Tier.G1, seq)
            _stored(emit2, Tier.G2, seq)
        reg.apply(1, events)
        reg.apply(2, others)
        blocks = 16 * len(seqs)
        assert reg.client.hlen(reg.index_key) == blocks
        emit.cleared(Tier.G1)
        reg.apply(1, events[-1:])
        assert reg.sweep(64) is True  # one slice of a long pass
        emit2.cleared(Tier.G2)
        reg.apply(2, others[-1:])  # mid-pass: another pass must follow
        while reg.sweep(64):
            pass
        # the blocks the first slice had passed lost worker 2's entries too: a second pass ran
        assert reg.client.hlen(reg.index_key) == 0 and reg.snapshot() == {}
        assert reg.sweep() is False
        # with the default slice, applies sweep on their own
        auto = SharedRegistry(reg.client, reg.namespace, sweep_slice=1000)
        _stored(emit, Tier.G1, seqs[0])
        emit.cleared(Tier.G1)
        auto.apply(1, events[-2:])
        for _ in range(blocks // 1000 + 2):
            auto.apply(1, [])
        assert reg.client.hlen(reg.index_key) == 0
    finally:
        reg.delete_namespace()


def test_cleared_after_many_batches_clears_one_tier_of_one_worker() -> None:
    """Cleared reaches blocks gained many batches earlier, and blocks gained earlier in the
    same batch, on its own tier only and for its own worker only."""
    reg = SharedRegistry(redis_or_skip(), f"k-{uuid.uuid4().hex[:12]}", sweep_slice=16)
    try:
        streams: dict[int, list[AnyEvent]] = {w: [] for w in (1, 2)}
        emitters = {w: EventEmitter(streams[w].append, worker_id=w) for w in (1, 2)}
        seqs = [TokenBlockSequence(list(range(k, k + 32)), 4) for k in range(0, 4000, 40)]
        for k, seq in enumerate(seqs):
            blocks = list(zip(seq.sequence_hashes, seq.local_hashes, strict=True))
            for emit in emitters.values():
                emit.stored(Tier.G1, None, blocks)
                if k % 3 == 0:
                    infos = [BlockInfo(s, lh, None) for s, lh in blocks[:2]]
                    emit.copied(Tier.G1, Tier.G2, infos)
                if k % 2 == 1:
                    emit.removed(Tier.G1, seq.sequence_hashes[4:])
        for w, events in streams.items():
            for start in range(0, len(events), 9):
                reg.apply(w, events[start : start + 9])
        late = TokenBlockSequence(list(range(90_000, 90_016)), 4)
        emitters[1].stored(
            Tier.G1, None, list(zip(late.sequence_hashes, late.local_hashes, strict=True))
        )
        emitters[1].cleared(Tier.G1)
        result = reg.apply(1, streams[1][-2:])  # Stored then Cleared in one batch
        assert result.applied == 2
        every = streams[1] + streams[2]
        expected = holders_from_state(RegistryState.from_events(every))
        assert reg.snapshot() == expected
        assert _held(expected, 1, Tier.G1) == set()
        assert _held(expected, 1, Tier.G2) and _held(expected, 2, Tier.G1)
        assert reg.held_count(1, Tier.G1) == 0
        assert reg.held_count(1, Tier.G2) == len(_held(expected, 1, Tier.G2))
    finally:
        reg.delete_namespace()


def test_malformed_records_are_refused_before_anything_is_written(
    registry: SharedRegistry,
) -> None:
    events = worker_events(5, 3, 10, prompt_pool(5))
    good = codec.encode(events[0])
    flipped = bytearray(codec.encode(events[1]))
    flipped[12] ^= 0x10  # the event after ``good``: refused although ``good`` itself is fine
    lookup = codec.encode(
        Lookup(
            event_id=1, worker_id=3, dp_rank=0, tier=Tier.G1, ts=0.0, request_id=1,
            num_tokens=0, start=0, sequence_hashes=(1,), hits=(0, 0, 0),
        )
    )  # fmt: skip
    cases = [
        (bytes(flipped), codec.CodecError, "checksum"),
        (codec.encode(events[1])[:-7], codec.CodecError, ""),
        (lookup, ValueError, "not a transition"),
    ]
    for bad, error, message in cases:
        with pytest.raises(error, match=message or None):
            registry.apply_records(3, [good, bad])
        assert registry.applied_event_id(3) == -1
        assert registry.snapshot() == {}
        assert registry.client.xlen(registry.stream_key) == 0
    with pytest.raises(ValueError, match="sweep_slice"):
        SharedRegistry(registry.client, "ok", sweep_slice=-1)
    with pytest.raises(ValueError, match="events_per_call"):
        SharedRegistry(registry.client, "ok", events_per_call=0)
    with pytest.raises(ValueError, match="slice_blocks"):
        registry.sweep(0)
