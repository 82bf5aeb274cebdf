"""The registry as a fold over events: which blocks each worker holds on each tier.

This is what replay rebuilds and what a live pool can dump, so the two can be compared:
``RegistryState.from_events(log) == pool_state`` is the invariant the event log exists for.

A tier's blocks are held either as a dict (what ``apply`` edits one event at a time) or as
sorted arrays (what replay folds whole batches into, ``registry/columns.py``). ``counts``,
``digest`` and snapshots read either form; ``tiers`` turns arrays into dicts on first use.
The arrays' module (numpy) is imported only when arrays are used: a live registry never does.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, TypeAlias

from kvledger.events.types import (
    AnyEvent,
    BlockInfo,
    Cleared,
    Offloaded,
    Onboarded,
    Removed,
    Stored,
    Tier,
)

if TYPE_CHECKING:
    from kvledger.registry.columns import BlockColumns, BlockOps

__all__ = ["EventOrderError", "RegistryState", "TierBlocks", "TierKey", "take_next"]

# sequence_hash -> (local_hash, parent_hash)
TierBlocks: TypeAlias = dict[int, tuple[int, int | None]]
TierKey: TypeAlias = tuple[int, Tier]

# fold_ops merges a tier's waiting batches once they hold this many operations (or half the
# tier's blocks, whichever is more)
_MIN_MERGE = 1 << 16


class EventOrderError(ValueError):
    """An event arrived out of order for its worker (a gap or a repeat)."""


def take_next(last_event_id: dict[int, int], event: AnyEvent, *, strict: bool = True) -> bool:
    """Whether ``event`` is new for its worker, recording it in ``last_event_id`` if so.

    Per-worker event ids are what make every consumer idempotent: an id at or below the last
    one seen is a repeat (False). With ``strict``, a jump over missing ids raises
    ``EventOrderError``, since folding past a gap would silently disagree with the worker.
    """
    last = last_event_id.get(event.worker_id, -1)
    if event.event_id <= last:
        return False
    if strict and event.event_id != last + 1:
        raise EventOrderError(
            f"worker {event.worker_id}: event {event.event_id} follows {last}; "
            f"events {last + 1}..{event.event_id - 1} are missing"
        )
    last_event_id[event.worker_id] = event.event_id
    return True


class RegistryState:
    """Per worker and tier, the resident blocks with their local and parent hashes."""

    __slots__ = ("_dicts", "_columns", "_pending", "last_event_id")

    def __init__(self) -> None:
        # a (worker, tier) is in at most one of the two
        self._dicts: dict[TierKey, TierBlocks] = {}
        self._columns: dict[TierKey, BlockColumns] = {}
        # batches handed to fold_ops and not yet merged into _columns (see there)
        self._pending: dict[TierKey, list[BlockOps]] = {}
        self.last_event_id: dict[int, int] = {}

    @property
    def tiers(self) -> dict[TierKey, TierBlocks]:
        """Per (worker, tier), sequence hash -> (local hash, parent hash), for editing in place.

        Tiers held as arrays become dicts here, once: a Python tuple per block is what this
        costs, and what a replay that only wants counts and a digest never pays.
        """
        self._settle()
        if self._columns:
            for key, columns in self._columns.items():
                self._dicts[key] = columns.to_dict()
            self._columns.clear()
        return self._dicts

    def fold_ops(self, key: TierKey, ops: BlockOps) -> None:
        """Fold a batch of block operations (already accepted, in order) into one tier.

        Merging a batch copies the tier's arrays, so small batches wait until they add up to
        a good part of the tier (or someone reads the state): each merge then costs about
        what its batch does, however large the tier has grown.
        """
        # numpy only when arrays are used (the module docstring)
        from kvledger.registry.columns import BlockColumns

        if key in self._dicts:
            self._columns[key] = BlockColumns.from_dict(self._dicts.pop(key))
        pending = self._pending.setdefault(key, [])
        pending.append(ops)
        waiting = sum(map(len, pending))
        if waiting >= max(_MIN_MERGE, len(self._columns.get(key, ())) // 2):
            self._merge(key)

    def _merge(self, key: TierKey) -> None:
        # numpy only when arrays are used (the module docstring)
        from kvledger.registry.columns import BlockColumns, concat, fold

        batch = concat(self._pending.pop(key))
        self._columns[key] = fold(self._columns.get(key, BlockColumns.empty()), batch)

    def _settle(self) -> None:
        for key in list(self._pending):
            self._merge(key)

    def set_columns(self, key: TierKey, columns: BlockColumns) -> None:
        self._pending.pop(key, None)
        self._dicts.pop(key, None)
        self._columns[key] = columns

    def iter_columns(self) -> Iterator[tuple[TierKey, BlockColumns]]:
        """Every non-empty tier as arrays, sorted by key; tiers held as dicts stay dicts."""
        # numpy only when arrays are used (the module docstring)
        from kvledger.registry.columns import BlockColumns

        self._settle()
        for key in sorted(self._dicts.keys() | self._columns.keys()):
            columns = self._columns.get(key)
            if columns is None:
                columns = BlockColumns.from_dict(self._dicts[key])
            if len(columns):
                yield key, columns

    @classmethod
    def from_events(cls, events: Iterable[AnyEvent], *, strict: bool = True) -> RegistryState:
        state = cls()
        for event in events:
            state.apply(event, strict=strict)
        return state

    def _blocks(self, worker_id: int, tier: Tier) -> TierBlocks:
        key = (worker_id, tier)
        blocks = self.tiers.get(key)
        if blocks is None:
            blocks = self.tiers[key] = {}
        return blocks

    def apply(self, event: AnyEvent, *, strict: bool = True) -> bool:
        """Fold one event in. Returns False (and changes nothing) for a repeated event.

        With ``strict``, a gap in a worker's event ids raises ``EventOrderError``: a state
        built over a missing event would silently disagree with the worker.
        """
        if not take_next(self.last_event_id, event, strict=strict):
            return False
        blocks = self._blocks(event.worker_id, event.tier)
        if isinstance(event, Stored):
            parent = event.parent_hash
            for seq, local in event.blocks:
                blocks[seq] = (local, parent)
                parent = seq
        elif isinstance(event, Removed):
            for seq in event.sequence_hashes:
                blocks.pop(seq, None)
        elif isinstance(event, Offloaded | Onboarded):
            for info in event.blocks:
                blocks[info.sequence_hash] = (info.local_hash, info.parent_hash)
        elif isinstance(event, Cleared):
            blocks.clear()
        else:  # pragma: no cover - the union above is exhaustive
            raise TypeError(f"not an event: {event!r}")
        return True

    def snapshot(self) -> dict[tuple[int, Tier], TierBlocks]:
        """Non-empty tiers only, copied: what two states must agree on."""
        return {key: dict(blocks) for key, blocks in self.tiers.items() if blocks}

    def counts(self) -> dict[TierKey, int]:
        self._settle()
        held: dict[TierKey, BlockColumns | TierBlocks] = {**self._dicts, **self._columns}
        return {key: len(blocks) for key, blocks in sorted(held.items()) if len(blocks)}

    def digest(self) -> str:
        """A short fingerprint of the state: sorted sequence hashes per (worker, tier)."""
        import hashlib  # here: OpenSSL's start costs every process that folds a log a third of a ms

        h = hashlib.sha256()
        self._settle()
        for key in sorted(self._dicts.keys() | self._columns.keys()):
            columns = self._columns.get(key)
            if columns is not None:
                seqs = columns.seq.astype("<u8").tobytes()
            else:  # the same bytes, without converting the tier to arrays
                packed = array("Q", sorted(self._dicts[key]))
                if sys.byteorder == "big":  # pragma: no cover - little-endian hosts only
                    packed.byteswap()
                seqs = packed.tobytes()
            if seqs:
                worker, tier = key
                h.update(f"{worker}:{tier.name}:".encode())
                h.update(seqs)
        return h.hexdigest()[:16]

    def infos(self, worker_id: int, tier: Tier) -> list[BlockInfo]:
        blocks = self.tiers.get((worker_id, tier), {})
        return [BlockInfo(seq, local, parent) for seq, (local, parent) in blocks.items()]

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, RegistryState):
            return NotImplemented
        return self.snapshot() == other.snapshot()

    def diff(self, other: RegistryState) -> list[str]:
        """Human-readable differences, for ``verify`` output."""
        out: list[str] = []
        mine, theirs = self.snapshot(), other.snapshot()
        for key in sorted(set(mine) | set(theirs)):
            a, b = mine.get(key, {}), theirs.get(key, {})
            worker, tier = key
            only_a = sorted(set(a) - set(b))
            only_b = sorted(set(b) - set(a))
            changed = sorted(s for s in set(a) & set(b) if a[s] != b[s])
            where = f"worker {worker} {tier.name}"
            if only_a:
                out.append(f"{where}: {len(only_a)} only in first, e.g. {only_a[:3]}")
            if only_b:
                out.append(f"{where}: {len(only_b)} only in second, e.g. {only_b[:3]}")
            if changed:
                out.append(f"{where}: {len(changed)} differ in parent/local")
        return out

    @classmethod
    def from_mapping(cls, tiers: Mapping[tuple[int, Tier], TierBlocks]) -> RegistryState:
        state = cls()
        for key, blocks in tiers.items():
            state.tiers[key] = dict(blocks)
        return state
