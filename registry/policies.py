"""Eviction policies: which inactive block a pool gives up when it needs a slot.

A policy only ever sees inactive blocks (refcount 0, still registered). The pool tells it
when blocks become inactive (``released``), active again (``activated``), newly registered
(``registered``, with each block's sequence hash and parent hash) or looked up (``accessed``),
and asks it for victims. A policy keeps what it needs of those blocks itself (the lineage
policy their hashes and parents, the frequency policy their hashes) and never reads the pool.
The LRU policy, whose whole state is one queue of inactive blocks, lends the pool that queue
(``queue``): the pool enters and takes out blocks there in its own loops.
An engine may also say that it asked for blocks the pool did not hold (``missed``): ARC learns
from a miss on a block it evicted lately.

Each policy has one implementation, used by ``BlockManager``'s pools, the vLLM offloading
manager's pools and, through ``kvledger.integrations.vllm.policies``, vLLM's own CPU tier.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Sequence
from typing import Protocol

POLICY_NAMES = ("lru", "arc", "lineage", "multi_lru")


class EvictionPolicy(Protocol):
    #: whether the pool should report every lookup hit (frequency-aware policies only)
    tracks_access: bool

    @property
    def queue(self) -> OrderedDict[int, None] | None:
        """The inactive slots in eviction order, where that order is all the policy keeps
        (LRU): the pool then enters a released slot and takes out a revived one itself, in
        the loop that counts its references, instead of handing ``released`` and
        ``activated`` a list to loop over again, and does not build ``registered``'s lists
        for a policy that ignores them (bench/registry_bench.py under callgrind: 7% and 3%
        fewer instructions). The pool's compiled loops (``registry/_pool.c``) also take the
        victims off its front themselves, as ``pick_victims`` does, in one call for all of
        them. None for every other policy."""
        ...

    def bind(self, capacity: int) -> None: ...
    def registered(
        self, slots: Sequence[int], hashes: Sequence[int], parents: Sequence[int | None]
    ) -> None: ...
    def released(self, slots: Sequence[int]) -> None: ...
    def activated(self, slots: Sequence[int]) -> None: ...
    def accessed(self, slots: Sequence[int]) -> None: ...
    def missed(self, sequence_hashes: Sequence[int]) -> None: ...
    def evictable(self) -> int: ...
    def pick_victims(self, count: int) -> list[int]: ...
    def inactive_order(self) -> list[int]: ...
    def forget(self, slots: Sequence[int]) -> None: ...
    def clear(self) -> None: ...


class LruPolicy:
    """Least recently released first."""

    tracks_access = False

    def __init__(self) -> None:
        self._inactive: OrderedDict[int, None] = OrderedDict()

    @property
    def queue(self) -> OrderedDict[int, None]:
        return self._inactive

    def bind(self, capacity: int) -> None:
        pass

    def registered(
        self, slots: Sequence[int], hashes: Sequence[int], parents: Sequence[int | None]
    ) -> None:
        pass

    def accessed(self, slots: Sequence[int]) -> None:
        pass

    def missed(self, sequence_hashes: Sequence[int]) -> None:
        pass

    def released(self, slots: Sequence[int]) -> None:
        # a loop, not update(dict.fromkeys(...)): OrderedDict.update is generic Python code,
        # 3-7x slower for the few blocks a request releases
        inactive = self._inactive
        for slot in slots:
            inactive[slot] = None

    def activated(self, slots: Sequence[int]) -> None:
        pop = self._inactive.pop
        for slot in slots:
            pop(slot)

    def forget(self, slots: Sequence[int]) -> None:
        """Slots leaving the pool other than by eviction, in use or not."""
        pop = self._inactive.pop
        for slot in slots:
            pop(slot, None)

    def evictable(self) -> int:
        return len(self._inactive)

    def pick_victims(self, count: int) -> list[int]:
        # popitem(False): the keyword form costs a keyword parse per victim
        popitem = self._inactive.popitem
        return [popitem(False)[0] for _ in range(min(count, len(self._inactive)))]

    def inactive_order(self) -> list[int]:
        return list(self._inactive)

    def clear(self) -> None:
        self._inactive.clear()


class LineagePolicy:
    """Leaves first, least recently released leaf first, so a prefix outlives its suffixes.

    A leaf is an inactive block that no resident block names as its parent. When a leaf is
    evicted its parent may become a leaf; it then competes with the release time it had, not
    the time it became a leaf (a prefix released long ago is older than a suffix released now).
    Candidates sit in a heap keyed by release tick; stale entries are skipped when popped.
    """

    tracks_access = False
    queue = None

    def __init__(self) -> None:
        self._tick = 0
        self._release_tick: dict[int, int] = {}
        self._heap: list[tuple[int, int]] = []
        self._children: dict[int, int] = {}
        #: per slot: the registered block's sequence hash and parent hash
        self._hash: list[int] = []
        self._parent: list[int | None] = []
        self._slot_of: dict[int, int] = {}

    def bind(self, capacity: int) -> None:
        self._hash = [0] * capacity
        self._parent = [None] * capacity

    def registered(
        self, slots: Sequence[int], hashes: Sequence[int], parents: Sequence[int | None]
    ) -> None:
        own_hash, own_parent, slot_of = self._hash, self._parent, self._slot_of
        children = self._children
        for slot, seq, parent in zip(slots, hashes, parents, strict=True):
            own_hash[slot] = seq
            own_parent[slot] = parent
            slot_of[seq] = slot
            if parent is not None:
                children[parent] = children.get(parent, 0) + 1

    def accessed(self, slots: Sequence[int]) -> None:
        pass

    def missed(self, sequence_hashes: Sequence[int]) -> None:
        pass

    def released(self, slots: Sequence[int]) -> None:
        hashes = self._hash
        children = self._children
        ticks = self._release_tick
        heap = self._heap
        tick = self._tick
        for slot in slots:
            tick += 1
            ticks[slot] = tick
            if not children.get(hashes[slot], 0):
                heapq.heappush(heap, (tick, slot))
        self._tick = tick

    def activated(self, slots: Sequence[int]) -> None:
        ticks = self._release_tick
        for slot in slots:
            del ticks[slot]

    def evictable(self) -> int:
        return len(self._release_tick)

    def pick_victims(self, count: int) -> list[int]:
        hashes, parents = self._hash, self._parent
        ticks, heap, children = self._release_tick, self._heap, self._children
        victims: list[int] = []
        while heap and len(victims) < count:
            tick, slot = heapq.heappop(heap)
            if ticks.get(slot) != tick or children.get(hashes[slot], 0):
                continue  # reactivated since, or grew a child: not a leaf now
            del ticks[slot]
            victims.append(slot)
            self._drop_child_of(parents[slot])
        self._unname(victims)
        return victims

    def _drop_child_of(self, parent: int | None) -> None:
        if parent is None:
            return
        children = self._children
        left = children[parent] - 1
        if left:
            children[parent] = left
            return
        del children[parent]
        parent_slot = self._slot_of.get(parent)
        if parent_slot is not None:
            tick = self._release_tick.get(parent_slot)
            if tick is not None:
                heapq.heappush(self._heap, (tick, parent_slot))

    def _unname(self, slots: Sequence[int]) -> None:
        """Slots that leave the pool: their blocks are no longer anyone's parent here."""
        slot_of, hashes = self._slot_of, self._hash
        for slot in slots:
            del slot_of[hashes[slot]]

    def forget(self, slots: Sequence[int]) -> None:
        """Slots leaving the pool by another way than eviction (explicit removal)."""
        parents = self._parent
        for slot in slots:
            self._release_tick.pop(slot, None)
            self._drop_child_of(parents[slot])
        self._unname(slots)

    def inactive_order(self) -> list[int]:
        return [slot for slot, _ in sorted(self._release_tick.items(), key=lambda kv: kv[1])]

    def clear(self) -> None:
        self._release_tick.clear()
        self._heap.clear()
        self._children.clear()
        self._slot_of.clear()


