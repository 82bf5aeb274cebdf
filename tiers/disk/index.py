"""The G3 slot index: a side file with one self-describing 64-byte entry per slot.

An entry says which block a slot holds (sequence, local and parent hash), the xxh3-64 of the
slot's bytes, and the order in which slots were written (``stamp``), so a restarted worker can
tell what is on disk without trusting anything but the file itself. The last field is an
xxh3-64 of the other seven: a torn or damaged entry is recognised, never misread as a block.
Entries are 64 bytes so none straddles a page (a crash tears pages, not halves of entries).

The index lives beside the slots rather than in front of them so that changing the slot
count only grows or cuts the ends of the two files; nothing has to move.
"""

from __future__ import annotations

import numpy as np
import xxhash

from kvledger.events.types import BlockInfo

ENTRY = np.dtype(
    [
        ("checksum", "<u8"),
        ("flags", "<u8"),
        ("sequence_hash", "<u8"),
        ("local_hash", "<u8"),
        ("parent_hash", "<u8"),
        ("stamp", "<u8"),
        ("reserved", "<u8"),
        ("check", "<u8"),
    ]
)
assert ENTRY.itemsize == 64

VALID = 1  # the slot's bytes were written completely and ``checksum`` is theirs
NAMED = 2  # the entry names its block (writes made without a block name cannot be recovered)
HAS_PARENT = 4  # ``parent_hash`` is meaningful (a first block has no parent)

_CHECKED = ENTRY.itemsize - 8


def entry_bytes(checksum: int, stamp: int, block: BlockInfo | None) -> bytes:
    """The 64 bytes describing a slot just written with ``checksum``."""
    flags = VALID
    seq = local = parent = 0
    if block is not None:
        flags |= NAMED
        seq, local, maybe_parent = block
        if maybe_parent is not None:
            flags |= HAS_PARENT
            parent = maybe_parent
    entry = np.array([(checksum, flags, seq, local, parent, stamp, 0, 0)], dtype=ENTRY)
    entry["check"] = xxhash.xxh3_64_intdigest(entry.tobytes()[:_CHECKED])
    return entry.tobytes()


def intact(table: np.ndarray) -> np.ndarray:
    """Per entry: whether its check field matches the rest (an all-zero entry is intact)."""
    raw = table.view(np.uint8).reshape(len(table), ENTRY.itemsize)
    ok: np.ndarray = (table["flags"] == 0) & (table["check"] == 0)
    digest = xxhash.xxh3_64_intdigest
    for i in np.flatnonzero(~ok):
        ok[i] = digest(raw[i, :_CHECKED].tobytes()) == int(table["check"][i])
    return ok


def block_of(entry: np.void) -> BlockInfo | None:
    """The block an entry names, or None when it names none."""
    flags = int(entry["flags"])
    if not flags & NAMED:
        return None
    parent = int(entry["parent_hash"]) if flags & HAS_PARENT else None
    return BlockInfo(int(entry["sequence_hash"]), int(entry["local_hash"]), parent)
