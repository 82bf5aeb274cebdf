"""One worker's G1/G2/G3 pools and the rules that move blocks between them.

This is the bookkeeping half of the block manager: it decides which slots a copy reads and
writes and records the outcome, but never touches bytes. A caller that moves real bytes
(``kvledger.BlockManager``) executes each ``Transfer`` and then calls ``complete`` or
``abort``; the simulator completes them at once. Either way the events are the same.

Offload rules: every block registered on G1 is written through to G2 (or, with no G2, to G3
directly -- Dynamo's bypass). A block goes from G2 down to G3 only when the offload filter
lets it: ``always``, ``seen_twice`` (its prefix has been requested at least twice, so disk
writes go to blocks likely to come back) or ``never``.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from kvledger.events.types import BlockInfo, Tier
from kvledger.registry.emitter import EventEmitter
from kvledger.registry.policies import FrequencySketch
from kvledger.registry.pool import BlockPool

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
class Transfer:
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


class TieredRegistry:
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

    def forget_previous_run(self, keep: Collection[Tier] = ()) -> None:
        """Start a log that an earlier run of this worker wrote over again: a ``Cleared`` for
        every local tier, configured here or not, so that the log replays to this registry and
        not to what the earlier run (maybe with a G2 or G3 this one lacks) left there.

        Tiers in ``keep`` are left as they are: a disk cache the restart recovered already
        holds exactly what the earlier run's log lists for it (less what was dropped, which
        the caller reports as ``Removed``).
        """
        pools = [(tier, pool) for tier, pool in self.pools.items() if tier not in keep]
        held = [tier.name for tier, pool in pools if pool.num_registered]
        if held:
            raise ValueError(f"forget_previous_run on a registry that holds blocks ({held})")
        for tier in (Tier.G1, Tier.G2, Tier.G3):
            if tier not in keep:
                self.emitter.cleared(tier)

    @property
    def g1(self) -> BlockPool:
        return self.pools[Tier.G1]

    def lower_tiers(self) -> list[Tier]:
        return [t for t in (Tier.G2, Tier.G3) if t in self.pools]

    # -- lookups -------------------------------------------------------------------------

    def match(self, sequence_hashes: Sequence[int]) -> MatchResult:
        """Longest cached prefix: blocks on G1, then how far G2 continues it, then G3."""
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

    def plan_onboard(self, sequence_hashes: Sequence[int], match: MatchResult) -> list[Transfer]:
        """Copies that bring the G2/G3 part of ``match`` into fresh G1 slots.

        ``sequence_hashes`` is the whole prompt; the blocks after ``match.g1`` are onboarded.
        Fewer G1 slots than needed shortens the onboard to a prefix (never a hole).
        """
        wanted = match.g2 + match.g3
        if not wanted:
            return []
        g1 = self.g1
        dst = g1.allocate_upto(wanted)
        transfers: list[Transfer] = []
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
                transfers.append(Transfer(tier, Tier.G1, src, remaining[:count], infos))
            remaining = remaining[count:]
            start += count
            if count < (match.g2 if tier is Tier.G2 else match.g3):
                break
        if remaining:
            g1.release(remaining)
        return transfers

    # -- offloading ----------------------------------------------------------------------

    def plan_offload(self, g1_slots: Sequence[int]) -> list[Transfer]:
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

    def _plan_copy(self, src_tier: Tier, dst_tier: Tier, slots: Sequence[int]) -> list[Transfer]:
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
        return [Transfer(src_tier, dst_tier, src, dst, [info for _, info in todo])]

    # -- completion ----------------------------------------------------------------------

    def complete(self, transfer: Transfer) -> list[Transfer]:
        """Record a finished copy. Returns follow-up copies (G2 -> G3 behind the filter).

        Blocks onboarded into G1 stay referenced (the request that asked holds them);
        copies to G2/G3 become inactive there, cached and evictable.
        """
        src_pool = self.pools[transfer.src_tier]
        dst_pool = self.pools[transfer.dst_tier]
        transfer.landed = dst_pool.register_copies(
            transfer.dst_slots, transfer.blocks, transfer.src_tier
        )
        src_pool.release(transfer.src_slots)
        follow: list[Transfer] = []
        if transfer.dst_tier is not Tier.G1:
            if transfer.dst_tier is Tier.G2 and Tier.G3 in self.pools:
                down = self._filtered(Tier.G2, transfer.landed)
                follow = self._plan_copy(Tier.G2, Tier.G3, down) if down else []
            dst_pool.release(transfer.landed)
        elif Tier.G3 in self.pools and Tier.G2 in self.pools and transfer.src_tier is Tier.G2:
            # a block worth onboarding has been seen again: let it down to disk too
            follow = self._plan_copy(Tier.G2, Tier.G3, self._filtered(Tier.G2, transfer.src_slots))
        return follow

    def abort(self, transfer: Transfer) -> None:
        """A copy failed (I/O error, corrupt source): free its destination, unpin its source."""
        self.pools[transfer.dst_tier].release(transfer.dst_slots)
        self.pools[transfer.src_tier].release(transfer.src_slots)
