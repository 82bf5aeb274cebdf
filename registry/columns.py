"""A tier's resident blocks as sorted arrays, and the fold of a batch of block operations.

Replay folds logs of millions of events. Holding every block as a Python int key and a
``(local, parent)`` tuple costs more than reading the log does, so replay keeps each (worker,
tier)'s blocks as four parallel arrays sorted by sequence hash, folds a whole batch of
operations with one sort of the batch and one merge, and builds dicts only when a caller asks
for per-block access (``RegistryState.tiers``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeAlias, TypeVar

import numpy as np
import numpy.typing as npt

from kvledger.events.types import (
    AnyEvent,
    Cleared,
    Offloaded,
    Onboarded,
    Removed,
    Stored,
)

if TYPE_CHECKING:  # names for annotations only: the state imports this module, not back
    from kvledger.registry.state import TierBlocks, TierKey

U64: TypeAlias = npt.NDArray[np.uint64]
Flags: TypeAlias = npt.NDArray[np.bool_]
_T = TypeVar("_T", bound=np.generic)


@dataclass(frozen=True, slots=True, eq=False)
class BlockColumns:
    """One (worker, tier)'s blocks: ``seq`` sorted and unique, the rest aligned with it.

    ``parent`` holds 0 where ``has_parent`` is False (a block at the start of a sequence).
    """

    seq: U64
    local: U64
    parent: U64
    has_parent: Flags

    def __len__(self) -> int:
        return len(self.seq)

    @classmethod
    def empty(cls) -> BlockColumns:
        return cls(_u64([]), _u64([]), _u64([]), np.zeros(0, np.bool_))

    @classmethod
    def from_dict(cls, blocks: TierBlocks) -> BlockColumns:
        """Columns of a dict of blocks; ``OverflowError`` when a hash is not a u64."""
        seqs = list(blocks)
        pairs = list(blocks.values())
        parents = [p for _, p in pairs]
        has_parent = np.fromiter((p is not None for p in parents), np.bool_, len(parents))
        columns = cls(
            _u64(seqs),
            _u64([local for local, _ in pairs]),
            _u64([0 if p is None else p for p in parents]),
            has_parent,
        )
        return columns.take(np.argsort(columns.seq, kind="stable"))

    def to_dict(self) -> TierBlocks:
        parents: list[int | None] = self.parent.tolist()
        if not self.has_parent.all():
            for i in np.flatnonzero(~self.has_parent).tolist():
                parents[i] = None
        return dict(
            zip(self.seq.tolist(), zip(self.local.tolist(), parents, strict=True), strict=True)
        )

    def take(self, index: npt.NDArray[np.intp] | Flags) -> BlockColumns:
        return BlockColumns(
            self.seq[index], self.local[index], self.parent[index], self.has_parent[index]
        )


@dataclass(frozen=True, slots=True, eq=False)
class BlockOps:
    """Operations on one (worker, tier)'s blocks, in the order they happened.

    Where ``store`` is set the block was stored (or copied in) with that local and parent
    hash; elsewhere it was removed (``local``/``parent`` unused). ``cleared`` says the tier was
    emptied before the first of them, so whatever it held before does not survive.
    """

    seq: U64
    local: U64
    parent: U64
    has_parent: Flags
    store: Flags
    cleared: bool = False

    def __len__(self) -> int:
        return len(self.seq)


def fold(base: BlockColumns, ops: BlockOps) -> BlockColumns:
    """``base`` after ``ops``: each block's last operation decides whether it stays.

    One sort of the operations and one merge with ``base``, so folding a batch costs
    O(len(base) + k log k) for k operations, whatever their mix.
    """
    if ops.cleared:
        base = BlockColumns.empty()
    if not len(ops):
        return base
    # each block's last operation: the largest index among its equal hashes once sorted.
    # (np.unique's return_index would do, but it sorts stably, timsort on 64-bit keys; an
    # unstable sort and a max over each run of equals costs a third of it.)
    order = np.argsort(ops.seq)
    sorted_seq = ops.seq[order]
    runs = np.flatnonzero(np.r_[True, sorted_seq[1:] != sorted_seq[:-1]])
    seqs = sorted_seq[runs]
    last = np.maximum.reduceat(order, runs)
    if len(base):
        # every block the batch touched leaves the base: it is either gone or replaced
        at = np.searchsorted(base.seq, seqs)
        found = at < len(base)
        found[found] = base.seq[at[found]] == seqs[found]
        if found.any():
            keep = np.ones(len(base), np.bool_)
            keep[at[found]] = False
            base = base.take(keep)
    stored = ops.store[last]
    added = last[stored]
    seqs = seqs[stored]
    if not len(base):
        return BlockColumns(seqs, ops.local[added], ops.parent[added], ops.has_parent[added])
    # both sides are sorted and disjoint: the i-th new block lands at its search position
    # in the base plus the i new blocks before it, and the base's blocks fill the rest (their
    # places found once, as indices, for the four columns)
    new_at = np.searchsorted(base.seq, seqs) + np.arange(len(seqs))
    is_old = np.ones(len(base) + len(seqs), np.bool_)
    is_old[new_at] = False
    old_at = np.flatnonzero(is_old)
    return BlockColumns(
        _merge(base.seq, seqs, old_at, new_at),
        _merge(base.local, ops.local[added], old_at, new_at),
        _merge(base.parent, ops.parent[added], old_at, new_at),
        _merge(base.has_parent, ops.has_parent[added], old_at, new_at),
    )


def _merge(
    old: npt.NDArray[_T],
    new: npt.NDArray[_T],
    old_at: npt.NDArray[np.intp],
    new_at: npt.NDArray[np.intp],
) -> npt.NDArray[_T]:
    out = np.empty(len(old) + len(new), old.dtype)
    out[new_at] = new
    out[old_at] = old
    return out


def concat(batches: Sequence[BlockOps]) -> BlockOps:
    """Consecutive batches of one tier as one; a clear drops every batch before it."""
    cleared = [i for i, b in enumerate(batches) if b.cleared]
    if cleared:
        batches = batches[cleared[-1] :]
    if len(batches) == 1:
        return batches[0]
    return BlockOps(
        np.concatenate([b.seq for b in batches]),
        np.concatenate([b.local for b in batches]),
        np.concatenate([b.parent for b in batches]),
        np.concatenate([b.has_parent for b in batches]),
        np.concatenate([b.store for b in batches]),
        cleared=bool(cleared),
    )


def ops_from_events(events: Iterable[AnyEvent]) -> dict[TierKey, BlockOps]:
    """The block operations of already-accepted events, one batch per (worker, tier).

    The slow path of replay (records the array decoder does not vouch for) goes through here,
    so that both paths feed the same fold.
    """
    lists: dict[TierKey, tuple[list[int], list[int], list[int], list[bool], list[bool]]] = {}
    cleared: set[TierKey] = set()
    for event in events:
        key = (event.worker_id, event.tier)
        if isinstance(event, Cleared):
            lists[key] = ([], [], [], [], [])
            cleared.add(key)
            continue
        seq, local, parent, has_parent, store = lists.setdefault(key, ([], [], [], [], []))
        if isinstance(event, Removed):
            n = len(event.sequence_hashes)
            seq.extend(event.sequence_hashes)
            local.extend([0] * n)
            parent.extend([0] * n)
            has_parent.extend([False] * n)
            store.extend([False] * n)
        elif isinstance(event, Stored | Offloaded | Onboarded):
            # a stored chain spelled out as BlockInfos, each with its parent
            infos = event.infos() if isinstance(event, Stored) else event.blocks
            for info in infos:
                seq.append(info.sequence_hash)
                local.append(info.local_hash)
                parent.append(0 if info.parent_hash is None else info.parent_hash)
                has_parent.append(info.parent_hash is not None)
                store.append(True)
        else:  # pragma: no cover - the union above is exhaustive
            raise TypeError(f"not an event: {event!r}")
    return {
        key: BlockOps(
            _u64(seq),
            _u64(local),
            _u64(parent),
            np.array(has_parent, np.bool_),
            np.array(store, np.bool_),
            cleared=key in cleared,
        )
        for key, (seq, local, parent, has_parent, store) in lists.items()
    }


def _u64(values: Sequence[int]) -> U64:
    return np.array(values, np.uint64) if values else np.zeros(0, np.uint64)
