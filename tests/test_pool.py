"""BlockPool unit behaviour: capacity errors, dedup, bad calls that change nothing, events."""

from __future__ import annotations

import pytest

from kvledger.events.types import AnyEvent, Cleared, Removed, Stored, Tier
from kvledger.registry.emitter import EventEmitter
from kvledger.registry.policies import POLICY_NAMES
from kvledger.registry.pool import BlockPool, PoolBusy, PoolExhausted
from kvledger.registry.state import RegistryState


def pool(capacity: int = 4, policy: str = "lru") -> tuple[BlockPool, list[AnyEvent]]:
    events: list[AnyEvent] = []
    return BlockPool(capacity, policy=policy, emitter=EventEmitter(events.append)), events


def counts(p: BlockPool) -> tuple[int, int, int]:
    return p.num_free, p.num_active, p.num_inactive


def test_allocate_beyond_capacity_hands_out_nothing() -> None:
    p, events = pool(4)
    held = p.allocate(3)
    with pytest.raises(PoolExhausted, match="2 blocks requested, 1 could be freed"):
        p.allocate(2)
    assert counts(p) == (1, 3, 0)
    assert p.allocate_upto(5) == [3]
    assert events == []
    p.release(held)


def test_register_dedups_and_emits_one_stored_per_new_run() -> None:
    p, events = pool(6)
    a = p.register(p.allocate(2), [(10, 1), (11, 2)], None)
    b = p.register(p.allocate(3), [(10, 1), (11, 2), (12, 3)], None)
    assert b[:2] == a, "duplicates resolve to the existing slots"
    assert p.refcount(a[0]) == 2
    assert p.num_free == 6 - 3
    stored = [e for e in events if isinstance(e, Stored)]
    assert [(e.parent_hash, e.blocks) for e in stored] == [
        (None, ((10, 1), (11, 2))),
        (11, ((12, 3),)),
    ]


@pytest.mark.parametrize("policy", POLICY_NAMES)
def test_release_too_often_changes_nothing(policy: str) -> None:
    p, _ = pool(4, policy)
    cached = p.register(p.allocate(1), [(9, 9)], None)
    p.release(cached)
    slots = p.register(p.allocate(2), [(1, 1), (2, 2)], None)
    before = (counts(p), [p.refcount(s) for s in range(4)], p.inactive_slots())
    with pytest.raises(ValueError, match="released more often than taken"):
        p.release([slots[0], slots[1], slots[1]])
    assert (counts(p), [p.refcount(s) for s in range(4)], p.inactive_slots()) == before
    p.release(slots)
    assert counts(p) == (1, 0, 3)
    assert p.inactive_slots() == [*cached, *slots]


def test_register_refusal_after_naming_some_blocks_changes_nothing() -> None:
    """``register`` checks each slot as it names it; a refusal puts back what it named."""
    p, events = pool(8)
    held = p.register(p.allocate(1), [(1, 1)], None)
    fresh = p.allocate(3)
    for slots, blocks in (
        ([fresh[0], fresh[1], held[0]], [(2, 2), (3, 3), (4, 4)]),  # all new, one slot taken
        ([fresh[0], fresh[1], fresh[0]], [(2, 2), (3, 3), (4, 4)]),  # one slot named twice
        ([fresh[0], fresh[1], held[0]], [(2, 2), (1, 1), (4, 4)]),  # a duplicate, then refused
        ([fresh[0], fresh[0]], [(1, 1), (2, 2)]),  # twice, first for a held block (was freed)
        ([fresh[1], fresh[0], fresh[0]], [(2, 2), (1, 1), (3, 3)]),  # the same, after a new one
    ):
        before = (counts(p), p.resident_blocks(), [p.refcount(s) for s in range(8)])
        with pytest.raises(ValueError, match="not a mutable block"):
            p.register(slots, blocks, None)
        assert (counts(p), p.resident_blocks(), [p.refcount(s) for s in range(8)]) == before
    assert p.register(fresh[:2], [(2, 2), (3, 3)], None) == fresh[:2]
    assert [e.blocks for e in events if isinstance(e, Stored)] == [((1, 1),), ((2, 2), (3, 3))]


@pytest.mark.parametrize("policy", POLICY_NAMES)
def test_register_of_a_held_block_then_new_ones(policy: str) -> None:
    """The first block is held already: the new ones after it get their own parents."""
    p, events = pool(6, policy)
    held = p.register(p.allocate(1), [(1, 1)], None)
    got = p.register(p.allocate(3), [(1, 1), (2, 2), (3, 3)], None)
    assert got[0] == held[0] and p.refcount(held[0]) == 2
    assert p.resident_blocks() == {1: (1, None), 2: (2, 1), 3: (3, 2)}
    assert [(e.parent_hash, e.blocks) for e in events if isinstance(e, Stored)][-1] == (
        1,
        ((2, 2), (3, 3)),
    )


def test_register_refuses_slots_that_are_not_mutable() -> None:
    p, events = pool(4)
    slots = p.register(p.allocate(1), [(1, 1)], None)
    with pytest.raises(ValueError, match="not a mutable block"):
        p.register(slots, [(2, 2)], None)
    with pytest.raises(ValueError, match="2 slots for 1 blocks"):
        p.register(p.allocate(2), [(3, 3)], None)
    assert len([e for e in events if isinstance(e, Stored)]) == 1


