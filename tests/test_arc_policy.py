"""ARC (``ArcPolicy``) through a real ``BlockPool``: what it keeps, what it learns, its bounds."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvledger.events.types import AnyEvent, Removed, Tier
from kvledger.registry.emitter import EventEmitter
from kvledger.registry.policies import ArcPolicy
from kvledger.registry.pool import BlockPool


def arc_pool(capacity: int) -> tuple[BlockPool, ArcPolicy, list[int]]:
    evicted: list[int] = []

    def sink(event: AnyEvent) -> None:
        if isinstance(event, Removed):
            evicted.extend(event.sequence_hashes)

    policy = ArcPolicy()
    pool = BlockPool(capacity, tier=Tier.G2, policy=policy, emitter=EventEmitter(sink))
    return pool, policy, evicted


def store(pool: BlockPool, hashes: list[int]) -> None:
    """Each block stored on its own (no parents), used once, released."""
    for h in hashes:
        slots = pool.allocate(1)
        pool.register(slots, [(h, h)])
        pool.release(slots)


def use(pool: BlockPool, hashes: list[int]) -> None:
    """Blocks read again (a hit): matched one by one, then released."""
    for h in hashes:
        slots = pool.match([h])
        assert slots, f"block {h} should be cached"
        pool.release(slots)


def test_blocks_used_twice_outlive_a_scan_of_one_off_blocks() -> None:
    pool, policy, evicted = arc_pool(8)
    hot = list(range(1, 5))
    store(pool, hot)
    use(pool, hot)  # T2 now
    store(pool, list(range(100, 200)))  # a scan, each block once
    assert all(h in pool for h in hot)
    assert not set(hot) & set(evicted)
    t1, t2, _, _ = policy.lists()
    assert sorted(t2) == hot and len(t1) == 4


def test_lru_alone_would_lose_the_hot_blocks_to_the_same_scan() -> None:
    """The reference point for the test above: release-ordered LRU keeps only the scan."""
    pool = BlockPool(8, tier=Tier.G2, policy="lru")
    store(pool, list(range(1, 5)))
    use(pool, list(range(1, 5)))
    store(pool, list(range(100, 200)))
    assert not any(h in pool for h in range(1, 5))


def test_a_ghost_of_t1_raises_the_target_and_one_of_t2_lowers_it() -> None:
    pool, policy, _ = arc_pool(2)
    store(pool, [1, 2])
    store(pool, [3])  # evicts 1 (T1's least recent) into B1
    assert policy.lists()[2] == [1]
    assert policy.target_t1 == 0
    pool.missed([1])  # the engine asks for 1 again: T1 was too small
    assert policy.target_t1 == 1
    store(pool, [1])  # it arrives: no second adaptation for the same miss
    assert policy.target_t1 == 1
    assert 1 not in policy.lists()[2]

    use(pool, [1, 3])  # both to T2 (2 was evicted by the store of 1)
    store(pool, [4])  # |T1| = 0 < target 1: T2 gives its least recent (1) to B2
    assert policy.lists()[3] == [1]
    pool.missed([1])
    assert policy.target_t1 == 0


def test_a_block_in_use_is_never_a_victim_and_the_other_list_gives_one() -> None:
    pool, _, evicted = arc_pool(3)
    store(pool, [1, 2])
    use(pool, [1, 2])  # T2 = {1, 2}
    store(pool, [3])  # T1 = {3}
    held = pool.match([3])  # in use: T1 has nothing to give
    store(pool, [4])
    assert evicted == [1]  # T2's least recent instead
    pool.release(held)


@settings(max_examples=200, deadline=None)
@given(
    capacity=st.integers(1, 8),
    ops=st.lists(
        st.tuples(st.sampled_from(["store", "use", "miss", "remove"]), st.integers(0, 20)),
        max_size=80,
    ),
)
def test_lists_stay_within_arcs_bounds(capacity: int, ops: list[tuple[str, int]]) -> None:
    pool, policy, _ = arc_pool(capacity)
    for op, h in ops:
        if op == "store" and h not in pool:
            store(pool, [h])
        elif op == "use" and h in pool:
            use(pool, [h])
        elif op == "miss" and h not in pool:
            pool.missed([h])
        elif op == "remove":
            pool.remove([h])
        t1, t2, b1, b2 = policy.lists()
        resident = set(pool.resident_blocks())
        assert set(t1) | set(t2) == resident  # nothing is held here: every block is inactive
        assert not set(t1) & set(t2)
        assert not (set(b1) | set(b2)) & resident  # a ghost is not resident
        assert len(b1) <= capacity and len(b2) <= capacity
        assert 0 <= policy.target_t1 <= capacity
        assert pool.num_inactive == len(resident)


def test_clear_forgets_lists_ghosts_and_target() -> None:
    pool, policy, _ = arc_pool(2)
    store(pool, [1, 2, 3])
    pool.missed([1])
    pool.clear()
    assert policy.lists() == ([], [], [], [])
    assert policy.target_t1 == 0
