"""The mock engine's G1 pool: the behaviours Dynamo's mocker documents, in our own words."""

from __future__ import annotations

from typing import cast

import pytest

from kvledger.events.types import AnyEvent, Removed, Stored
from kvledger.mocker.g1_pool import (
    Deref,
    FullBlock,
    MockG1Pool,
    PartialBlock,
    Promote,
    Use,
)
from kvledger.registry.hashing import TokenBlockSequence
from kvledger.registry.policies import POLICY_NAMES


def capturing(
    capacity: int, block_size: int = 16, eviction: str = "lineage"
) -> tuple[MockG1Pool, list[AnyEvent]]:
    events: list[AnyEvent] = []
    return MockG1Pool(capacity, block_size, eviction=eviction, sink=events.append), events


def use(mgr: MockG1Pool, *ids: int, parent: int | None = None) -> int:
    return mgr.process(
        Use([FullBlock(i) for i in ids], parent=None if parent is None else FullBlock(parent))
    )


def deref(mgr: MockG1Pool, *ids: int) -> None:
    mgr.process(Deref([FullBlock(i) for i in ids]))


def test_single_full_block_is_active() -> None:
    mgr = MockG1Pool(10, 16)
    assert use(mgr, 1) == 1
    assert mgr.num_active_blocks() == 1


def test_bad_token_ids_change_nothing() -> None:
    mgr, events = capturing(10, 4)
    with pytest.raises(ValueError, match="token lists"):
        mgr.process(
            Use([FullBlock(1), FullBlock(2)], local_hashes=(101, 102), token_ids=[[1, 2, 3, 4]])
        )
    assert mgr.num_active_blocks() == 0
    assert mgr.active_blocks() == {}
    assert events == []


def test_reusing_an_active_block_adds_a_reference_not_a_slot() -> None:
    mgr = MockG1Pool(10, 16)
    use(mgr, 1)
    use(mgr, 1)
    assert mgr.num_active_blocks() == 1
    assert mgr.num_active_block_refs() == 2
    assert mgr.active_blocks() == {FullBlock(1): 2}


def test_full_pool_places_nothing_more() -> None:
    mgr = MockG1Pool(4, 16)
    for i in range(4):
        assert use(mgr, i) == 1
    assert use(mgr, 4) == 0
    assert mgr.num_active_blocks() == 4


def test_batch_up_to_capacity_then_refuses() -> None:
    mgr = MockG1Pool(10, 16)
    assert use(mgr, *range(10)) == 10
    assert use(mgr, 10) == 0


def test_short_use_places_exactly_a_prefix() -> None:
    mgr, events = capturing(3, 16, "lru")
    assert use(mgr, 1, 2, 3, 4, 5) == 3
    assert mgr.active_blocks() == {FullBlock(1): 1, FullBlock(2): 1, FullBlock(3): 1}
    assert [e.sequence_hashes for e in cast(list[Stored], events)] == [(1, 2, 3)]


def test_short_use_releases_reused_blocks_past_the_cut() -> None:
    mgr, _ = capturing(3, 16, "lru")
    use(mgr, 1, 2)
    use(mgr, 9)
    # 1 and 2 are held; 9 is held; the pool is full. A Use of [new 5, reused 9] cannot
    # place block 5, so it places nothing and must not keep the extra reference on 9.
    assert use(mgr, 5, 9) == 0
    assert mgr.active_blocks() == {FullBlock(1): 1, FullBlock(2): 1, FullBlock(9): 1}


def test_deref_makes_block_inactive_and_reusable() -> None:
    mgr, events = capturing(4)
    use(mgr, 1)
    deref(mgr, 1)
    assert mgr.num_active_blocks() == 0
    assert mgr.num_inactive_blocks() == 1
    assert use(mgr, 1) == 1
    assert mgr.num_inactive_blocks() == 0
    assert sum(isinstance(e, Stored) for e in events) == 1, "reactivation must not re-store"
    assert not any(isinstance(e, Removed) for e in events), "Deref must not remove"


def test_inactive_blocks_are_evicted_for_new_ones() -> None:
    for eviction in POLICY_NAMES:
        mgr = MockG1Pool(4, 16, eviction=eviction)
        for i in range(4):
            use(mgr, i)
        deref(mgr, *range(4))
        for i in range(10, 14):
            assert use(mgr, i) == 1, eviction
        assert mgr.num_active_blocks() == 4


