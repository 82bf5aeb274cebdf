"""The router's view: which worker holds which prefix, on which tier.

A KV-aware router does not need parents or token ids, only "for this prompt, how many leading
blocks does each worker already hold, and where". This index answers that from the same event
stream the registry folds, and can be rebuilt from a stream or a log at any time: it is a cache of
the events, never a source of truth.

A prompt can be looked up by sequence hashes (each names a whole prefix, so a flat table is
enough) or by local hashes, which is what a router computes from tokens without chaining them; a
local-hash lookup walks the ``(parent sequence hash, local hash) -> sequence hash`` links that
Stored events reveal.

A router asks once per request, so the query is the hot path. Each block's holders are one int
with a bit per (worker, dp_rank, tier); a query ANDs these along the prompt, so it costs two dict
lookups (the link, the holders) and an AND per block however many workers there are, writes a
depth only where a holder drops out, and stops at the first block no one still matching holds.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Literal, TypeAlias, TypeVar

from kvledger.events.types import (
    AnyEvent,
    Cleared,
    Offloaded,
    Onboarded,
    Removed,
    Stored,
    Tier,
)
from kvledger.registry.state import RegistryState, take_next

WorkerKey: TypeAlias = tuple[int, int]
"""(worker_id, dp_rank): what a router routes to."""

Depths: TypeAlias = dict[WorkerKey, dict[Tier, int]]
HashKind: TypeAlias = Literal["local", "sequence"]
K = TypeVar("K")

_TIER_ORDER = tuple(Tier)
_TIERS = len(_TIER_ORDER)


def tier_bit(tier: Tier) -> int:
    """A tier's bit in a holder mask (G1 -> 1, G2 -> 2, G3 -> 4, G4 -> 8)."""
    return 1 << (int(tier) - 1)


def tiers_of(mask: int) -> list[Tier]:
    return [tier for tier in Tier if mask & tier_bit(tier)]


def holders_from_state(state: RegistryState) -> dict[int, dict[int, int]]:
    """``sequence_hash -> {worker_id: tier mask}`` of a folded registry.

    This is the shape the shared Redis registry stores, so a replayed log can be compared
    with it directly.
    """
    out: dict[int, dict[int, int]] = {}
    for (worker, tier), blocks in state.snapshot().items():
        bit = tier_bit(tier)
        for seq in blocks:
            per_worker = out.setdefault(seq, {})
            per_worker[worker] = per_worker.get(worker, 0) | bit
    return out