class FrequencySketch:
    """A count-min sketch of access counts with 4-bit counters and periodic halving (TinyLFU).

    Sequence hashes are already uniform 64-bit values, so the four rows index with four
    16-bit slices of the hash instead of four hash functions.
    """

    DEPTH = 4
    MAX_COUNT = 15

    def __init__(self, capacity: int) -> None:
        width = 16
        while width < max(capacity, 16):
            width <<= 1
        self._mask = width - 1
        self._rows = [[0] * width for _ in range(self.DEPTH)]
        self._additions = 0
        self._sample = 10 * max(capacity, 16)

    def _indexes(self, key: int) -> tuple[int, int, int, int]:
        mask = self._mask
        return (key & mask, (key >> 16) & mask, (key >> 32) & mask, (key >> 48) & mask)

    def increment(self, key: int) -> None:
        for row, idx in zip(self._rows, self._indexes(key), strict=True):
            if row[idx] < self.MAX_COUNT:
                row[idx] += 1
        self._additions += 1
        if self._additions >= self._sample:
            self._age()

    def estimate(self, key: int) -> int:
        return min(row[idx] for row, idx in zip(self._rows, self._indexes(key), strict=True))

    def _age(self) -> None:
        """Halve every counter, so old popularity fades and new blocks can compete."""
        self._rows = [[count >> 1 for count in row] for row in self._rows]
        self._additions //= 2


