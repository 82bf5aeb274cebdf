"""The simulator's view of a worker's KV cache: tiers without bytes, copies that finish at once.

It runs the same bookkeeping as ``kvledger.BlockManager`` (the same ``TieredPools``, so
the same events and the same log) but a copy between tiers is completed immediately and
only its size is recorded, for the mock engine's bandwidth model to charge.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvledger.events.types import Tier
from kvledger.registry.emitter import EventEmitter
from kvledger.registry.lookups import LookupRecorder
from kvledger.registry.tiered import CopyPlan, MatchResult, TieredPools

if TYPE_CHECKING:  # an annotation only: the cache runs without the settings library
    from kvledger.config import Settings


@dataclass(slots=True)
class Admission:
    """What admitting a prompt did: the G1 slots it holds and where its hits came from."""

    slots: list[int]
    match: MatchResult
    #: blocks actually brought into G1 from each lower tier
    onboarded: dict[Tier, int] = field(default_factory=dict)
    #: blocks placed: hits + onboarded + new; fewer than the prompt means G1 ran out
    placed: int = 0
    #: how many of ``slots`` (a prefix) hold registered blocks; the rest are still filling
    registered: int = 0
    #: the cache's number for the request, which its lookup records carry
    request_id: int = -1

    @property
    def hit_blocks(self) -> int:
        return self.match.g1 + sum(self.onboarded.values())


def tiered_pools(settings: Settings, emitter: EventEmitter) -> TieredPools:
    """The pools a simulated worker's cache runs on, sized and ruled by ``settings``."""
    return TieredPools(
        settings.g1_blocks,
        settings.g2_capacity,
        settings.g3_capacity,
        policy=settings.eviction_policy,
        offload_filter=settings.offload_filter,
        emitter=emitter,
    )