class RouterIndex:
    """Prefix holders per worker and tier, folded from events.

    Events from one worker must arrive in event-id order. A repeat (an id at or below the last
    one applied for that worker) is ignored, so replaying an overlapping stream is harmless; a gap
    raises ``EventOrderError`` unless ``strict=False``, because an index built over a missing
    event silently disagrees with the worker.
    """

    __slots__ = (
        "_held",
        "_links",
        "_link_of",
        "_places",
        "_slot_of",
        "_owners",
        "_free_slots",
        "last_event_id",
    )

    def __init__(self) -> None:
        # sequence_hash -> bits of the (worker, dp_rank, tier) slots holding it; never 0. Plain
        # ints and tuples of ints, which the garbage collector stops tracking: a mutable cell
        # per block, giving a link's bits in one lookup, measured no faster per query and
        # slower to apply
        self._held: dict[int, int] = {}
        # (parent sequence hash or None, local hash) -> sequence hash, while anyone holds it
        self._links: dict[tuple[int | None, int], int] = {}
        self._link_of: dict[int, tuple[int | None, int]] = {}
        # (worker, dp_rank, tier) -> (its bit, the sequence hashes it holds: for Cleared and
        # worker removal)
        self._places: dict[tuple[int, int, Tier], tuple[int, set[int]]] = {}
        # (worker, dp_rank) -> its slot; its tier t has bit ``slot * _TIERS + t - 1``
        self._slot_of: dict[WorkerKey, int] = {}
        # bit position -> (worker key, tier) it stands for (stale for a free slot: no bit set)
        self._owners: list[tuple[WorkerKey, Tier]] = []
        self._free_slots: list[int] = []
        self.last_event_id: dict[int, int] = {}

    @classmethod
    def from_events(cls, events: Iterable[AnyEvent], *, strict: bool = True) -> RouterIndex:
        index = cls()
        for event in events:
            index.apply(event, strict=strict)
        return index

    def __len__(self) -> int:
        """Number of distinct blocks held by anyone on any tier."""
        return len(self._held)

    # -- folding -------------------------------------------------------------------------

    def apply(self, event: AnyEvent, *, strict: bool = True) -> bool:
        """Fold one event in; False (and no change) for a repeat."""
        last = self.last_event_id
        if event.event_id == last.get(event.worker_id, -1) + 1:  # the usual case
            last[event.worker_id] = event.event_id
        elif not take_next(last, event, strict=strict):
            return False
        place = self._places.get((event.worker_id, event.dp_rank, event.tier))
        if place is None:
            place = self._place(event.worker_id, event.dp_rank, event.tier)
        bit, resident = place
        if isinstance(event, Stored):
            self._add(bit, resident, event.parent_hash, event.blocks)
        elif isinstance(event, Offloaded | Onboarded):
            for info in event.blocks:
                self._add(bit, resident, info.parent_hash, ((info.sequence_hash, info.local_hash),))
        elif isinstance(event, Removed):
            self._drop(bit, resident, event.sequence_hashes)
        elif isinstance(event, Cleared):
            self._clear_bits(bit, resident)
            resident.clear()
        else:  # pragma: no cover - the union above is exhaustive
            raise TypeError(f"not an event: {event!r}")
        return True

    def remove_worker(self, worker_id: int) -> int:
        """Forget all a worker holds (it left, or its lease lapsed); returns blocks dropped."""
        dropped = 0
        for where in [where for where in self._places if where[0] == worker_id]:
            bit, resident = self._places.pop(where)
            dropped += len(resident)
            self._clear_bits(bit, resident)
        for key in [key for key in self._slot_of if key[0] == worker_id]:
            # no bit of its slot is set any more, so a new worker can take it over
            self._free_slots.append(self._slot_of.pop(key))
        self.last_event_id.pop(worker_id, None)
        return dropped

    def _place(self, worker_id: int, dp_rank: int, tier: Tier) -> tuple[int, set[int]]:
        """The bit and resident set of a (worker, dp_rank, tier), made on first use."""
        key = (worker_id, dp_rank)
        slot = self._slot_of.get(key)
        if slot is None:
            slot = self._free_slots.pop() if self._free_slots else len(self._owners) // _TIERS
            self._slot_of[key] = slot
            self._owners[slot * _TIERS : (slot + 1) * _TIERS] = [(key, t) for t in _TIER_ORDER]
        place = self._places[(worker_id, dp_rank, tier)] = (
            1 << (slot * _TIERS + int(tier) - 1),
            set(),
        )
        return place

    def _add(
        self,
        bit: int,
        resident: set[int],
        parent: int | None,
        blocks: Iterable[tuple[int, int]],
    ) -> None:
        """Hold a chain of (sequence hash, local hash) blocks, the first one under ``parent``."""
        held, links, link_of = self._held, self._links, self._link_of
        for seq, local in blocks:
            bits = held.get(seq, 0)
            if not bits:  # new to everyone: its link is what local-hash lookups walk
                link = (parent, local)
                links[link] = seq
                link_of[seq] = link
            held[seq] = bits | bit
            resident.add(seq)
            parent = seq

    def _drop(self, bit: int, resident: set[int], seqs: Iterable[int]) -> None:
        """Clear ``bit`` on each of ``seqs`` that has it (once each, however often a stream
        repeats one; what was never stored changes nothing)."""
        held = self._held
        keep = ~bit
        for seq in seqs:
            bits = held.get(seq, 0)
            if not bits & bit:
                continue
            resident.remove(seq)
            if bits & keep:
                held[seq] = bits & keep
            else:
                self._forget(seq)

    def _clear_bits(self, bit: int, seqs: Iterable[int]) -> None:
        """Clear ``bit`` on each of ``seqs``, all of which have it."""
        held = self._held
        keep = ~bit
        for seq in seqs:
            bits = held[seq] & keep
            if bits:
                held[seq] = bits
            else:
                self._forget(seq)

    def _forget(self, seq: int) -> None:
        """A block no one holds any more: drop it and its link."""
        del self._held[seq]
        link = self._link_of.pop(seq)
        taken = self._links.pop(link, seq)
        if taken != seq:  # another block took the link over: it stays
            self._links[link] = taken

    # -- queries -------------------------------------------------------------------------

    def sequence_hashes_of(self, local_hashes: Sequence[int]) -> list[int]:
        """The longest known chain of sequence hashes for a prompt's local hashes."""
        out: list[int] = []
        parent: int | None = None
        links = self._links
        for local in local_hashes:
            seq = links.get((parent, local))
            if seq is None:
                break
            out.append(seq)
            parent = seq
        return out

    def find_matches(self, hashes: Sequence[int], *, kind: HashKind = "local") -> Depths:
        """For each holder, how many leading blocks of the prompt it holds on each tier.

        A depth counts consecutive blocks from the start: a hole ends it, because a block after
        a missing one cannot be reused without recomputing the missing one.
        """
        if kind == "local":
            return self._local_depths(hashes)
        if kind == "sequence":
            return self._sequence_depths(hashes)
        raise ValueError(f"kind must be 'local' or 'sequence', got {kind!r}")

    def _local_depths(self, local_hashes: Sequence[int]) -> Depths:
        links, held = self._links, self._held
        depths: Depths = {}
        alive = depth = 0
        parent: int | None = None
        for local in local_hashes:
            seq = links.get((parent, local))
            if seq is None:
                break
            if depth:
                still = alive & held[seq]
                if still != alive:
                    self._record(depths, alive ^ still, depth)
                    alive = still
                    if not alive:
                        return depths
            else:
                alive = held[seq]
            depth += 1
            parent = seq
        if alive:
            self._record(depths, alive, depth)
        return depths

    def _sequence_depths(self, sequence_hashes: Sequence[int]) -> Depths:
        held = self._held
        depths: Depths = {}
        alive = depth = 0
        for seq in sequence_hashes:
            bits = held.get(seq, 0)
            if depth:
                still = alive & bits
                if still != alive:
                    self._record(depths, alive ^ still, depth)
                    alive = still
            else:
                alive = bits
            if not alive:
                return depths
            depth += 1
        if alive:
            self._record(depths, alive, depth)
        return depths

    def _record(self, depths: Depths, ended: int, depth: int) -> None:
        """``depth`` for every slot whose bit is set in ``ended``."""
        owners = self._owners
        while ended:
            low = ended & -ended
            key, tier = owners[low.bit_length() - 1]
            per_tier = depths.get(key)
            if per_tier is None:
                per_tier = depths[key] = {}
            per_tier[tier] = depth
            ended ^= low

    def holders(self) -> dict[int, dict[int, int]]:
        """``sequence_hash -> {worker_id: tier mask}``, dp ranks folded together."""
        owners = self._owners
        out: dict[int, dict[int, int]] = {}
        for seq, bits in self._held.items():
            merged: dict[int, int] = {}
            while bits:
                low = bits & -bits
                (worker, _dp), tier = owners[low.bit_length() - 1]
                merged[worker] = merged.get(worker, 0) | tier_bit(tier)
                bits ^= low
            out[seq] = merged
        return out

    def workers(self) -> set[WorkerKey]:
        return {(worker, dp) for (worker, dp, _tier), (_bit, held) in self._places.items() if held}