def test_promote_turns_a_partial_into_a_full_block() -> None:
    mgr, events = capturing(10)
    mgr.process(Use([PartialBlock("req-1")]))
    assert mgr.num_active_blocks() == 1
    mgr.process(Promote("req-1", 42, None, 7))
    assert mgr.active_blocks() == {FullBlock(42): 1}
    assert isinstance(events[-1], Stored) and events[-1].blocks == ((42, 7),)


def test_promote_of_unknown_partial_is_an_error() -> None:
    mgr = MockG1Pool(10, 16)
    with pytest.raises(ValueError, match=r"partial block .* not found"):
        mgr.process(Promote("nope", 42, None, 0))


def test_promote_onto_cached_hash_deduplicates() -> None:
    mgr, events = capturing(10)
    use(mgr, 42)
    deref(mgr, 42)
    mgr.process(Use([PartialBlock("p")]))
    mgr.process(Promote("p", 42, None, 0))
    assert mgr.active_blocks() == {FullBlock(42): 1}
    assert mgr.num_active_blocks() == 1, "the partial's slot is given back"
    assert sum(isinstance(e, Stored) for e in events) == 1


def test_deref_of_partial_frees_its_slot() -> None:
    mgr = MockG1Pool(10, 16)
    mgr.process(Use([PartialBlock("u")]))
    mgr.process(Deref([PartialBlock("u")]))
    assert mgr.num_active_block_refs() == 0
    assert mgr.num_active_blocks() == 0
    assert mgr.num_inactive_blocks() == 0


def test_deref_of_unknown_block_changes_nothing() -> None:
    mgr = MockG1Pool(10, 16)
    use(mgr, 1)
    with pytest.raises(ValueError, match="not in use"):
        deref(mgr, 1, 2)
    assert mgr.active_blocks() == {FullBlock(1): 1}


def test_prefill_cost_without_overlap_counts_every_block() -> None:
    mgr = MockG1Pool(10, 16)
    cost = mgr.prefill_cost(list(range(35)))
    assert cost.new_blocks == 3  # two full blocks and a partial tail
    assert cost.new_tokens == 35
    assert cost.cached_tokens == 0


def test_prefill_cost_counts_cached_prefix() -> None:
    mgr = MockG1Pool(10, 4)
    seq = TokenBlockSequence(list(range(10)), 4)
    mgr.process(Use([FullBlock(h) for h in seq.sequence_hashes]))
    cost = mgr.prefill_cost(list(range(10)))
    assert cost == (1, 2, 8)


def test_lineage_lifecycle_and_event_stream() -> None:
    """A tree of prefixes under lineage eviction: suffixes go before the prefixes they extend."""
    # parents: 0-1-2-3-4, 1-5-6, 2-7-8-9, 10-11-12, 13
    mgr, events = capturing(10, eviction="lineage")

    def stored(event: AnyEvent, blocks: list[int], parent: int | None) -> None:
        assert isinstance(event, Stored)
        assert list(event.sequence_hashes) == blocks
        assert event.parent_hash == parent

    assert use(mgr, 0, 1, 2, 3, 4) == 5
    (ev,) = events
    stored(ev, [0, 1, 2, 3, 4], None)
    events.clear()

    assert use(mgr, 0, 1, 5, 6) == 4
    (ev,) = events
    stored(ev, [5, 6], 1)
    events.clear()
    assert mgr.active_blocks() == {
        FullBlock(b): r for b, r in [(0, 2), (1, 2), (2, 1), (3, 1), (4, 1), (5, 1), (6, 1)]
    }

    deref(mgr, 4, 3, 2, 1, 0)
    assert events == []
    assert mgr.active_blocks() == {FullBlock(b): 1 for b in (0, 1, 5, 6)}
    assert sorted(b.seq_hash for b in mgr.inactive_blocks()) == [2, 3, 4]

    deref(mgr, 6, 5, 1, 0)
    assert events == []
    assert mgr.num_active_blocks() == 0
    assert sorted(b.seq_hash for b in mgr.inactive_blocks()) == list(range(7))

    assert use(mgr, 0, 1, 2, 7, 8, 9) == 6
    (ev,) = events
    stored(ev, [7, 8, 9], 2)
    events.clear()
    assert sorted(b.seq_hash for b in mgr.inactive_blocks()) == [3, 4, 5, 6]

    # the eviction that made room is reported first, then the blocks stored in it
    assert use(mgr, 10, 11, 12) == 3
    ev_removed, ev_stored = events
    assert isinstance(ev_removed, Removed)
    assert list(ev_removed.sequence_hashes) == [4, 3, 6]
    stored(ev_stored, [10, 11, 12], None)
    events.clear()
    assert [b.seq_hash for b in mgr.inactive_blocks()] == [5]

    assert use(mgr, 13) == 1
    ev_removed, ev_stored = events
    assert list(cast(Removed, ev_removed).sequence_hashes) == [5]
    stored(ev_stored, [13], None)
    assert mgr.num_inactive_blocks() == 0
    assert mgr.num_active_blocks() == 10