class MultiLruPolicy:
    """Frequency-aware: a TinyLFU sketch places each released block in one of several LRU levels.

    Blocks seen once land in level 0 and are evicted first; blocks seen often land higher and
    outlive a scan of one-off prompts. Within a level, least recently released goes first.
    """

    tracks_access = True
    queue = None
    #: a block seen at least LEVEL_THRESHOLDS[i] times goes to level i+1
    LEVEL_THRESHOLDS = (2, 4, 8)

    def __init__(self, capacity: int = 1024) -> None:
        self._capacity = capacity
        self._sketch = FrequencySketch(capacity)
        self._levels: list[OrderedDict[int, None]] = [
            OrderedDict() for _ in range(len(self.LEVEL_THRESHOLDS) + 1)
        ]
        self._level_of: dict[int, int] = {}
        self._hash: list[int] = []  # per slot: the registered block's sequence hash

    def bind(self, capacity: int) -> None:
        self._capacity = capacity
        self._sketch = FrequencySketch(capacity)
        self._hash = [0] * capacity

    def registered(
        self, slots: Sequence[int], hashes: Sequence[int], parents: Sequence[int | None]
    ) -> None:
        own, increment = self._hash, self._sketch.increment
        for slot, seq in zip(slots, hashes, strict=True):
            own[slot] = seq
            increment(seq)

    def accessed(self, slots: Sequence[int]) -> None:
        hashes, increment = self._hash, self._sketch.increment
        for slot in slots:
            increment(hashes[slot])

    def missed(self, sequence_hashes: Sequence[int]) -> None:
        pass

    def _level(self, key: int) -> int:
        seen = self._sketch.estimate(key)
        level = 0
        for threshold in self.LEVEL_THRESHOLDS:
            if seen >= threshold:
                level += 1
        return level

    def released(self, slots: Sequence[int]) -> None:
        hashes, level_of, levels = self._hash, self._level_of, self._levels
        for slot in slots:
            level = self._level(hashes[slot])
            levels[level][slot] = None
            level_of[slot] = level

    def activated(self, slots: Sequence[int]) -> None:
        level_of, levels = self._level_of, self._levels
        for slot in slots:
            del levels[level_of.pop(slot)][slot]

    def forget(self, slots: Sequence[int]) -> None:
        """Slots leaving the pool other than by eviction, in use or not."""
        level_of, levels = self._level_of, self._levels
        for slot in slots:
            level = level_of.pop(slot, None)
            if level is not None:
                del levels[level][slot]

    def evictable(self) -> int:
        return len(self._level_of)

    def pick_victims(self, count: int) -> list[int]:
        victims: list[int] = []
        for level in self._levels:
            while level and len(victims) < count:
                slot = level.popitem(last=False)[0]
                del self._level_of[slot]
                victims.append(slot)
        return victims

    def inactive_order(self) -> list[int]:
        return [slot for level in self._levels for slot in level]

    def clear(self) -> None:
        for level in self._levels:
            level.clear()
        self._level_of.clear()


