"""Property: whatever happened to a G3 file (writes, overwrites, damaged bytes, lost or damaged
index entries, a changed slot count), reopening it with the log's list of blocks serves only
listed blocks with exactly their bytes, and keeps as many of them as have an intact copy and
fit."""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvledger.events.types import BlockInfo
from kvledger.tiers import BlockShape, DiskTier

SHAPE = BlockShape(num_layers=1, outer_dim=2, page_size=4, inner_dim=128, dtype=torch.bfloat16)
SLOTS = 6
HASHES = 8


def block(h: int) -> BlockInfo:
    return BlockInfo(10_000 + h, 20_000 + h, None if h % 3 == 0 else 9_999 + h)


def content(h: int) -> np.ndarray:
    return np.full(SHAPE.block_bytes, 1 + h, dtype=np.uint8)


op = st.one_of(
    st.tuples(st.just("write"), st.integers(0, SLOTS - 1), st.integers(0, HASHES - 1)),
    st.tuples(st.just("bytes"), st.integers(0, SLOTS - 1), st.integers(0, SHAPE.block_bytes - 1)),
    st.tuples(st.just("lose"), st.integers(0, SLOTS - 1), st.just(0)),
    st.tuples(st.just("entry"), st.integers(0, SLOTS - 1), st.integers(0, 63)),
)


@settings(max_examples=60, deadline=None)
@given(
    ops=st.lists(op, max_size=25),
    listed=st.sets(st.integers(0, HASHES - 1)),
    new_slots=st.integers(1, SLOTS + 2),
)
def test_reopened_g3_serves_only_listed_blocks_with_their_bytes(
    ops: list[tuple[str, int, int]], listed: set[int], new_slots: int
) -> None:
    with tempfile.TemporaryDirectory() as folder:
        g3 = DiskTier(folder, SHAPE, SLOTS, io_threads=2)
        holds: dict[int, tuple[int, bool]] = {}  # slot -> (hash, still intact)
        for kind, slot, arg in ops:
            if kind == "write":
                g3.write_slots([slot], [content(arg)], [block(arg)])
                holds[slot] = (arg, True)
            elif kind == "bytes":
                with open(g3.path, "r+b") as f:
                    f.seek(g3.slot_offset(slot) + arg)
                    old = f.read(1)[0]
                    f.seek(g3.slot_offset(slot) + arg)
                    f.write(bytes([(old + 1) % 256]))  # never undone within 25 ops
                if slot in holds:
                    holds[slot] = (holds[slot][0], False)
            else:  # an entry zeroed (lost) or one of its bytes flipped (damaged)
                with open(g3.index_path, "r+b") as f:
                    f.seek(slot * 64 + arg)
                    old = f.read(1)[0]
                    f.seek(slot * 64 + arg)
                    f.write(bytes([0 if kind == "lose" else (old + 1) % 256]))
                holds.pop(slot, None)
        g3.close()
        known = {b.sequence_hash: (b.local_hash, b.parent_hash) for b in map(block, listed)}

        again = DiskTier(Path(folder), SHAPE, new_slots, known=known, io_threads=2)
        try:
            kept = again.recovered_blocks()
            names = [b.sequence_hash for _, b in kept]
            assert len(set(names)) == len(names)
            assert all(known.get(b.sequence_hash) == b[1:] for _, b in kept)
            buffers = [np.empty(SHAPE.block_bytes, dtype=np.uint8) for _ in kept]
            assert again.read_slots([s for s, _ in kept], buffers) == [True] * len(kept)
            for (_, b), buf in zip(kept, buffers, strict=True):
                assert np.array_equal(buf, content(b.sequence_hash - 10_000))
            intact = {h for h, fine in holds.values() if fine} & listed
            assert len(kept) == min(new_slots, len(intact))
        finally:
            again.close()
