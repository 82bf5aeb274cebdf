"""The mock engine's G1 pool: a block pool driven by scheduler signals, no bytes.

It mirrors the KvManager of Dynamo's mocker so that a simulated engine produces the same
KV events a real one would. The scheduler speaks in three signals:

- ``Use(blocks)``: a request needs these blocks now (prompt prefill or a decode step);
- ``Deref(blocks)``: a request let go of these blocks;
- ``Promote(uuid, ...)``: a partial block filled up and now has a sequence hash.

Event contract (what routers and the log see), in the order the changes happen: one
``Removed`` for the blocks a ``Use`` evicted to make room, then one ``Stored`` per run of
blocks it newly placed, its parent anchored to the last reused full block. (Reported the
other way round, a replay of the log up to the ``Stored`` holds more blocks than the pool
has slots.) ``Deref`` emits nothing; reusing an inactive block emits nothing.
"""

from __future__ import annotations

import uuid as uuidlib
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple, TypeAlias

from kvledger.registry.emitter import EventEmitter, EventSink
from kvledger.registry.hashing import TokenBlockSequence
from kvledger.registry.state import RegistryState
from kvledger.registry.tiered import TieredPools


@dataclass(frozen=True, slots=True)
class FullBlock:
    """A full block, named by its sequence hash."""

    seq_hash: int


@dataclass(frozen=True, slots=True)
class PartialBlock:
    """A block still filling up (the tail of a sequence), named by a per-request id."""

    uuid: uuidlib.UUID | int | str


Block: TypeAlias = FullBlock | PartialBlock


@dataclass(frozen=True, slots=True)
class Use:
    blocks: Sequence[Block]
    local_hashes: Sequence[int] = ()
    token_ids: Sequence[Sequence[int]] | None = None
    parent: FullBlock | None = None


@dataclass(frozen=True, slots=True)
class Deref:
    blocks: Sequence[Block]


@dataclass(frozen=True, slots=True)
class Promote:
    uuid: uuidlib.UUID | int | str
    seq_hash: int
    parent_hash: int | None
    local_hash: int
    token_ids: Sequence[int] | None = field(default=None)


MoveBlock: TypeAlias = Use | Deref | Promote


class PrefillCost(NamedTuple):
    new_blocks: int
    new_tokens: int
    cached_tokens: int


