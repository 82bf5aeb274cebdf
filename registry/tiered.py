"""One worker's G1/G2/G3 pools and the rules that move blocks between them.

This is the bookkeeping half of the block manager: it decides which slots a copy reads and
writes and records the outcome, but never touches bytes. A caller that moves real bytes
(``kvledger.BlockManager``) executes each ``CopyPlan`` and then calls ``complete`` (with how
many blocks arrived) or ``abort``; the simulator completes them at once. Either way the events
are the same. Every state change of the worker's cache goes through here: copies, blocks read
from another worker (G4), a restart; ``state()`` is what the event log must replay to.

Offload rules: every block registered on G1 is written through to G2 (or, with no G2, to G3
directly -- Dynamo's bypass). A block goes from G2 down to G3 only when the offload filter
lets it: ``always``, ``seen_twice`` (its prefix has been requested at least twice, so disk
writes go to blocks likely to come back) or ``never``.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from kvledger.events.types import BlockInfo, HashKey, Tier
from kvledger.registry.emitter import LOCAL_TIERS, EventEmitter
from kvledger.registry.policies import FrequencySketch
from kvledger.registry.pool import BlockPool
from kvledger.registry.state import RegistryState

OFFLOAD_FILTERS = ("always", "seen_twice", "never")


class MatchResult(NamedTuple):
    """How a prompt's longest cached prefix splits over the tiers, in order G1, G2, G3."""

    g1: int
    g2: int
    g3: int

    @property
    def total(self) -> int:
        return self.g1 + self.g2 + self.g3


@dataclass(slots=True)
class CopyPlan:
    """A planned copy of blocks between two tiers: source slots pinned, destination slots
    allocated (mutable) until ``complete`` or ``abort``."""

    src_tier: Tier
    dst_tier: Tier
    src_slots: list[int]
    dst_slots: list[int]
    blocks: list[BlockInfo]
    #: slots now holding the blocks on dst, filled by ``complete``
    landed: list[int] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.blocks)


