"""The router's view: which worker holds which prefix, on which tier.

A KV-aware router does not need parents or token ids, only "for this prompt, how many leading
blocks does each worker already hold, and where". This index answers that from the same event
stream the registry folds, and can be rebuilt from a stream or a log at any time: it is a cache of
the events, never a source of truth.

A prompt can be looked up by sequence hashes (each names a whole prefix, so a flat table is
enough) or by local hashes, which is what a router computes from tokens without chaining them; a
local-hash lookup walks the ``(parent sequence hash, local hash) -> sequence hash`` links that
Stored events reveal.
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

    __slots__ = ("_holders", "_links", "_link_of", "_resident", "last_event_id")

    def __init__(self) -> None:
        # sequence_hash -> {(worker, dp_rank): tier mask}
        self._holders: dict[int, dict[WorkerKey, int]] = {}
        # (parent sequence hash or None, local hash) -> sequence hash, while anyone holds it
        self._links: dict[tuple[int | None, int], int] = {}
        self._link_of: dict[int, tuple[int | None, int]] = {}
        # (worker, dp_rank) -> tier -> resident sequence hashes (for Cleared and worker removal)
        self._resident: dict[WorkerKey, dict[Tier, set[int]]] = {}
        self.last_event_id: dict[int, int] = {}

    @classmethod
    def from_events(cls, events: Iterable[AnyEvent], *, strict: bool = True) -> RouterIndex:
        index = cls()
        for event in events:
            index.apply(event, strict=strict)
        return index

    def __len__(self) -> int:
        """Number of distinct blocks held by anyone on any tier."""
        return len(self._holders)

    # -- folding -------------------------------------------------------------------------

    def apply(self, event: AnyEvent, *, strict: bool = True) -> bool:
        """Fold one event in; False (and no change) for a repeat."""
        if not take_next(self.last_event_id, event, strict=strict):
            return False
        key = (event.worker_id, event.dp_rank)
        if isinstance(event, Stored):
            parent = event.parent_hash
            for seq, local in event.blocks:
                self._add(key, event.tier, seq, parent, local)
                parent = seq
        elif isinstance(event, Offloaded | Onboarded):
            for info in event.blocks:
                self._add(key, event.tier, info.sequence_hash, info.parent_hash, info.local_hash)
        elif isinstance(event, Removed):
            for seq in event.sequence_hashes:
                self._drop(key, event.tier, seq)
        elif isinstance(event, Cleared):
            for seq in list(self._resident.get(key, {}).get(event.tier, ())):
                self._drop(key, event.tier, seq)
        else:  # pragma: no cover - the union above is exhaustive
            raise TypeError(f"not an event: {event!r}")
        return True

    def remove_worker(self, worker_id: int) -> int:
        """Forget all a worker holds (it left, or its lease lapsed); returns blocks dropped."""
        dropped = 0
        for key in [k for k in self._resident if k[0] == worker_id]:
            for tier, seqs in list(self._resident[key].items()):
                for seq in list(seqs):
                    self._drop(key, tier, seq)
                    dropped += 1
        self.last_event_id.pop(worker_id, None)
        return dropped

    def _add(self, key: WorkerKey, tier: Tier, seq: int, parent: int | None, local: int) -> None:
        holders = self._holders.get(seq)
        if holders is None:
            holders = self._holders[seq] = {}
        holders[key] = holders.get(key, 0) | tier_bit(tier)
        if seq not in self._link_of:
            link = (parent, local)
            self._links[link] = seq
            self._link_of[seq] = link
        self._resident.setdefault(key, {}).setdefault(tier, set()).add(seq)

    def _drop(self, key: WorkerKey, tier: Tier, seq: int) -> None:
        resident = self._resident.get(key)
        if resident is None or seq not in resident.get(tier, ()):
            return  # removing what was never stored changes nothing
        resident[tier].discard(seq)
        holders = self._holders[seq]
        mask = holders[key] & ~tier_bit(tier)
        if mask:
            holders[key] = mask
            return
        del holders[key]
        if holders:
            return
        del self._holders[seq]
        link = self._link_of.pop(seq)
        if self._links.get(link) == seq:
            del self._links[link]

    # -- queries -------------------------------------------------------------------------

    def sequence_hashes_of(self, local_hashes: Sequence[int]) -> list[int]:
        """The longest known chain of sequence hashes for a prompt's local hashes."""
        out: list[int] = []
        parent: int | None = None
        for local in local_hashes:
            seq = self._links.get((parent, local))
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
            seqs = self.sequence_hashes_of(hashes)
        elif kind == "sequence":
            seqs = list(hashes)
        else:
            raise ValueError(f"kind must be 'local' or 'sequence', got {kind!r}")
        return prefix_depths(self._holders.get(seq, {}) for seq in seqs)

    def holders(self) -> dict[int, dict[int, int]]:
        """``sequence_hash -> {worker_id: tier mask}``, dp ranks folded together."""
        out: dict[int, dict[int, int]] = {}
        for seq, per_key in self._holders.items():
            merged: dict[int, int] = {}
            for (worker, _dp), mask in per_key.items():
                merged[worker] = merged.get(worker, 0) | mask
            out[seq] = merged
        return out

    def workers(self) -> set[WorkerKey]:
        return {key for key, tiers in self._resident.items() if any(tiers.values())}


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
