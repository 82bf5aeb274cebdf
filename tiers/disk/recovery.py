"""Which slots of a reopened G3 file may be served again, and where they go.

Pure decisions over the index (``index.py``); the tier does the reads and writes. A slot is
kept when its entry is intact, says the slot was written completely, names a block the caller
knows with the same local and parent hash (the event log's fold: a block the log does not
list may be half-evicted, and one whose hashes differ is not the block the log means), and its
bytes pass their checksum. When two slots name one block the newest write wins. When the file
shrinks, the newest kept slots are the ones that stay, moved down into free slots if needed.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from kvledger.events.types import BlockInfo
from kvledger.tiers.disk import index

KnownBlocks = Mapping[int, tuple[int, int | None]]
"""``{sequence_hash: (local_hash, parent_hash)}``: what the event log says G3 holds."""


@dataclass
class SlotRecovery:
    """What reopening a G3 file kept and dropped, for the caller to report and log.

    ``corrupt`` and ``no_room`` name the blocks (None for a slot written without a name) so
    the caller can tell the log which known blocks went and why.
    """

    kept: int = 0
    #: slots whose bytes failed their checksum
    corrupt: list[BlockInfo | None] = field(default_factory=list)
    #: entries failing their own check (torn or damaged index): their slot is freed
    damaged: int = 0
    #: intact slots naming no block the caller knows: freed
    ignored: int = 0
    #: older copies of a block that a newer slot holds too: freed
    duplicates: int = 0
    #: verified slots dropped because the file shrank below them
    no_room: list[BlockInfo | None] = field(default_factory=list)
    seconds: float = 0.0


@dataclass
class RecoveryPlan:
    """Old slot -> new slot for every kept slot; ``moves`` are the ones whose bytes move."""

    placed: list[tuple[int, int]]
    moves: list[tuple[int, int]]
    report: SlotRecovery


def candidates(table: np.ndarray, known: KnownBlocks | None) -> tuple[list[int], SlotRecovery]:
    """Slots worth reading back, newest write first, and the count of those already refused.

    Without ``known`` every intact, completely written slot is a candidate (a tier opened
    on its own); with it, only slots naming a known block exactly.
    """
    report = SlotRecovery()
    ok = index.intact(table)
    valid = (table["flags"] & index.VALID) != 0
    report.damaged = int(np.count_nonzero(valid & ~ok))
    slots = np.flatnonzero(valid & ok)
    slots = slots[np.argsort(-table["stamp"][slots].astype(np.int64), kind="stable")]
    if known is None:
        return [int(s) for s in slots], report
    out: list[int] = []
    for slot in slots:
        block = index.block_of(table[slot])
        if block is not None and known.get(block.sequence_hash) == block[1:]:
            out.append(int(slot))
        else:
            report.ignored += 1
    return out, report


def place(
    table: np.ndarray, slots: list[int], good: list[bool], report: SlotRecovery, num_slots: int
) -> RecoveryPlan:
    """Decide where each verified candidate (``slots``, newest first) lives in a file of
    ``num_slots`` slots: a slot that fits stays, one beyond the end moves into a free slot."""
    kept: list[int] = []
    seen: set[int] = set()
    for slot, fine in zip(slots, good, strict=True):
        block = index.block_of(table[slot])
        if not fine:
            report.corrupt.append(block)
        elif block is not None and block.sequence_hash in seen:
            report.duplicates += 1
        else:
            if block is not None:
                seen.add(block.sequence_hash)
            kept.append(slot)
    for slot in kept[num_slots:]:
        report.no_room.append(index.block_of(table[slot]))
    kept = kept[:num_slots]
    staying = {s for s in kept if s < num_slots}
    free = (s for s in range(num_slots) if s not in staying)
    placed: list[tuple[int, int]] = []
    moves: list[tuple[int, int]] = []
    for slot in kept:
        if slot in staying:
            placed.append((slot, slot))
        else:
            dst = next(free)
            placed.append((slot, dst))
            moves.append((slot, dst))
    report.kept = len(placed)
    return RecoveryPlan(placed, moves, report)