class SimulatedCache:
    """Admit, grow and finish requests against a ``TieredPools``; count what moved."""

    def __init__(self, tiered: TieredPools) -> None:
        self.tiered = tiered
        self.copied: Counter[tuple[Tier, Tier]] = Counter()  # blocks per (src, dst)
        #: where each admission, growth and finish is recorded (None: not recorded)
        self.lookups: LookupRecorder | None = None
        self._next_request = 0
        #: whether a block named on G1 may be copied down (a G2 or G3 exists)
        self._offloads = len(tiered.pools) > 1
        self._g1 = tiered.g1  # the registry's tiers are fixed when it is built

    @classmethod
    def build(
        cls,
        g1_blocks: int,
        g2_blocks: int = 0,
        g3_blocks: int = 0,
        *,
        policy: str = "lineage",
        offload_filter: str = "seen_twice",
        emitter: EventEmitter | None = None,
    ) -> SimulatedCache:
        return cls(
            TieredPools(
                g1_blocks,
                g2_blocks,
                g3_blocks,
                policy=policy,
                offload_filter=offload_filter,
                emitter=emitter,
            )
        )

    def _run(self, transfers: list[CopyPlan]) -> None:
        while transfers:
            transfer = transfers.pop()
            self.copied[(transfer.src_tier, transfer.dst_tier)] += len(transfer)
            transfers.extend(self.tiered.complete(transfer))

    def admit(
        self,
        sequence_hashes: Sequence[int],
        local_hashes: Sequence[int],
        *,
        limit: int | None = None,
        full: int | None = None,
        match: MatchResult | None = None,
        num_tokens: int = 0,
    ) -> Admission:
        """Hold the first ``limit`` (default: all) blocks of a prompt on G1.

        Cached blocks are reused (G1) or onboarded (G2/G3); the rest are allocated and
        registered as computed. With too little G1, a prefix is placed: ``placed`` says how much.
        Blocks from ``full`` on (default: none) are still filling: they get a slot but no
        name, so nobody can hit them and, released unfilled, they go back to the free list
        without displacing a cached block (Dynamo's mocker caches full blocks only).
        ``match``: the caller's ``tiered.match`` of these blocks, when it just made one.
        ``num_tokens`` (the prompt's length, 0: not given) goes into the lookup record.
        """
        reg = self.tiered
        g1 = self._g1
        wanted = len(sequence_hashes)
        if limit is not None and limit < wanted:
            wanted = limit
        hashes = sequence_hashes[:wanted]
        if match is None or match.total > wanted:
            match = reg.match(hashes)
        total = match.total
        slots = g1.match(hashes[: match.g1])
        onboarded: dict[Tier, int] = {}
        if self._offloads:  # lower tiers: count the request there, bring their hits up
            reg.note_request(hashes)
            onboard = reg.plan_onboard(hashes, match)
            for transfer in onboard:
                onboarded[transfer.src_tier] = len(transfer)
            self._run(list(onboard))
            for transfer in onboard:
                slots.extend(transfer.landed)
        start = len(slots)
        fresh = g1.allocate_upto(wanted - start) if start == total else []
        admission = Admission(slots, match, onboarded, start, start)
        if fresh:
            self._place(admission, fresh, hashes, local_hashes, wanted if full is None else full)
        admission.placed = len(slots)
        admission.request_id = self._next_request
        self._next_request += 1
        if self.lookups is not None:
            hits = (match.g1, onboarded.get(Tier.G2, 0), onboarded.get(Tier.G3, 0))
            self.lookups.lookup(admission.request_id, hashes, hits, num_tokens=num_tokens)
        return admission

    def _place(
        self,
        admission: Admission,
        fresh: list[int],
        sequence_hashes: Sequence[int],
        local_hashes: Sequence[int],
        full: int,
    ) -> None:
        """Append ``fresh`` slots to ``admission``: named (registered) up to block ``full``,
        unnamed after it."""
        slots = admission.slots
        start = len(slots)
        # how many to name, in 0..len(fresh) (comparisons, not min() and max(): once per
        # admission, the builtins cost more than the arithmetic)
        named = full - start
        if named > len(fresh):
            named = len(fresh)
        elif named < 0:
            named = 0
        if named:
            end = start + named
            blocks = list(zip(sequence_hashes[start:end], local_hashes[start:end], strict=True))
            parent = sequence_hashes[start - 1] if start else None
            registered = self._g1.register(fresh[:named], blocks, parent)
            slots.extend(registered)
            admission.registered = len(slots)
            if self._offloads:
                self._run(self.tiered.plan_offload(registered))
        slots.extend(fresh[named:])

    def extend(
        self,
        admission: Admission,
        sequence_hashes: Sequence[int],
        local_hashes: Sequence[int],
        *,
        full: int | None = None,
        blocks: int | None = None,
    ) -> int:
        """Add newly completed blocks (decode) to a held request; returns how many fit.

        The request now has the first ``blocks`` (default: all) of ``sequence_hashes``: a
        count rather than a slice, since a decoding sequence's hashes grow by one block at a
        time and copying them all each time costs as much as the rest of the call.
        With ``full``, blocks from ``full`` on are still filling (no name, as in ``admit``), and
        held blocks that filled up since (before ``full``) are named, once every block asked
        for has a slot (as vLLM caches a step's full blocks only when its allocation succeeded)."""
        wanted = len(sequence_hashes)
        if blocks is not None and blocks < wanted:
            wanted = blocks
        if full is not None:
            return self._extend_unnamed(admission, sequence_hashes, local_hashes, full, wanted)
        g1 = self._g1
        slots = admission.slots
        start = len(slots)
        new = sequence_hashes[start:wanted]
        if not new:
            return 0
        hit = g1.match(new) if admission.registered == start else []
        if self.lookups is not None:
            self.lookups.lookup(admission.request_id, new, (len(hit), 0, 0), start=start)
        fresh = g1.allocate_upto(len(new) - len(hit))
        slots.extend(hit)
        admission.registered += len(hit)
        if fresh:
            self._place(admission, fresh, sequence_hashes, local_hashes, wanted)
        admission.placed = len(slots)
        return len(slots) - start

    def _extend_unnamed(
        self,
        admission: Admission,
        sequence_hashes: Sequence[int],
        local_hashes: Sequence[int],
        full: int,
        wanted: int,
    ) -> int:
        """``extend`` when only full blocks are named: slots first, then one run of names.

        A decoding sequence comes here twice per block, once for a slot and once to name the
        block when it is full, so the common cases skip the work they do not need."""
        g1 = self._g1
        slots = admission.slots
        start = len(slots)
        if wanted > start:
            hit: list[int] = []
            if full > start and admission.registered == start:
                # all named: a new block may be cached already
                hit = g1.match(sequence_hashes[start:full])
                slots.extend(hit)
                admission.registered += len(hit)
            if self.lookups is not None:
                new = sequence_hashes[start:wanted]
                self.lookups.lookup(admission.request_id, new, (len(hit), 0, 0), start=start)
            slots.extend(g1.allocate_upto(wanted - len(slots)))
            admission.placed = len(slots)
        at = admission.registered
        held = len(slots)
        upto = full if full < held else held
        if held == wanted and upto > at:
            if upto == at + 1:  # the one block a decode step filled
                blocks = [(sequence_hashes[at], local_hashes[at])]
            else:
                blocks = list(zip(sequence_hashes[at:upto], local_hashes[at:upto], strict=True))
            parent = sequence_hashes[at - 1] if at else None
            registered = g1.register(slots[at:upto], blocks, parent)
            slots[at:upto] = registered
            admission.registered = upto
            if self._offloads:
                self._run(self.tiered.plan_offload(registered))
        return len(slots) - start

    def finish(self, admission: Admission) -> None:
        """Let go of a request's blocks, last block first, so suffixes are evicted before
        the prefixes other requests share."""
        self._g1.release(reversed(admission.slots))
        admission.slots = []
        if self.lookups is not None:
            self.lookups.released(admission.request_id)