def test_each_event_is_emitted_before_the_next_change() -> None:
    """A fold of the events up to any one of them is the pool right then: an eviction is
    reported before the blocks stored in the room it made, and each run of new blocks in a
    ``register`` with duplicates is reported before the next run is registered."""
    p: BlockPool
    seen: list[tuple[AnyEvent, dict[int, tuple[int, int | None]]]] = []
    p = BlockPool(4, emitter=EventEmitter(lambda e: seen.append((e, p.resident_blocks()))))
    p.release(p.register(p.allocate(4), [(1, 1), (2, 2), (3, 3), (4, 4)], None))
    p.release(p.register(p.allocate(2), [(5, 5), (6, 6)], None))  # evicts 1 and 2 first
    held = p.match([6])
    slots = p.allocate(3)  # evicts 3, 4, 5
    # 7 new, 6 cached (a duplicate), 8 new: two runs around the duplicate
    mixed = p.register(slots, [(7, 7), (6, 6), (8, 8)], None)
    assert mixed[1] == held[0]
    fold = RegistryState()
    for event, live in seen:
        fold.apply(event)
        assert fold.snapshot().get((0, Tier.G1), {}) == live, event
        assert len(live) <= p.capacity
    kinds = [type(e).__name__ for e, _ in seen]
    assert kinds == ["Stored", "Removed", "Stored", "Removed", "Stored", "Stored"], kinds
    p.release(held + mixed)


def test_match_takes_longest_prefix_and_revives_inactive() -> None:
    p, _ = pool(4)
    p.release(p.register(p.allocate(3), [(1, 1), (2, 2), (3, 3)], None))
    assert p.probe([1, 2, 9, 3]) == 2
    slots = p.match([1, 2, 9, 3])
    assert len(slots) == 2
    assert counts(p) == (1, 2, 1)


def test_clear_refuses_while_busy_then_empties() -> None:
    p, events = pool(3)
    slots = p.register(p.allocate(2), [(1, 1), (2, 2)], None)
    with pytest.raises(PoolBusy, match="2 blocks are in use"):
        p.clear()
    p.release(slots)
    p.clear()
    assert counts(p) == (3, 0, 0)
    assert isinstance(events[-1], Cleared) and events[-1].tier == Tier.G1
    assert p.probe([1]) == 0


def test_remove_drops_only_inactive_blocks() -> None:
    p, events = pool(3)
    held = p.register(p.allocate(1), [(1, 1)], None)
    p.release(p.register(p.allocate(1), [(2, 2)], 1))
    assert p.remove([1, 2, 99]) == [2]
    assert isinstance(events[-1], Removed) and events[-1].sequence_hashes == (2,)
    p.release(held)


@pytest.mark.parametrize("capacity", [0, -1, 2.5])
def test_bad_capacity_is_named(capacity: float) -> None:
    with pytest.raises(ValueError, match="capacity must be a positive integer"):
        BlockPool(capacity)  # type: ignore[arg-type]


def test_count_inactive_counts_cached_blocks_nobody_holds() -> None:
    p, _ = pool(6)
    held = p.register(p.allocate(2), [(10, 1), (11, 2)], None)
    idle = p.register(p.allocate(1), [(12, 3)], 11)
    p.release(idle)
    assert p.count_inactive([10, 11, 12, 99]) == 1  # 10 and 11 held, 99 unknown
    p.release(held)
    assert p.count_inactive([10, 11, 12, 99]) == 3
    assert p.count_inactive([]) == 0


def test_a_single_new_block_registers_like_a_run_and_dedups_against_the_pool() -> None:
    """register's one-block path (a decode block that filled) gives what a run gives."""
    p, events = pool(4)
    (first,) = p.register(p.allocate(1), [(10, 1)], None)
    slot = p.allocate(1)
    assert p.register(slot, [(10, 1)], None) == [first]  # a duplicate: the existing slot
    assert p.refcount(first) == 2 and p.num_free == 3
    stored = [e for e in events if isinstance(e, Stored)]
    assert [(e.parent_hash, e.blocks) for e in stored] == [(None, ((10, 1),))]
    (second,) = p.register(p.allocate(1), [(11, 2)], 10)
    assert p.block_info(second).parent_hash == 10


def test_an_evicted_block_takes_its_token_ids_and_key_with_it() -> None:
    """A slot handed out again holds nothing of the block evicted from it: routers read a
    block's tokens from its slot, and stale ones would name another block's prompt."""
    p, _ = pool(1)
    [slot] = p.register(p.allocate(1), [(10, 1)], None, token_ids=[[7, 8]], key=("lora", None))
    assert p.tokens_of([slot]) != [None] and p.keys_of([slot]) == [("lora", None)]
    p.release([slot])
    [again] = p.register(p.allocate(1), [(11, 2)], None)  # evicts block 10
    assert again == slot
    assert p.tokens_of([slot]) == [None] and p.keys_of([slot]) == [None]
