"""A pool of block slots for one tier, and the lifecycle of each slot.

    free --allocate--> mutable --register(hash)--> active (refcount >= 1)
    active --release to 0--> inactive (matchable, evictable) --evict--> free
    inactive --match--> active

The pool is pure bookkeeping: slots are integers, bytes live elsewhere (``tiers``). State is
kept in flat per-slot lists rather than per-block objects, and every operation takes a whole
request's blocks at once, because engines call this on every scheduling step and per-block
Python objects would dominate the cost.

The per-block loops of ``match``, ``register``, ``release`` and eviction run compiled where
``registry/_pool.c`` was built (``COMPILED``), over the same lists and dicts: the Python loops
below stay the reference, and take over wherever the compiled ones leave a case to them.
"""

from __future__ import annotations

import os
import sys
from array import array
from collections.abc import Iterable, Sequence
from operator import length_hint

from kvledger.events.types import BlockInfo, HashKey, Tier
from kvledger.registry.emitter import BlockTokens, EventEmitter
from kvledger.registry.errors import PoolBusy, PoolExhausted
from kvledger.registry.policies import EvictionPolicy, make_policy

__all__ = ["BlockPool", "PoolBusy", "PoolExhausted"]

try:
    from kvledger.registry import _pool
except ImportError:  # the Python loops serve
    COMPILED = False
else:
    COMPILED = os.environ.get("KVLEDGER_PYTHON_POOL", "") in ("", "0")
"""Whether new pools run their per-block loops compiled (``registry/_pool.c``): about 1.5 times
the block operations a second on bench/registry_bench.py (what is left is mostly the dict and
OrderedDict work itself, and the events), with the same results, events and state
(``tests/test_pool_compiled.py`` holds the two to that). False where the module was not built
(no C compiler at install) or ``KVLEDGER_PYTHON_POOL=1`` is in the environment (to measure the
Python loops, or to rule the compiled ones out)."""


def token_bytes(tokens: BlockTokens) -> bytes:
    """One block's token ids as little-endian u32 bytes: the form a pool keeps them in (one
    small bytes object per block, shared by every tier holding a copy of it)."""
    if isinstance(tokens, bytes):
        return tokens
    try:
        packed = array("I", tokens)
    except (OverflowError, TypeError):
        raise ValueError(f"token ids must be integers in [0, 2**32), got {tokens!r:.60}") from None
    if sys.byteorder == "big":  # pragma: no cover - kvledger runs on little-endian hosts
        packed.byteswap()
    return packed.tobytes()