class ArcPolicy:
    """Adaptive Replacement Cache (Megiddo and Modha, FAST 2003), over a pool's slots.

    A resident block is in T1 (seen once since it arrived) or T2 (used again: ``accessed``).
    Each list keeps its inactive blocks least recently released first. A victim comes from T1
    while T1 holds at least ``target_t1`` blocks (in use or not), from T2 otherwise, and from
    the other list when the chosen one has nothing evictable. An evicted block's hash goes to
    the ghost list of its list (B1 or B2, each at most ``capacity`` long). A miss on a ghost
    (``missed``, or the block arriving again) moves the target: a B1 ghost says T1 was too
    small (the target grows by max(1, |B2| / |B1|)), a B2 ghost that T2 was (it shrinks by
    max(1, |B1| / |B2|)). A block that arrives again enters T1 like any other, as in vLLM's
    ARC; its arrival moves the target only when no miss of it was reported since it left
    (an engine that reports misses, as vLLM's manager does, is counted as it reports them).
    """

    tracks_access = True
    queue = None

    def __init__(self) -> None:
        self.capacity = 0
        self.target_t1: float = 0.0
        #: per slot: 1 (T1) or 2 (T2) while resident, 0 when free
        self._list: list[int] = []
        self._hash: list[int] = []
        self._t1_size = 0  # resident T1 blocks, in use or not: ARC's |T1|
        self._t1: OrderedDict[int, None] = OrderedDict()  # inactive T1 slots, LRU first
        self._t2: OrderedDict[int, None] = OrderedDict()
        self._b1: OrderedDict[int, None] = OrderedDict()  # ghost sequence hashes, LRU first
        self._b2: OrderedDict[int, None] = OrderedDict()
        self._adapted: set[int] = set()  # ghosts whose miss already moved the target

    def bind(self, capacity: int) -> None:
        self.capacity = capacity
        self._list = [0] * capacity
        self._hash = [0] * capacity

    # -- what the pool reports -------------------------------------------------------------

    def registered(
        self, slots: Sequence[int], hashes: Sequence[int], parents: Sequence[int | None]
    ) -> None:
        lists, own = self._list, self._hash
        for slot, seq in zip(slots, hashes, strict=True):
            if seq in self._b1 or seq in self._b2:
                if seq not in self._adapted:
                    self._adapt(seq)
                self._b1.pop(seq, None)
                self._b2.pop(seq, None)
                self._adapted.discard(seq)
            own[slot] = seq
            lists[slot] = 1
        self._t1_size += len(slots)

    def released(self, slots: Sequence[int]) -> None:
        lists, t1, t2 = self._list, self._t1, self._t2
        for slot in slots:
            if lists[slot] == 1:
                t1[slot] = None
            else:
                t2[slot] = None

    def activated(self, slots: Sequence[int]) -> None:
        lists, t1, t2 = self._list, self._t1, self._t2
        for slot in slots:
            del (t1 if lists[slot] == 1 else t2)[slot]

    def accessed(self, slots: Sequence[int]) -> None:
        """Used again: a T1 block moves to T2 (where an inactive one is most recent)."""
        lists, t1, t2 = self._list, self._t1, self._t2
        for slot in slots:
            if lists[slot] == 1:
                lists[slot] = 2
                self._t1_size -= 1
                if slot in t1:  # inactive: it stays evictable, now in T2
                    del t1[slot]
                    t2[slot] = None
            elif slot in t2:
                t2.move_to_end(slot)

    def missed(self, sequence_hashes: Sequence[int]) -> None:
        """Blocks the engine asked for and the pool did not hold: each ghost among them moves
        the target (every report counts; the block's arrival then does not count again)."""
        for seq in sequence_hashes:
            if seq in self._b1 or seq in self._b2:
                self._adapt(seq)
                self._adapted.add(seq)

    def _adapt(self, seq: int) -> None:
        b1, b2 = self._b1, self._b2
        if seq in b1:
            self.target_t1 = min(self.target_t1 + max(1.0, len(b2) / len(b1)), self.capacity)
            b1.move_to_end(seq)
        else:
            self.target_t1 = max(self.target_t1 - max(1.0, len(b1) / len(b2)), 0.0)
            b2.move_to_end(seq)

    def forget(self, slots: Sequence[int]) -> None:
        """Slots leaving the pool other than by eviction: no ghost is kept."""
        lists = self._list
        for slot in slots:
            if lists[slot] == 1:
                self._t1_size -= 1
                self._t1.pop(slot, None)
            elif lists[slot] == 2:
                self._t2.pop(slot, None)
            lists[slot] = 0

    # -- victims ---------------------------------------------------------------------------

    def evictable(self) -> int:
        return len(self._t1) + len(self._t2)

    def pick_victims(self, count: int) -> list[int]:
        lists, hashes = self._list, self._hash
        t1, t2, b1, b2 = self._t1, self._t2, self._b1, self._b2
        victims: list[int] = []
        while len(victims) < count and (t1 or t2):
            if t1 and (self._t1_size >= int(self.target_t1) or not t2):
                slot = t1.popitem(last=False)[0]
                self._t1_size -= 1
                b1[hashes[slot]] = None
            else:
                slot = t2.popitem(last=False)[0]
                b2[hashes[slot]] = None
            lists[slot] = 0
            victims.append(slot)
        for ghost in (b1, b2):
            for _ in range(len(ghost) - self.capacity):
                self._adapted.discard(ghost.popitem(last=False)[0])
        return victims

    def inactive_order(self) -> list[int]:
        """T1's inactive blocks then T2's: the order of victims while T1 is above target."""
        return [*self._t1, *self._t2]

    def clear(self) -> None:
        self._t1.clear()
        self._t2.clear()
        self._b1.clear()
        self._b2.clear()
        self._adapted.clear()
        self._list = [0] * self.capacity
        self._t1_size = 0
        self.target_t1 = 0.0

    # -- for tests and the vLLM adapter: ARC's lists by sequence hash -------------------------

    def lists(self) -> tuple[list[int], list[int], list[int], list[int]]:
        """(T1, T2, B1, B2) as sequence hashes, least recent first (T1 and T2: inactive only)."""
        hashes = self._hash
        return (
            [hashes[s] for s in self._t1],
            [hashes[s] for s in self._t2],
            list(self._b1),
            list(self._b2),
        )