class TieredPools:
    """Pools for G1 and the optional G2/G3 of one worker, sharing one event emitter."""

    def __init__(
        self,
        g1_blocks: int,
        g2_blocks: int = 0,
        g3_blocks: int = 0,
        *,
        policy: str = "lineage",
        offload_filter: str = "seen_twice",
        emitter: EventEmitter | None = None,
    ) -> None:
        if offload_filter not in OFFLOAD_FILTERS:
            raise ValueError(
                f"unknown offload filter {offload_filter!r}; expected one of "
                + ", ".join(OFFLOAD_FILTERS)
            )
        self.emitter = emitter if emitter is not None else EventEmitter()
        self.offload_filter = offload_filter
        self.pools: dict[Tier, BlockPool] = {
            Tier.G1: BlockPool(g1_blocks, tier=Tier.G1, policy=policy, emitter=self.emitter)
        }
        for tier, blocks in ((Tier.G2, g2_blocks), (Tier.G3, g3_blocks)):
            if blocks:
                self.pools[tier] = BlockPool(blocks, tier=tier, policy="lru", emitter=self.emitter)
        self._seen = FrequencySketch(g1_blocks + g2_blocks + g3_blocks)
        # Only the seen_twice filter guarding a disk tier reads the counts.
        self._counts_requests = offload_filter == "seen_twice" and Tier.G3 in self.pools

    def resume(self, last_event_id: int, keep: Collection[Tier] = ()) -> None:
        """Continue a log that an earlier run of this worker wrote up to ``last_event_id``
        (-1: none; nothing is said then): the ids go on from there, and a ``Cleared`` for
        every local tier, configured here or not, makes the log replay to this registry and
        not to what the earlier run (maybe with a G2 or G3 this one lacks) left there.

        Tiers in ``keep`` are left as they are: a disk cache the restart recovered already
        holds exactly what the earlier run's log lists for it (less what was dropped, which
        the caller reports as ``Removed``).
        """
        if last_event_id >= 0:
            pools = [(tier, pool) for tier, pool in self.pools.items() if tier not in keep]
            held = [tier.name for tier, pool in pools if pool.num_registered]
            if held:
                raise ValueError(f"resume on a registry that holds blocks ({held})")
        cleared = [tier for tier in LOCAL_TIERS if tier not in keep]
        self.emitter.resume(last_event_id, clear=cleared)

    def state(self) -> RegistryState:
        """The live state, as the event log replays to it (for checks and dumps)."""
        worker = self.emitter.worker_id
        return RegistryState.from_mapping(
            {(worker, tier): pool.resident_blocks() for tier, pool in self.pools.items()}
        )

    def counts(self) -> dict[Tier, int]:
        """Blocks registered on each configured tier."""
        return {tier: pool.num_registered for tier, pool in self.pools.items()}

    def in_use(self) -> dict[Tier, int]:
        """Blocks held (referenced) on each configured tier: by requests or copies in flight."""
        return {tier: pool.num_active for tier, pool in self.pools.items()}

    def capacities(self) -> dict[Tier, int]:
        """Slots of each configured tier."""
        return {tier: pool.capacity for tier, pool in self.pools.items()}

    @property
    def g1(self) -> BlockPool:
        return self.pools[Tier.G1]

    def lower_tiers(self) -> list[Tier]:
        return [t for t in (Tier.G2, Tier.G3) if t in self.pools]

    # -- lookups -------------------------------------------------------------------------

    def match(self, sequence_hashes: Sequence[int]) -> MatchResult:
        """Longest cached prefix: blocks on G1, then how far G2 continues it, then G3."""
        if len(self.pools) == 1:  # G1 alone (the mock engine's usual cache)
            return MatchResult(self.pools[Tier.G1].probe(sequence_hashes), 0, 0)
        counts = {Tier.G1: 0, Tier.G2: 0, Tier.G3: 0}
        start = 0
        for tier in (Tier.G1, Tier.G2, Tier.G3):
            pool = self.pools.get(tier)
            if pool is not None and start < len(sequence_hashes):
                n = pool.probe(sequence_hashes[start:])
                counts[tier] = n
                start += n
        return MatchResult(counts[Tier.G1], counts[Tier.G2], counts[Tier.G3])

    def note_request(self, sequence_hashes: Sequence[int]) -> None:
        """Count one request for each block of a prompt (feeds the ``seen_twice`` filter)
        and refresh the prompt's copies on G2/G3, so the lower tiers age blocks by use
        rather than by when they were first written."""
        if self._counts_requests:
            increment = self._seen.increment
            for seq in sequence_hashes:
                increment(seq)
        for tier in (Tier.G2, Tier.G3):
            pool = self.pools.get(tier)
            if pool is not None:
                held = [s for seq in sequence_hashes if (s := pool.lookup(seq)) is not None]
                if held:
                    pool.acquire(held)
                    pool.release(reversed(held))

    # -- onboarding ----------------------------------------------------------------------

    def plan_onboard(self, sequence_hashes: Sequence[int], match: MatchResult) -> list[CopyPlan]:
        """Copies that bring the G2/G3 part of ``match`` into fresh G1 slots.

        ``sequence_hashes`` is the whole prompt; the blocks after ``match.g1`` are onboarded.
        Fewer G1 slots than needed shortens the onboard to a prefix (never a hole).
        """
        wanted = match.g2 + match.g3
        if not wanted:
            return []
        g1 = self.g1
        dst = g1.allocate_upto(wanted)
        plans: list[CopyPlan] = []
        start = match.g1
        remaining = dst
        for tier, count in ((Tier.G2, match.g2), (Tier.G3, match.g3)):
            count = min(count, len(remaining))
            if not count:
                continue
            pool = self.pools[tier]
            hashes = sequence_hashes[start : start + count]
            src = pool.match(hashes)
            if len(src) < count:  # the lower tier lost blocks since match(): stop there
                g1.release(remaining[len(src) :])
                remaining = remaining[: len(src)]
                count = len(src)
            if count:
                infos = [pool.block_info(s) for s in src]
                plans.append(CopyPlan(tier, Tier.G1, src, remaining[:count], infos))
            remaining = remaining[count:]
            start += count
            if count < (match.g2 if tier is Tier.G2 else match.g3):
                break
        if remaining:
            g1.release(remaining)
        return plans

    # -- offloading ----------------------------------------------------------------------

    def plan_offload(self, g1_slots: Sequence[int]) -> list[CopyPlan]:
        """Write-through copies for blocks just registered on G1 (to G2, or to G3 with no G2)."""
        if Tier.G2 in self.pools:
            return self._plan_copy(Tier.G1, Tier.G2, g1_slots)
        if Tier.G3 in self.pools:
            return self._plan_copy(Tier.G1, Tier.G3, self._filtered(Tier.G1, g1_slots))
        return []

    def _filtered(self, tier: Tier, slots: Sequence[int]) -> list[int]:
        if self.offload_filter == "always":
            return list(slots)
        if self.offload_filter == "never":
            return []
        info, estimate = self.pools[tier].block_info, self._seen.estimate
        return [s for s in slots if estimate(info(s).sequence_hash) >= 2]

    def _plan_copy(self, src_tier: Tier, dst_tier: Tier, slots: Sequence[int]) -> list[CopyPlan]:
        src_pool, dst_pool = self.pools[src_tier], self.pools[dst_tier]
        infos = [src_pool.block_info(s) for s in slots]
        todo = [
            (slot, info)
            for slot, info in zip(slots, infos, strict=True)
            if info.sequence_hash not in dst_pool
        ]
        if not todo:
            return []
        dst = dst_pool.allocate_upto(len(todo))
        if not dst:
            return []  # everything on dst is pinned by copies in flight: skip, not an error
        todo = todo[: len(dst)]
        src = [slot for slot, _ in todo]
        src_pool.acquire(src)
        return [CopyPlan(src_tier, dst_tier, src, dst, [info for _, info in todo])]

    # -- completion ----------------------------------------------------------------------

    def complete(self, plan: CopyPlan, arrived: int | None = None) -> list[CopyPlan]:
        """Record a finished copy of which the first ``arrived`` blocks (default: all)
        arrived intact. Returns follow-up copies (G2 -> G3 behind the filter).

        The blocks after ``arrived`` are aborted; when they were read from G3, the disk
        copy is corrupt and G3 forgets them. ``plan.landed`` lists the slots now holding
        the arrived blocks on the destination. Blocks onboarded into G1 stay referenced
        (the request that asked holds them); copies to G2/G3 become inactive there, cached
        and evictable.
        """
        good = len(plan) if arrived is None else max(0, min(arrived, len(plan)))
        if good < len(plan):
            bad = plan.blocks[good:]
            self.abort(
                CopyPlan(
                    plan.src_tier, plan.dst_tier, plan.src_slots[good:], plan.dst_slots[good:], bad
                )
            )
            if plan.src_tier is Tier.G3:  # the disk copy is corrupt: forget it
                self.pools[Tier.G3].remove([b.sequence_hash for b in bad])
            if not good:
                plan.landed = []
                return []
            part = CopyPlan(
                plan.src_tier,
                plan.dst_tier,
                plan.src_slots[:good],
                plan.dst_slots[:good],
                plan.blocks[:good],
            )
            follow = self._complete(part)
            plan.landed = part.landed
            return follow
        return self._complete(plan)

    def _complete(self, plan: CopyPlan) -> list[CopyPlan]:
        src_pool = self.pools[plan.src_tier]
        dst_pool = self.pools[plan.dst_tier]
        # the source slots are pinned until here: what they kept of each block travels along
        plan.landed = dst_pool.register_copies(
            plan.dst_slots,
            plan.blocks,
            plan.src_tier,
            src_pool.tokens_of(plan.src_slots),
            src_pool.keys_of(plan.src_slots),
        )
        src_pool.release(plan.src_slots)
        follow: list[CopyPlan] = []
        if plan.dst_tier is not Tier.G1:
            if plan.dst_tier is Tier.G2 and Tier.G3 in self.pools:
                down = self._filtered(Tier.G2, plan.landed)
                follow = self._plan_copy(Tier.G2, Tier.G3, down) if down else []
            dst_pool.release(plan.landed)
        elif Tier.G3 in self.pools and Tier.G2 in self.pools and plan.src_tier is Tier.G2:
            # a block worth onboarding has been seen again: let it down to disk too
            follow = self._plan_copy(Tier.G2, Tier.G3, self._filtered(Tier.G2, plan.src_slots))
        return follow

    def abort(self, plan: CopyPlan) -> None:
        """A copy failed (I/O error, corrupt source): free its destination, unpin its source."""
        self.pools[plan.dst_tier].release(plan.dst_slots)
        self.pools[plan.src_tier].release(plan.src_slots)

    # -- blocks read from another worker (G4) ----------------------------------------------

    def reserve_g4(self, count: int) -> list[int]:
        """Up to ``count`` fresh G2 slots for blocks to be read from another worker."""
        return self._g2_for_g4().allocate_upto(count)

    def land_g4(
        self,
        slots: Sequence[int],
        blocks: Sequence[BlockInfo],
        held_back: Collection[int] = (),
        tokens: Sequence[bytes | None] | None = None,
        keys: Sequence[HashKey | None] | None = None,
    ) -> list[int]:
        """Register the first ``len(blocks)`` of the reserved ``slots`` as read from G4
        (``Onboarded(G4 -> G2)``) and free the rest, except ``held_back`` (slots a read still
        in flight may write; freed later with ``release``). Returns the landed slots, held
        until the caller releases them."""
        pool = self._g2_for_g4()
        n = len(blocks)
        landed = pool.register_copies(slots[:n], blocks, Tier.G4, tokens, keys) if n else []
        kept = set(held_back)
        pool.release([s for s in slots[n:] if s not in kept])
        return landed

    def release(self, tier: Tier, slots: Iterable[int]) -> None:
        """Let go of slots on ``tier`` in the order given (last use last)."""
        self.pools[tier].release(slots)

    def remove(self, tier: Tier, sequence_hashes: Iterable[int]) -> list[int]:
        """Drop cached blocks from ``tier`` (``Removed``); blocks in use stay. Returns the
        hashes dropped."""
        return self.pools[tier].remove(sequence_hashes)

    def adopt(
        self,
        tier: Tier,
        slots: Sequence[int],
        blocks: Sequence[BlockInfo],
        tokens: Sequence[bytes | None] | None = None,
    ) -> None:
        """Take blocks that a restart found already sitting in ``slots`` of ``tier`` (a disk
        cache the earlier run's log lists) as cached, without events, with each block's token
        ids where known: call before ``resume`` with ``keep`` naming that tier."""
        self.pools[tier].adopt(slots, blocks, tokens)

    def _g2_for_g4(self) -> BlockPool:
        pool = self.pools.get(Tier.G2)
        if pool is None:
            raise ValueError("remote onboard lands blocks on G2, and this worker has no G2")
        return pool
