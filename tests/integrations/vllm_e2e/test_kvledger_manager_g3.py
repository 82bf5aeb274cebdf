"""kvledger's vLLM offloading manager with a G3 below G2, driven through vLLM's own
``OffloadingManager`` interface (runs in the vLLM test venv, from vLLM's test tree).

What is checked: a G2 eviction demotes the block to G3 with the store that evicted it
(HIT_PENDING until that store completes, then HIT, served from disk); a load of a G3 block
promotes it into G2 after demoting what that displaced; the offload filter decides what goes
down; a failed store takes its demotions with it; vLLM hears of G3 as ``Medium.STORAGE``; and
the event log of every run replays to the manager's live state on both tiers.
"""

from __future__ import annotations

import gc
import weakref
from pathlib import Path

import pytest
from vllm.v1.kv_offload.base import (
    LookupResult,
    Medium,
    OffloadingEvent,
    OffloadKey,
    ReqContext,
    make_offload_key,
)
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvledger import replay
from kvledger.events.log import EventLog
from kvledger.events.types import Cleared, Offloaded, Onboarded, Tier
from kvledger.integrations.vllm.manager import KvledgerOffloadingManager, key_hash
from kvledger.integrations.vllm.specs import KvledgerLoadSpec, KvledgerStoreSpec

BLOCK = 16


def key(i: int) -> OffloadKey:
    return make_offload_key(i.to_bytes(8, "big"), 0)


def request(name: str, keys: list[OffloadKey]) -> ReqContext:
    ctx = ReqContext(req_id=name)
    for position, k in enumerate(keys):
        ctx.set_offload_key_position(k, (position + 1) * BLOCK)
    return ctx


def store(manager: KvledgerOffloadingManager, ctx: ReqContext, keys: list[OffloadKey]) -> None:
    out = manager.prepare_store(keys, ctx)
    assert out is not None
    manager.complete_store(out.keys_to_store, ctx)


def events(manager: KvledgerOffloadingManager) -> list[tuple[Medium, bool, list[OffloadKey]]]:
    taken: list[OffloadingEvent] = list(manager.take_events())
    return [(e.medium, e.removed, list(e.keys)) for e in taken]


def replays(manager: KvledgerOffloadingManager, log_url: str) -> None:
    manager.flush_log()
    assert replay(log_url) == manager.state()


@pytest.fixture
def log_url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'manager.db'}"


def make(log_url: str, *, g2: int = 2, g3: int = 3, offload_filter: str = "always"):
    return KvledgerOffloadingManager(
        g2, enable_events=True, log_url=log_url, g3_blocks=g3, offload_filter=offload_filter
    )