Rank = int
"""A ``RankedPolicy`` rank: lower is evicted first. An int, not a tuple of the caller's keys: the
heap compares ranks on every push and pop, and an engine re-ranks every block of every request
(the vLLM manager folds its (request, -position) pair into one int: ``manager.RANK_SHIFT``)."""


class RankedPolicy:
    """Lowest rank first, where the caller sets each slot's rank.

    For an engine whose recency is its own business: vLLM ranks offloaded blocks per request
    (a request's blocks take their rank when it finishes, tail before head), and a late
    completion of an old request must not demote a newer one, which a release-ordered LRU
    gets wrong. A rank may change while the slot is in use; it counts once the slot is
    inactive. Inactive slots sit in a heap with lazy invalidation: a stale entry (the slot
    re-ranked, taken, or gone) is skipped when it reaches the top.
    """

    tracks_access = False
    queue = None

    def __init__(self) -> None:
        self._rank: dict[int, Rank] = {}
        self._inactive: set[int] = set()
        self._heap: list[tuple[Rank, int]] = []

    def bind(self, capacity: int) -> None:
        pass

    def set_ranks(self, slots: Sequence[int], ranks: Sequence[Rank]) -> None:
        rank_of, inactive = self._rank, self._inactive
        moved: list[int] = []
        for slot, rank in zip(slots, ranks, strict=True):
            rank_of[slot] = rank
            if slot in inactive:
                moved.append(slot)
        self._requeue(moved)

    def raise_ranks(self, slots: Sequence[int], ranks: Sequence[Rank]) -> None:
        """``set_ranks``, except that a slot whose rank is already at least the one given
        keeps it (a newer request's rank is never lowered). One call for what would take a
        ``rank`` per slot."""
        rank_of, inactive = self._rank, self._inactive
        moved: list[int] = []
        for slot, rank in zip(slots, ranks, strict=True):
            current = rank_of.get(slot)
            if current is not None and current >= rank:
                continue
            rank_of[slot] = rank
            if slot in inactive:
                moved.append(slot)
        self._requeue(moved)

    def _requeue(self, moved: list[int]) -> None:
        """Re-queue re-ranked inactive slots (the stale heap entries are skipped later)."""
        if not moved:
            return
        rank_of, inactive, heap = self._rank, self._inactive, self._heap
        if len(moved) >= max(64, len(inactive) // 4):
            self._rebuild()
        else:
            for slot in moved:
                heapq.heappush(heap, (rank_of[slot], slot))
            self._maybe_compact()

    def rank(self, slot: int) -> Rank | None:
        return self._rank.get(slot)

    def registered(
        self, slots: Sequence[int], hashes: Sequence[int], parents: Sequence[int | None]
    ) -> None:
        rank_of = self._rank
        for slot in slots:
            rank_of.setdefault(slot, 0)

    def accessed(self, slots: Sequence[int]) -> None:
        pass

    def missed(self, sequence_hashes: Sequence[int]) -> None:
        pass

    def released(self, slots: Sequence[int]) -> None:
        rank_of, heap = self._rank, self._heap
        self._inactive.update(slots)
        for slot in slots:
            heapq.heappush(heap, (rank_of.get(slot, 0), slot))
        self._maybe_compact()

    def activated(self, slots: Sequence[int]) -> None:
        self._inactive.difference_update(slots)

    def forget(self, slots: Sequence[int]) -> None:
        self._inactive.difference_update(slots)
        for slot in slots:
            self._rank.pop(slot, None)

    def evictable(self) -> int:
        return len(self._inactive)

    def pick_victims(self, count: int) -> list[int]:
        heap, inactive, rank_of = self._heap, self._inactive, self._rank
        victims: list[int] = []
        while heap and len(victims) < count:
            rank, slot = heapq.heappop(heap)
            if slot in inactive and rank_of.get(slot) == rank:
                inactive.remove(slot)
                del rank_of[slot]
                victims.append(slot)
        return victims

    def inactive_order(self) -> list[int]:
        rank_of = self._rank
        return sorted(self._inactive, key=lambda slot: (rank_of.get(slot, 0), slot))

    def clear(self) -> None:
        self._rank.clear()
        self._inactive.clear()
        self._heap.clear()

    def _rebuild(self) -> None:
        rank_of = self._rank
        self._heap = [(rank_of.get(slot, 0), slot) for slot in self._inactive]
        heapq.heapify(self._heap)

    def _maybe_compact(self) -> None:
        # A rebuild costs a pass over the inactive slots; a stale entry left in costs a pop
        # once it surfaces. At 2x the offload bench rebuilt every ~60 requests (~0.08 s of
        # 1.4 s), at 8x the stale pops cost far more; 3x and 4x measured alike, ~0.03 s less.
        if len(self._heap) >= max(64, 3 * len(self._inactive)):
            self._rebuild()


def make_policy(name: str) -> EvictionPolicy:
    """The policy called ``name``; a clear error for anything else."""
    if name == "lru":
        return LruPolicy()
    if name == "arc":
        return ArcPolicy()
    if name == "lineage":
        return LineagePolicy()
    if name == "multi_lru":
        return MultiLruPolicy()
    raise ValueError(f"unknown eviction policy {name!r}; expected one of {', '.join(POLICY_NAMES)}")