def prefix_depths(masks: Iterable[Mapping[K, int]]) -> dict[K, dict[Tier, int]]:
    """Per holder and tier, how many of the leading blocks it holds without a hole.

    ``masks`` gives, block by block, each holder's tier mask; it is consumed only while some
    holder is still matching, so a lazy iterable stops at the first block nobody holds.
    """
    depths: dict[K, dict[Tier, int]] = {}
    alive: dict[K, int] = {}
    for position, holders in enumerate(masks):
        if position == 0:
            alive = {key: mask for key, mask in holders.items() if mask}
            for key, mask in alive.items():
                depths[key] = {tier: 1 for tier in tiers_of(mask)}
            continue
        for key in list(alive):
            mask = alive[key] & holders.get(key, 0)
            if not mask:
                del alive[key]
                continue
            alive[key] = mask
            per_tier = depths[key]
            for tier in tiers_of(mask):
                per_tier[tier] += 1
        if not alive:
            break
    return depths


def overlap_scores(
    depths: Mapping[WorkerKey, Mapping[Tier, int]], tier: Tier
) -> dict[WorkerKey, int]:
    """Depths on one tier in the shape Dynamo's ``OverlapScores.scores`` has."""
    return {key: per_tier[tier] for key, per_tier in depths.items() if per_tier.get(tier)}