def test_g2_eviction_demotes_to_g3_and_a_load_promotes_back(log_url: str) -> None:
    m = make(log_url)
    k1, k2, k3 = key(1), key(2), key(3)
    a = request("a", [k1, k2])
    store(m, a, [k1, k2])
    m.on_request_finished(a)  # tail before head: k2 ranks below k1
    g2_of_k2 = m.pool.lookup(key_hash(k2))
    assert events(m) == [(Medium.CPU, False, [k1, k2])]

    b = request("b", [k3])
    out = m.prepare_store([k3], b)
    assert out is not None and out.evicted_keys == [k2]
    spec = out.store_spec
    assert isinstance(spec, KvledgerStoreSpec)
    assert list(spec.block_ids) == [g2_of_k2], "k3 takes k2's G2 slot"
    ((src, g3_slot),) = spec.moves.demotions
    assert src == g2_of_k2, "k2's bytes are copied to G3 before k3 overwrites its G2 slot"
    assert spec.moves.names[0].sequence_hash == key_hash(k2)
    assert m.lookup(k2, b) is LookupResult.HIT_PENDING, "on its way to G3"
    assert m.lookup(k3, b) is LookupResult.HIT_PENDING
    m.complete_store([k3], b)
    m.on_request_finished(b)
    assert m.lookup(k2, b) is LookupResult.HIT
    assert m.get_load_source(k2, b) is CacheHitSource.DISK
    assert m.get_load_source(k1, b) is CacheHitSource.HOST
    assert events(m) == [
        (Medium.CPU, True, [k2]),
        (Medium.STORAGE, False, [k2]),
        (Medium.CPU, False, [k3]),
    ]
    replays(m, log_url)

    # A load of k1 (G2) and k2 (G3 only): k2 is promoted into the G2 slot that evicting k3
    # frees, and k3 goes down to G3 first.
    c = request("c", [k1, k2])
    assert [m.lookup(k, c) for k in (k1, k2)] == [LookupResult.HIT] * 2
    g2_of_k1, g2_of_k3 = m.pool.lookup(key_hash(k1)), m.pool.lookup(key_hash(k3))
    load = m.prepare_load([k1, k2], c)
    assert isinstance(load, KvledgerLoadSpec)
    assert list(load.block_ids) == [g2_of_k1, g2_of_k3]
    assert load.g3_slots[1] == g3_slot
    ((demoted_from, k3_g3),) = load.moves.demotions
    assert demoted_from == g2_of_k3 and k3_g3 != g3_slot
    assert load.moves.promotions == [(g3_slot, g2_of_k3)]
    assert m.lookup(k3, c) is LookupResult.HIT_PENDING
    assert m.lookup(k2, c) is LookupResult.HIT, "still readable from G3 while promoted"
    m.complete_load([k1, k2], c)
    assert m.get_load_source(k2, c) is CacheHitSource.HOST, "k2 is back in G2"
    assert m.get_load_source(k3, c) is CacheHitSource.DISK
    assert m.pool.refcount(g2_of_k1) == 0 and m.pool.refcount(g2_of_k3) == 0
    assert events(m) == [
        (Medium.CPU, True, [k3]),
        (Medium.STORAGE, False, [k3]),
        (Medium.CPU, False, [k2]),
    ]
    replays(m, log_url)
    state = m.state().snapshot()
    assert set(state[(0, Tier.G2)]) == {key_hash(k1), key_hash(k2)}
    assert set(state[(0, Tier.G3)]) == {key_hash(k2), key_hash(k3)}

    log = EventLog(log_url)
    kinds = [(type(e).__name__, e.tier) for e in log.read() if isinstance(e, Offloaded | Onboarded)]
    log.close()
    assert kinds == [
        ("Offloaded", Tier.G3),  # k2 demoted
        ("Offloaded", Tier.G3),  # k3 demoted
        ("Onboarded", Tier.G2),  # k2 promoted
    ]
    m.shutdown()


def test_g3_evicts_its_oldest_and_says_so(log_url: str) -> None:
    m = make(log_url, g2=1, g3=2)
    keys = [key(i) for i in range(5)]
    for i, k in enumerate(keys):
        ctx = request(f"r{i}", [k])
        store(m, ctx, [k])
        m.on_request_finished(ctx)
    # G2 holds the newest; G3 the two before it; the first two fell off G3
    probe = request("probe", keys)
    assert [m.lookup(k, probe) for k in keys] == [
        LookupResult.MISS,
        LookupResult.MISS,
        LookupResult.HIT,
        LookupResult.HIT,
        LookupResult.HIT,
    ]
    storage_removed = [e for e in events(m) if e[0] is Medium.STORAGE and e[1]]
    assert storage_removed == [(Medium.STORAGE, True, [keys[0]]), (Medium.STORAGE, True, [keys[1]])]
    replays(m, log_url)
    m.shutdown()


def test_seen_twice_demotes_only_blocks_two_requests_asked_for(log_url: str) -> None:
    m = make(log_url, g2=2, offload_filter="seen_twice")
    once, twice = key(1), key(2)
    first = request("first", [once, twice])
    store(m, first, [once, twice])
    m.on_request_finished(first)
    second = request("second", [twice])
    assert m.lookup(twice, second) is LookupResult.HIT  # a second request asks for it
    m.on_request_finished(second)
    third = request("third", [key(3), key(4)])
    out = m.prepare_store([key(3), key(4)], third)
    assert out is not None and set(out.evicted_keys) == {once, twice}
    assert isinstance(out.store_spec, KvledgerStoreSpec)
    assert [n.sequence_hash for n in out.store_spec.moves.names] == [key_hash(twice)]
    m.complete_store(out.keys_to_store, third)
    assert m.lookup(twice, third) is LookupResult.HIT
    assert m.lookup(once, third) is LookupResult.MISS
    replays(m, log_url)
    m.shutdown()