class MockG1Pool:
    """G1 bookkeeping for the mock engine. Not thread-safe: one scheduler drives it."""

    def __init__(
        self,
        max_capacity: int,
        block_size: int,
        *,
        eviction: str = "lineage",
        sink: EventSink | None = None,
        worker_id: int = 0,
        dp_rank: int = 0,
    ) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.max_capacity = max_capacity
        self.block_size = block_size
        self.worker_id = worker_id
        self.dp_rank = dp_rank
        self.emitter = EventEmitter(sink, worker_id=worker_id, dp_rank=dp_rank)
        self.tiered = TieredPools(max_capacity, policy=eviction, emitter=self.emitter)
        self.pool = self.tiered.g1
        self._partial: dict[uuidlib.UUID | int | str, int] = {}  # uuid -> mutable slot
        self._active_full: dict[int, int] = {}  # seq hash -> slot, while referenced

    # -- signals -------------------------------------------------------------------------

    def process(self, op: MoveBlock) -> int:
        """Apply one signal. For ``Use``, returns how many of its blocks were placed: fewer
        than asked means G1 ran out, and exactly the first that many blocks are held."""
        if isinstance(op, Use):
            return self._use(op)
        if isinstance(op, Deref):
            self._deref(op.blocks)
            return 0
        if isinstance(op, Promote):
            self._promote(op)
            return 0
        raise TypeError(f"not a G1 pool signal: {op!r}")

    def _use(self, op: Use) -> int:
        blocks = op.blocks
        n_full = sum(1 for b in blocks if isinstance(b, FullBlock))
        if op.local_hashes and len(op.local_hashes) != n_full:
            raise ValueError(f"Use: {len(op.local_hashes)} local hashes for {n_full} full blocks")
        if op.token_ids is not None and len(op.token_ids) != n_full:
            raise ValueError(f"Use: {len(op.token_ids)} token lists for {n_full} full blocks")
        if op.parent is not None and not isinstance(op.parent, FullBlock):
            raise ValueError("Use: the parent block must be a full block")
        for block in blocks:
            if not isinstance(block, FullBlock | PartialBlock):
                raise TypeError(f"Use: not a block: {block!r}")

        pool = self.pool
        # Take every block already present first, so that making room for the new ones can
        # never evict a block this same request is about to reuse.
        hits: list[int | None] = []
        seen_new: set[int] = set()
        for block in blocks:
            if isinstance(block, FullBlock):
                slot = pool.lookup(block.seq_hash)
                if slot is None or block.seq_hash in seen_new:
                    seen_new.add(block.seq_hash)
                    hits.append(None)
                else:
                    hits.append(slot)
            else:
                hits.append(-1 if block.uuid in self._partial else None)
        hit_slots = [s for s in hits if s is not None and s >= 0]
        pool.acquire(hit_slots)
        needed = hits.count(None)

        fresh = pool.allocate_upto(needed)
        placed = len(blocks)
        if len(fresh) < needed:
            # out of room: keep the prefix up to the first new block we could not place
            nth_new = 0
            for i, hit in enumerate(hits):
                if hit is None:
                    if nth_new == len(fresh):
                        placed = i
                        break
                    nth_new += 1
            pool.release([s for s in hits[placed:] if s is not None and s >= 0])
        self._place(op, hits[:placed], fresh)
        return placed

    def _place(self, op: Use, hits: list[int | None], fresh: list[int]) -> None:
        """Register the new full blocks (one chain per contiguous run) and hold partials."""
        local_hashes, token_ids = op.local_hashes, op.token_ids
        prev: int | None = op.parent.seq_hash if op.parent else None
        run_slots: list[int] = []
        run_blocks: list[tuple[int, int]] = []
        run_tokens: list[Sequence[int]] = []
        run_parent = prev
        fresh_iter = iter(fresh)
        full_idx = 0

        def flush() -> None:
            if run_slots:
                slots = self.pool.register(
                    run_slots, run_blocks, run_parent, run_tokens if token_ids else None
                )
                for (seq, _), slot in zip(run_blocks, slots, strict=True):
                    self._active_full[seq] = slot
                run_slots.clear()
                run_blocks.clear()
                run_tokens.clear()

        for block, hit in zip(op.blocks, hits, strict=False):
            if isinstance(block, PartialBlock):
                if hit is None:
                    self._partial[block.uuid] = next(fresh_iter)
                continue
            if hit is None:
                if not run_slots:
                    run_parent = prev
                run_slots.append(next(fresh_iter))
                run_blocks.append((block.seq_hash, local_hashes[full_idx] if local_hashes else 0))
                if token_ids is not None:
                    run_tokens.append(token_ids[full_idx])
            else:
                flush()
                self._active_full[block.seq_hash] = hit
            prev = block.seq_hash
            full_idx += 1
        flush()

    def _deref(self, blocks: Sequence[Block]) -> None:
        # Check everything first: a bad Deref changes nothing.
        wanted = Counter(blocks)
        for block, times in wanted.items():
            if isinstance(block, PartialBlock):
                if block.uuid not in self._partial or times > 1:
                    raise ValueError(f"Deref: partial block {block.uuid} is not in use")
            else:
                slot = self._active_full.get(block.seq_hash)
                if slot is None or self.pool.refcount(slot) < times:
                    raise ValueError(f"Deref: full block {block.seq_hash} is not in use")
        slots: list[int] = []
        for block in blocks:
            if isinstance(block, PartialBlock):
                slots.append(self._partial.pop(block.uuid))
            else:
                slots.append(self._active_full[block.seq_hash])
        self.pool.release(slots)
        for block in wanted:
            if isinstance(block, FullBlock):
                slot = self._active_full[block.seq_hash]
                if not self.pool.refcount(slot):
                    del self._active_full[block.seq_hash]

    def _promote(self, op: Promote) -> None:
        slot = self._partial.pop(op.uuid, None)
        if slot is None:
            raise ValueError(f"Promote: partial block {op.uuid} not found")
        tokens = None if op.token_ids is None else [op.token_ids]
        (held,) = self.pool.register([slot], [(op.seq_hash, op.local_hash)], op.parent_hash, tokens)
        self._active_full[op.seq_hash] = held

    # -- queries -------------------------------------------------------------------------

    def num_active_blocks(self) -> int:
        """Distinct G1 slots in use (full and partial)."""
        return self.pool.num_active

    def num_active_block_refs(self) -> int:
        """References held by requests: a block shared by two requests counts twice."""
        ref = self.pool.refcount
        return len(self._partial) + sum(ref(slot) for slot in self._active_full.values())

    def num_inactive_blocks(self) -> int:
        return self.pool.num_inactive

    def active_blocks(self) -> dict[Block, int]:
        ref = self.pool.refcount
        out: dict[Block, int] = {FullBlock(seq): ref(s) for seq, s in self._active_full.items()}
        out.update({PartialBlock(u): 1 for u in self._partial})
        return out

    def inactive_blocks(self) -> list[FullBlock]:
        """Cached blocks nobody uses, in eviction order (first = next to go)."""
        info = self.pool.block_info
        return [FullBlock(info(slot).sequence_hash) for slot in self.pool.inactive_slots()]

    def get_active_perc(self) -> float:
        return self.num_active_blocks() / self.max_capacity

    def probe_new_blocks(self, blocks: Sequence[Block]) -> int:
        """How many fresh slots a ``Use`` of ``blocks`` would need."""
        count = 0
        for block in blocks:
            if isinstance(block, FullBlock):
                if block.seq_hash not in self.pool:
                    count += 1
            elif block.uuid not in self._partial:
                count += 1
        return count

    def prefill_cost(self, tokens: Sequence[int]) -> PrefillCost:
        """What prefilling ``tokens`` would cost given the blocks cached now."""
        sequence = TokenBlockSequence(tokens, self.block_size)
        overlap = self.pool.probe(sequence.sequence_hashes)
        total_blocks = -(-len(tokens) // self.block_size)
        cached = min(overlap * self.block_size, len(tokens))
        return PrefillCost(total_blocks - overlap, len(tokens) - cached, cached)

    def registry_state(self) -> RegistryState:
        """The live state, comparable with a replay of this manager's events."""
        return self.tiered.state()