def test_chunked_prefill_anchors_second_chunk_to_first() -> None:
    block = 64
    seq = TokenBlockSequence(list(range(512)), block)
    hashes = seq.sequence_hashes
    mgr, events = capturing(256, block)
    mgr.process(Use([FullBlock(h) for h in hashes[:4]]))
    mgr.process(Use([FullBlock(h) for h in hashes[4:8]], parent=FullBlock(hashes[3])))
    first, second = cast(list[Stored], events)
    assert first.parent_hash is None
    assert second.parent_hash == hashes[3]


def test_new_suffix_anchors_to_last_reused_block() -> None:
    mgr, events = capturing(8)
    use(mgr, 10, 11)
    deref(mgr, 10, 11)
    events.clear()
    use(mgr, 10, 11, 12)
    (ev,) = cast(list[Stored], events)
    assert ev.blocks == ((12, 0),)
    assert ev.parent_hash == 11


def test_shared_prefix_counts_slots_once_and_references_per_request() -> None:
    mgr = MockG1Pool(8, 16)
    use(mgr, 10, 11, 12)
    use(mgr, 10, 11, 13)
    assert mgr.num_active_blocks() == 4
    assert mgr.num_active_block_refs() == 6


def test_preempted_request_finds_its_own_blocks_again() -> None:
    mgr, events = capturing(8)
    blocks = [FullBlock(h) for h in TokenBlockSequence(list(range(64)), 16).sequence_hashes]
    assert mgr.process(Use(blocks)) == 4
    mgr.process(Deref(blocks))
    assert mgr.num_inactive_blocks() == 4
    assert mgr.process(Use(blocks)) == 4
    assert mgr.num_inactive_blocks() == 0
    assert sum(isinstance(e, Stored) for e in events) == 1


def test_eviction_reports_exactly_the_evicted_block() -> None:
    mgr, events = capturing(2)
    use(mgr, 10, 11)
    deref(mgr, 10, 11)
    events.clear()
    use(mgr, 12)
    removed = [h for e in events if isinstance(e, Removed) for h in e.sequence_hashes]
    assert len(removed) == 1 and removed[0] in (10, 11)
    assert sum(isinstance(e, Stored) for e in events) == 1


def test_use_never_evicts_a_block_it_reuses() -> None:
    """Room for the new block must come from elsewhere than the request's own cached prefix."""
    mgr, events = capturing(3, eviction="lru")
    use(mgr, 1, 2)
    deref(mgr, 1, 2)
    use(mgr, 7)
    deref(mgr, 7)
    # Free: 0 slots. LRU order: 1, 2, 7. Use [1, 2, 3] must evict 7, not 1 or 2.
    assert use(mgr, 1, 2, 3) == 3
    removed = [h for e in events if isinstance(e, Removed) for h in e.sequence_hashes]
    assert removed == [7]


def test_event_ids_increase_from_zero() -> None:
    mgr, events = capturing(4)
    use(mgr, 1, 2)
    deref(mgr, 1, 2)
    use(mgr, 3, 4, 5)
    assert [e.event_id for e in events] == list(range(len(events)))
    assert all(e.worker_id == 0 and e.dp_rank == 0 for e in events)


def test_probe_new_blocks() -> None:
    mgr = MockG1Pool(8, 16)
    use(mgr, 1, 2)
    mgr.process(Use([PartialBlock("x")]))
    assert mgr.probe_new_blocks([FullBlock(1), FullBlock(2), FullBlock(3)]) == 1
    assert mgr.probe_new_blocks([PartialBlock("x"), PartialBlock("y")]) == 1


def test_unknown_eviction_policy_is_named() -> None:
    with pytest.raises(ValueError, match="unknown eviction policy 'fifo'"):
        MockG1Pool(4, 16, eviction="fifo")
