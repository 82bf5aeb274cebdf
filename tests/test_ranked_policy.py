"""RankedPolicy (caller-set ranks) and BlockPool(fresh_first=True): the bookkeeping under
kvledger's vLLM offloading manager, through the pool's public API."""

from __future__ import annotations

import pytest

from kvledger.events.types import Tier
from kvledger.registry.errors import PoolExhausted
from kvledger.registry.policies import RankedPolicy
from kvledger.registry.pool import BlockPool


def stored_pool(capacity: int, ranks: list[int]) -> tuple[BlockPool, RankedPolicy]:
    """A pool whose first len(ranks) slots hold blocks 100, 101, ... with those ranks, inactive."""
    policy = RankedPolicy()
    pool = BlockPool(capacity, tier=Tier.G2, policy=policy, fresh_first=True)
    slots = pool.allocate(len(ranks))
    policy.set_ranks(slots, ranks)
    pool.register(slots, [(100 + i, 100 + i) for i in range(len(ranks))])
    pool.release(slots)
    return pool, policy


def test_fresh_first_hands_out_unused_slots_in_order_then_last_freed_first() -> None:
    pool = BlockPool(5, fresh_first=True)
    assert pool.allocate(3) == [0, 1, 2]
    pool.release([1])  # never named: back to the free list
    pool.release([2])
    assert pool.allocate(3) == [3, 4, 2]  # fresh ones first, then the last freed
    assert pool.allocate(1) == [1]


def test_default_pool_order_is_unchanged() -> None:
    pool = BlockPool(4)
    assert pool.allocate(2) == [1, 0]


def test_lowest_rank_is_evicted_first_whatever_the_release_order() -> None:
    pool, _ = stored_pool(3, [50, 10, 30])
    pool.allocate(1)
    assert 101 not in pool and 100 in pool and 102 in pool


def test_a_rank_set_while_in_use_counts_once_released() -> None:
    pool, policy = stored_pool(2, [10, 20])
    slot = pool.lookup(100)
    assert slot is not None
    pool.acquire([slot])
    policy.set_ranks([slot], [90])  # a newer request used it while it was pinned
    pool.release([slot])
    pool.allocate(1)
    assert 100 in pool and 101 not in pool


def test_pinned_blocks_are_not_evicted_and_a_failed_allocation_changes_nothing() -> None:
    pool, _ = stored_pool(2, [10, 20])
    pinned = [s for s in (pool.lookup(100), pool.lookup(101)) if s is not None]
    pool.acquire(pinned)
    with pytest.raises(PoolExhausted):
        pool.allocate(1)
    assert 100 in pool and 101 in pool
    pool.release(pinned)
    assert pool.allocate(1) == [0]  # block 100 (rank 10) goes first


def test_reranking_many_inactive_blocks_keeps_the_order() -> None:
    pool, policy = stored_pool(100, list(range(100)))
    slots = [pool.lookup(100 + i) for i in range(100)]
    policy.set_ranks([s for s in slots if s is not None], [1000 - i for i in range(100)])
    pool.allocate(1)
    assert 199 not in pool and 100 in pool


def test_raise_ranks_never_lowers_a_rank_and_requeues_what_it_raises() -> None:
    pool, policy = stored_pool(4, [50, 10, 30])
    slots = [pool.lookup(h) for h in (100, 101, 102)]
    assert None not in slots
    # 100 keeps 50 (higher than 20); 101 rises to 40; 102 to 31
    policy.raise_ranks([s for s in slots if s is not None], [20, 40, 31])
    assert [policy.rank(s) for s in slots if s is not None] == [50, 40, 31]
    pool.allocate(1)  # the free slot
    pool.allocate(1)  # the lowest rank now: 102 at 31
    assert 102 not in pool and 100 in pool and 101 in pool
    pool.allocate(1)
    assert 101 not in pool and 100 in pool