def test_never_keeps_g3_empty_and_specs_plain(log_url: str) -> None:
    m = make(log_url, g2=1, offload_filter="never")
    for i in range(3):
        ctx = request(f"r{i}", [key(i)])
        out = m.prepare_store([key(i)], ctx)
        assert out is not None and type(out.store_spec) is CPULoadStoreSpec
        m.complete_store(out.keys_to_store, ctx)
    assert m.g3 is not None and m.g3.num_registered == 0
    replays(m, log_url)
    m.shutdown()


def test_failed_store_drops_its_demotions(log_url: str) -> None:
    m = make(log_url, g2=1)
    a, b = request("a", [key(1)]), request("b", [key(2)])
    store(m, a, [key(1)])
    out = m.prepare_store([key(2)], b)
    assert out is not None and isinstance(out.store_spec, KvledgerStoreSpec)
    assert m.lookup(key(1), b) is LookupResult.HIT_PENDING
    m.complete_store([key(2)], b, success=False)
    assert m.lookup(key(1), b) is LookupResult.MISS
    assert m.lookup(key(2), b) is LookupResult.MISS
    assert m.g3 is not None and m.g3.num_free == m.g3.capacity
    replays(m, log_url)
    m.shutdown()


def test_reset_cache_clears_g3_too(log_url: str) -> None:
    m = make(log_url, g2=1)
    for i in range(3):
        store(m, request(f"r{i}", [key(i)]), [key(i)])
    assert m.g3 is not None and m.g3.num_registered == 2
    m.reset_cache()
    assert m.g3.num_registered == 0
    assert m.lookup(key(1), request("x", [key(1)])) is LookupResult.MISS
    replays(m, log_url)
    log = EventLog(log_url)
    cleared = [e.tier for e in log.read() if isinstance(e, Cleared)]
    log.close()
    assert cleared == [Tier.G2, Tier.G3]
    m.shutdown()


def test_bad_g3_settings_are_refused_by_name(log_url: str) -> None:
    with pytest.raises(ValueError, match="g3_blocks must be a non-negative integer, got -1"):
        KvledgerOffloadingManager(2, g3_blocks=-1)
    with pytest.raises(ValueError, match="unknown offload_filter 'sometimes'"):
        KvledgerOffloadingManager(2, g3_blocks=4, offload_filter="sometimes")


def test_a_second_run_on_the_same_log_goes_on_from_it(log_url: str) -> None:
    """A restarted engine with the same log_url: its ids continue the log's, and the log says
    G2 and G3 start empty (the first run had a G3, the second has none), so it replays to the
    second run."""
    for run, g3 in ((0, 2), (1, 0)):
        m = KvledgerOffloadingManager(2, log_url=log_url, g3_blocks=g3, offload_filter="always")
        for i in range(3):
            k = key(run * 10 + i)
            store(m, request(f"{run}-{i}", [k]), [k])
        replays(m, log_url)
        m.shutdown()
    log = EventLog(log_url)
    cleared = [(e.event_id, e.tier) for e in log.read() if isinstance(e, Cleared)]
    log.close()
    assert [tier for _, tier in cleared] == [Tier.G2, Tier.G3]
    assert cleared[0][0] > 0, "the second run's ids go on from the first's"


@pytest.mark.parametrize("g3_blocks", [0, 4])
def test_a_dropped_manager_is_freed_by_reference_counting(g3_blocks: int) -> None:
    """No reference cycle through the pools' emitter: a manager dropped after a reset or a
    restart leaves nothing for the engine's garbage collector."""
    gc.collect()
    gc.disable()
    try:
        m = KvledgerOffloadingManager(2, enable_events=True, g3_blocks=g3_blocks)
        for i in range(4):  # stores that evict (and, with a G3, demote)
            ctx = request(f"r{i}", [key(2 * i), key(2 * i + 1)])
            out = m.prepare_store([key(2 * i), key(2 * i + 1)], ctx)
            assert out is not None
            m.complete_store(out.keys_to_store, ctx)
            m.on_request_finished(ctx)
        assert list(m.take_events())
        m.reset_cache()
        dropped = weakref.ref(m)
        del m, ctx
        assert dropped() is None
    finally:
        gc.enable()