class BlockPool:
    """``capacity`` slots of one tier with refcounts, dedup by sequence hash and eviction.

    Events: ``register`` emits one ``Stored`` per contiguous run of newly registered blocks
    (duplicates emit nothing); evictions emit one ``Removed`` per operation; ``clear`` emits
    ``Cleared``. Each event is emitted as soon as the change it reports is made, before the
    next change: a fold of the events up to any one of them is the pool as it was right then
    (so no replayed prefix ever holds more blocks than the pool has slots).
    """

    def __init__(
        self,
        capacity: int,
        *,
        tier: Tier = Tier.G1,
        policy: str | EvictionPolicy = "lru",
        emitter: EventEmitter | None = None,
        fresh_first: bool = False,
    ) -> None:
        """``fresh_first`` hands out never-used slots (lowest first) before any freed one, and
        freed ones last-freed first: the slot order vLLM's CPU offloading manager gives its
        chunks, which an engine may expect of a store that stands in for it."""
        if not isinstance(capacity, int) or capacity <= 0:
            raise ValueError(f"pool capacity must be a positive integer, got {capacity!r}")
        self.capacity = capacity
        self.tier = tier
        self.emitter = emitter if emitter is not None else EventEmitter()
        self._ref = [0] * capacity
        self._hash: list[int | None] = [None] * capacity
        self._local = [0] * capacity
        self._parent: list[int | None] = [None] * capacity
        # what routers need to name a block themselves: its tokens and (lora, salt)
        self._tokens: list[bytes | None] = [None] * capacity
        self._keys: list[HashKey | None] = [None] * capacity
        # whether any slot was given tokens or a key: until then an eviction has none to clear
        self._carries_tokens = False
        self._by_hash: dict[int, int] = {}
        # popped from the end, so slot 0 is handed out first
        self._free = list(range(capacity - 1, -1, -1))
        self._fresh_first = fresh_first
        # with fresh_first: how many never-used slots sit at the top of _free
        self._unused = capacity if fresh_first else 0
        self._policy = make_policy(policy) if isinstance(policy, str) else policy
        self._policy.bind(capacity)
        self._compiled = COMPILED

    # -- queries -------------------------------------------------------------------------

    @property
    def policy(self) -> EvictionPolicy:
        return self._policy

    @property
    def num_free(self) -> int:
        """Slots holding nothing."""
        return len(self._free)

    @property
    def num_inactive(self) -> int:
        """Registered blocks nobody references: cached, evictable."""
        return self._policy.evictable()

    @property
    def num_active(self) -> int:
        """Slots referenced by someone: mutable (filling) or registered and in use."""
        return self.capacity - len(self._free) - self._policy.evictable()

    @property
    def num_registered(self) -> int:
        return len(self._by_hash)

    def lookup(self, sequence_hash: int) -> int | None:
        """The slot holding ``sequence_hash``, without touching its refcount."""
        return self._by_hash.get(sequence_hash)

    def __contains__(self, sequence_hash: object) -> bool:
        return sequence_hash in self._by_hash

    def refcount(self, slot: int) -> int:
        return self._ref[slot]

    def block_info(self, slot: int) -> BlockInfo:
        seq = self._hash[slot]
        if seq is None:
            raise ValueError(f"{self.tier.name} slot {slot} holds no registered block")
        return BlockInfo(seq, self._local[slot], self._parent[slot])

    def tokens_of(self, slots: Sequence[int]) -> list[bytes | None]:
        """The token ids (little-endian u32 bytes) of registered ``slots``; None where unknown."""
        tokens = self._tokens
        return [tokens[slot] for slot in slots]

    def keys_of(self, slots: Sequence[int]) -> list[HashKey | None]:
        """The ``(lora_name, salt)`` of registered ``slots``; None for plain blocks."""
        keys = self._keys
        return [keys[slot] for slot in slots]

    def count_inactive(self, sequence_hashes: Iterable[int]) -> int:
        """How many of ``sequence_hashes`` are cached and referenced by nobody (evictable)."""
        by_hash, ref = self._by_hash, self._ref
        return sum(
            1 for seq in sequence_hashes if (slot := by_hash.get(seq)) is not None and not ref[slot]
        )

    def probe(self, sequence_hashes: Iterable[int]) -> int:
        """Length of the cached prefix of ``sequence_hashes``; changes nothing."""
        by_hash = self._by_hash
        n = 0
        for seq in sequence_hashes:
            if seq not in by_hash:
                break
            n += 1
        return n

    def resident_blocks(self) -> dict[int, tuple[int, int | None]]:
        """Every registered block as ``{sequence_hash: (local_hash, parent_hash)}``."""
        local, parent = self._local, self._parent
        return {seq: (local[slot], parent[slot]) for seq, slot in self._by_hash.items()}

    def inactive_slots(self) -> list[int]:
        """Inactive slots in the order the policy would evict them (roughly, for multi_lru)."""
        return self._policy.inactive_order()

    # -- lifecycle -----------------------------------------------------------------------

    def match(self, sequence_hashes: Iterable[int]) -> list[int]:
        """Take a reference on the longest cached prefix of ``sequence_hashes``.

        The first miss ends the prefix. Returns the slots; release them when done.
        """
        ref, policy = self._ref, self._policy
        revived: list[int] = []
        queue = policy.queue
        if self._compiled:
            slots = _pool.match(self._by_hash, ref, queue, revived, sequence_hashes)
        else:
            slots = []
            # a revived block leaves the policy's queue here, or is collected for ``activated``
            revive = revived.append if queue is None else queue.pop
            for slot in map(self._by_hash.get, sequence_hashes):  # the lookups called from C
                if slot is None:
                    break
                count = ref[slot]
                if not count:
                    revive(slot)
                ref[slot] = count + 1
                slots.append(slot)
        if revived:
            policy.activated(revived)
        if policy.tracks_access and slots:
            policy.accessed(slots)
        return slots

    def missed(self, sequence_hashes: Sequence[int]) -> None:
        """The engine asked for these blocks and the pool holds none of them: the policy may
        learn from it (ARC moves its target on a block it evicted lately)."""
        self._policy.missed(sequence_hashes)

    def acquire(self, slots: Sequence[int], *, use: bool = True) -> None:
        """Take one more reference on each registered slot (the engine shares a block).

        ``use=False`` pins without counting a use (an engine that reports its uses itself,
        as vLLM's offloading manager does at the end of each request)."""
        ref, hashes = self._ref, self._hash
        for slot in slots:
            if hashes[slot] is None:
                raise ValueError(f"{self.tier.name} slot {slot} holds no registered block")
        revived = [slot for slot in slots if not ref[slot]]
        for slot in slots:
            ref[slot] += 1
        if revived:
            self._policy.activated(revived)
        if use and self._policy.tracks_access and slots:
            self._policy.accessed(slots)

    def allocate(self, count: int) -> list[int]:
        """``count`` fresh mutable slots (refcount 1), evicting inactive blocks as needed.

        Raises ``PoolExhausted`` and hands out nothing when ``count`` cannot be met.
        """
        free = self._free
        if count > len(free):
            if count > len(free) + self._policy.evictable():
                raise PoolExhausted(self.tier.name, count, len(free) + self._policy.evictable())
            self._evict(count - len(free))
            if count > len(free):
                raise PoolExhausted(self.tier.name, count, len(free))
        return self._take_free(count)

    def allocate_upto(self, count: int) -> list[int]:
        """Like ``allocate`` but returns as many slots as could be had (maybe fewer, maybe none)."""
        free = self._free
        if count > len(free):
            self._evict(count - len(free))
        return self._take_free(min(count, len(free)))

    def _take_free(self, count: int) -> list[int]:
        if count <= 0:
            return []
        free, ref = self._free, self._ref
        slots = free[-count:]
        del free[-count:]
        if self._fresh_first:
            slots.reverse()  # the order one pop at a time would give
            self._unused = max(0, self._unused - count)
        if self._compiled:
            _pool.take(ref, slots)
        else:
            for slot in slots:
                ref[slot] = 1
        return slots

    def register(
        self,
        slots: Sequence[int],
        blocks: Sequence[tuple[int, int]],
        parent_hash: int | None = None,
        token_ids: Sequence[BlockTokens] | None = None,
        key: HashKey | None = None,
    ) -> list[int]:
        """Name filled mutable ``slots`` with ``blocks`` = [(sequence_hash, local_hash)], a chain.

        ``parent_hash`` is the sequence hash of the block before the first one. A block whose
        hash the pool already holds is deduplicated: its new slot is freed and the existing one
        gains the reference instead. Returns the slots now holding the blocks, in order.
        ``token_ids`` (one per block) and ``key`` (the LoRA name and salt that seeded the hashes)
        are kept with each block for routers, and go out with every event that names it.
        """
        if len(slots) != len(blocks):
            raise ValueError(f"register: {len(slots)} slots for {len(blocks)} blocks")
        if token_ids is not None and len(token_ids) != len(blocks):
            raise ValueError(f"register: {len(token_ids)} token lists for {len(blocks)} blocks")
        packed: list[bytes] | None = None
        if token_ids is not None:
            packed = list(map(token_bytes, token_ids))
        ref, hashes, local_of, parent_of = self._ref, self._hash, self._local, self._parent
        by_hash = self._by_hash
        # The common case first: every block is new. This loop is the pool's hottest (every
        # block an engine computes passes here once), so it checks each slot and names it in
        # one pass; the first block the pool already holds hands the rest to
        # _register_known, which first puts back what was named here if a later slot fails.
        # The compiled loop names the plain new blocks first; this one goes on from where
        # it stopped (a refused slot, a block held already, anything but the plain case).
        start = 0
        if self._compiled:
            start = _pool.name_new(
                ref, hashes, local_of, parent_of, by_hash, slots, blocks, parent_hash
            )
        parent = blocks[start - 1][0] if start else parent_hash
        for i, slot in enumerate(slots[start:], start) if start else enumerate(slots):
            seq, local = blocks[i]
            if hashes[slot] is not None or not ref[slot]:
                self._unname(slots[:i], blocks[:i])
                raise ValueError(f"register: {self.tier.name} slot {slot} is not a mutable block")
            if by_hash.setdefault(seq, slot) != slot:  # held already: one lookup tells
                return self._register_known(slots, blocks, parent_hash, packed, key, i)
            hashes[slot] = seq
            local_of[slot] = local
            parent_of[slot] = parent
            parent = seq
        if not blocks:
            return []
        if packed is not None:
            self._put_tokens(slots, packed, key)
        if self._policy.queue is None:  # a queue (LRU) learns of a block when it is released
            seqs = [seq for seq, _ in blocks]
            self._policy.registered(slots, seqs, [parent_hash, *seqs[:-1]])
        self.emitter.stored(self.tier, parent_hash, blocks, packed, key)
        return list(slots)

    def _unname(self, slots: Sequence[int], blocks: Sequence[tuple[int, int]]) -> None:
        """Undo what ``register`` named of ``slots`` before it found a slot it must refuse."""
        by_hash, hashes = self._by_hash, self._hash
        for slot, (seq, _) in zip(slots, blocks, strict=True):
            del by_hash[seq]
            hashes[slot] = None

    def _register_known(
        self,
        slots: Sequence[int],
        blocks: Sequence[tuple[int, int]],
        parent_hash: int | None,
        packed: list[bytes] | None,
        key: HashKey | None,
        named: int,
    ) -> list[int]:
        """``register`` from the first block the pool already holds (at ``named``; the blocks
        before it were named by ``register``): duplicates are resolved, each run of new blocks
        is reported as it ends."""
        ref, hashes, local_of, parent_of = self._ref, self._hash, self._local, self._parent
        by_hash = self._by_hash
        for slot in slots[named:]:
            if hashes[slot] is not None or not ref[slot]:
                self._unname(slots[:named], blocks[:named])
                raise ValueError(f"register: {self.tier.name} slot {slot} is not a mutable block")
        if len(set(slots)) != len(slots):
            # a slot given twice: its first use could free it (a held block), the second name
            # it; the loop that names blocks one by one refuses it, this one must ask
            twice = next(slot for i, slot in enumerate(slots) if slot in slots[:i])
            self._unname(slots[:named], blocks[:named])
            raise ValueError(f"register: {self.tier.name} slot {twice} is not a mutable block")
        out = list(slots)
        new = list(slots[:named])
        new_hashes = [seq for seq, _ in blocks[:named]]
        new_parents = [parent_hash, *new_hashes[:-1]] if named else []
        if packed is not None:
            self._put_tokens(new, packed[:named], key)  # (and the rest below)
        duplicates: list[int] = []
        run_start, run_parent = (0, parent_hash) if named else (-1, parent_hash)
        prev = new_hashes[-1] if named else parent_hash
        for i in range(named, len(slots)):
            slot = slots[i]
            seq, local = blocks[i]
            existing = by_hash.get(seq)
            if existing is None:
                by_hash[seq] = slot
                hashes[slot] = seq
                local_of[slot] = local
                parent_of[slot] = prev
                if packed is not None:
                    self._put_tokens([slot], [packed[i]], key)
                new.append(slot)
                new_hashes.append(seq)
                new_parents.append(prev)
                if run_start < 0:
                    run_start, run_parent = i, prev
            else:
                out[i] = existing
                duplicates.append(existing)
                ref[slot] -= 1
                if not ref[slot]:
                    self._give_back([slot])
                if run_start >= 0:  # a run of new blocks ends here: report it now
                    self._stored_run(run_parent, blocks, packed, key, run_start, i)
                    run_start = -1
            prev = seq
        if run_start >= 0:
            self._stored_run(run_parent, blocks, packed, key, run_start, len(slots))
        if new:
            self._policy.registered(new, new_hashes, new_parents)
        if duplicates:
            self.acquire(duplicates)
        return out

    def _stored_run(
        self,
        parent: int | None,
        blocks: Sequence[tuple[int, int]],
        token_ids: Sequence[bytes] | None,
        key: HashKey | None,
        start: int,
        end: int,
    ) -> None:
        self.emitter.stored(
            self.tier,
            parent,
            blocks[start:end],
            None if token_ids is None else token_ids[start:end],
            key,
        )

    def _put_tokens(
        self, slots: Sequence[int], tokens: Sequence[bytes | None], key: HashKey | None
    ) -> None:
        own, keys = self._tokens, self._keys
        self._carries_tokens = True
        for slot, block_tokens in zip(slots, tokens, strict=True):
            own[slot] = block_tokens
            keys[slot] = key

    def register_copies(
        self,
        slots: Sequence[int],
        blocks: Sequence[BlockInfo],
        src_tier: Tier,
        tokens: Sequence[bytes | None] | None = None,
        keys: Sequence[HashKey | None] | None = None,
    ) -> list[int]:
        """Register blocks copied here from ``src_tier``; emits Offloaded/Onboarded, not Stored.

        Unlike ``register`` the blocks need not form a chain: each carries its own parent.
        Returns the slots now holding the blocks (duplicates resolved as in ``register``).
        ``tokens`` and ``keys``, one per block, are what the source tier kept of each.
        """
        if len(slots) != len(blocks):
            raise ValueError(f"register_copies: {len(slots)} slots for {len(blocks)} blocks")
        for name, given in (("token lists", tokens), ("hash keys", keys)):
            if given is not None and len(given) != len(blocks):
                raise ValueError(f"register_copies: {len(given)} {name} for {len(blocks)} blocks")
        ref, hashes, by_hash = self._ref, self._hash, self._by_hash
        for slot in slots:
            if hashes[slot] is not None or not ref[slot]:
                raise ValueError(f"register_copies: {self.tier.name} slot {slot} is not mutable")
        if tokens is not None or keys is not None:
            self._carries_tokens = True
        out = list(slots)
        new: list[int] = []
        landed: list[BlockInfo] = []
        landed_tokens: list[bytes | None] = []
        landed_keys: list[HashKey | None] = []
        duplicates: list[int] = []
        for i, (slot, info) in enumerate(zip(slots, blocks, strict=True)):
            existing = by_hash.get(info.sequence_hash)
            if existing is None:
                by_hash[info.sequence_hash] = slot
                hashes[slot] = info.sequence_hash
                self._local[slot] = info.local_hash
                self._parent[slot] = info.parent_hash
                block_tokens = None if tokens is None else tokens[i]
                block_key = None if keys is None else keys[i]
                self._tokens[slot] = block_tokens
                self._keys[slot] = block_key
                new.append(slot)
                landed.append(info)
                landed_tokens.append(block_tokens)
                landed_keys.append(block_key)
            else:
                out[i] = existing
                duplicates.append(existing)
                ref[slot] -= 1
                if not ref[slot]:
                    self._give_back([slot])
        if new:
            self._policy.registered(
                new, [b.sequence_hash for b in landed], [b.parent_hash for b in landed]
            )
        if duplicates:
            self.acquire(duplicates)
        self.emitter.copied(
            src_tier,
            self.tier,
            landed,
            None if tokens is None else landed_tokens,
            None if keys is None else landed_keys,
        )
        return out

    def adopt(
        self,
        slots: Sequence[int],
        blocks: Sequence[BlockInfo],
        tokens: Sequence[bytes | None] | None = None,
    ) -> None:
        """Take blocks that already sit in free ``slots`` of this tier's storage -- a restarted
        worker's disk cache, which its log lists already -- as inactive (cached, evicted in
        the order given). Emits nothing: the events that put them here are in the log.
        """
        if len(slots) != len(blocks):
            raise ValueError(f"adopt: {len(slots)} slots for {len(blocks)} blocks")
        taken = set(slots)
        free = set(self._free)
        seqs = {info.sequence_hash for info in blocks}
        if len(taken) != len(slots) or len(seqs) != len(blocks):
            raise ValueError("adopt: a slot or a block appears twice")
        for slot, info in zip(slots, blocks, strict=True):
            if slot not in free:
                raise ValueError(f"adopt: {self.tier.name} slot {slot} is not free")
            if info.sequence_hash in self._by_hash:
                raise ValueError(f"adopt: block {info.sequence_hash} is already registered")
        self._free = [slot for slot in self._free if slot not in taken]
        self._unused = 0  # adopted slots break the fresh run; order no longer holds
        for slot, info in zip(slots, blocks, strict=True):
            self._by_hash[info.sequence_hash] = slot
            self._hash[slot] = info.sequence_hash
            self._local[slot] = info.local_hash
            self._parent[slot] = info.parent_hash
        if tokens is not None:
            self._put_tokens(slots, tokens, None)
        self._policy.registered(
            slots, [b.sequence_hash for b in blocks], [b.parent_hash for b in blocks]
        )
        self._policy.released(slots)

    def release(self, slots: Iterable[int]) -> None:
        """Drop one reference per slot. At zero a registered block becomes inactive (cached,
        evictable, in the order given) and a never-registered one becomes free."""
        ref, hashes, free = self._ref, self._hash, self._free
        order = slots if isinstance(slots, list) else list(slots)
        # Blocks that become inactive go straight into the policy's queue where it has one,
        # else into a dict (ordered, like the queue) handed to ``released`` at the end.
        queue = self._policy.queue
        inactive: dict[int, None] = {} if queue is None else queue
        # The compiled loop releases the plain slots first; this one goes on from where it
        # stopped (an over-release, a slot for below the never-used run, an odd slot).
        start = 0
        if self._compiled:
            start = _pool.release(ref, hashes, free, inactive, order, self._unused)
        # an iterator rather than enumerate: only a failure needs the position, and a list
        # iterator knows how many items it has left
        remaining = iter(order[start:] if start else order)
        for slot in remaining:
            count = ref[slot] - 1
            if count < 0:
                done = len(order) - length_hint(remaining) - 1
                self._undo_release(order[:done], inactive)
                raise ValueError(
                    f"release: {self.tier.name} slot {slot} released more often than taken"
                )
            ref[slot] = count
            if not count:
                if hashes[slot] is None:
                    if self._unused:
                        self._give_back([slot])
                    else:
                        free.append(slot)
                else:
                    inactive[slot] = None
        if queue is None and inactive:
            self._policy.released(list(inactive))

    def _undo_release(self, done: list[int], inactive: dict[int, None]) -> None:
        """Put back the references a failed ``release`` already dropped."""
        ref, hashes = self._ref, self._hash
        for slot in reversed(done):
            if not ref[slot]:
                if hashes[slot] is None:
                    self._free.remove(slot)
                else:
                    del inactive[slot]
            ref[slot] += 1

    def remove(self, sequence_hashes: Iterable[int]) -> list[int]:
        """Drop inactive blocks by hash (e.g. a corrupt copy). Active or unknown ones are kept.

        Returns the hashes that were removed; emits Removed for them.
        """
        by_hash, ref = self._by_hash, self._ref
        slots = [
            slot
            for seq in sequence_hashes
            if (slot := by_hash.get(seq)) is not None and not ref[slot]
        ]
        if not slots:
            return []
        self._policy.forget(slots)
        return self._drop(slots)

    def _give_back(self, slots: list[int]) -> None:
        """Free ``slots``: on top of the free stack, or just below the never-used run."""
        if self._unused:
            at = len(self._free) - self._unused
            self._free[at:at] = slots
        else:
            self._free.extend(slots)

    def _evict(self, count: int) -> None:
        queue = self._policy.queue
        if self._compiled and queue is not None:  # its oldest entries: what LRU picks
            victims = _pool.oldest(queue, count)
        else:
            victims = self._policy.pick_victims(count)
        if victims:
            self._drop(victims)

    def _drop(self, slots: list[int]) -> list[int]:
        by_hash, hashes, tokens, keys = self._by_hash, self._hash, self._tokens, self._keys
        gone: list[int]
        if self._compiled:
            gone = _pool.drop(by_hash, hashes, slots)
        else:
            gone = []
            for slot in slots:
                seq = hashes[slot]
                assert seq is not None
                del by_hash[seq]
                hashes[slot] = None
                gone.append(seq)
        if self._carries_tokens:
            for slot in slots:
                tokens[slot] = keys[slot] = None
        self._give_back(slots)
        self.emitter.removed(self.tier, gone)
        return gone

    def clear(self) -> None:
        """Drop every cached block. Refuses while any block is in use."""
        busy = self.num_active
        if busy:
            raise PoolBusy(f"cannot clear {self.tier.name}: {busy} blocks are in use")
        self._policy.clear()
        self._by_hash.clear()
        self._hash = [None] * self.capacity
        self._parent = [None] * self.capacity
        self._tokens = [None] * self.capacity
        self._keys = [None] * self.capacity
        self._carries_tokens = False
        self._free = list(range(self.capacity - 1, -1, -1))
        self._unused = self.capacity if self._fresh_first else 0
        self.emitter.cleared(self.tier)
