"""Reading another worker's G3 file on a shared file system, without its lock.

The owner keeps writing while a peer reads, so a read is trusted only when the slot's index
entry names the wanted block before and after the bytes are read and the bytes match the
entry's checksum: a slot reused in between is a miss, never another block's bytes.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import xxhash

from kvledger.tiers.disk import index
from kvledger.tiers.disk.tier import HEADER_BYTES, MAGIC

ENTRY = index.ENTRY


class PeerG3:
    """Read-only view of the G3 file at ``path`` (its ``.idx`` beside it)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.index_path = self.path.with_name(self.path.name + ".idx")
        self._data_fd = os.open(self.path, os.O_RDONLY)
        try:
            self._index_fd = os.open(self.index_path, os.O_RDONLY)
        except BaseException:
            os.close(self._data_fd)
            raise
        try:
            fields = json.loads(os.pread(self._data_fd, HEADER_BYTES, 0).rstrip(b"\n"))
            if not isinstance(fields, dict) or fields.get("magic") != MAGIC:
                raise ValueError(f"{self.path} is not a kvledger G3 file")
        except BaseException:
            self.close()
            raise
        self.block_bytes = int(fields["block_bytes"])
        self.slot_bytes = int(fields["slot_bytes"])

    def _table(self) -> np.ndarray:
        size = os.fstat(self._index_fd).st_size // ENTRY.itemsize * ENTRY.itemsize
        return np.frombuffer(os.pread(self._index_fd, size, 0), dtype=ENTRY)

    def _entry(self, slot: int) -> bytes:
        return os.pread(self._index_fd, ENTRY.itemsize, slot * ENTRY.itemsize)

    def read(self, sequence_hash: int, local_hash: int) -> np.ndarray | None:
        """The block's bytes, or None when the file does not hold it intact right now."""
        return self.read_many([(sequence_hash, local_hash)])[0]

    def read_many(
        self,
        blocks: Sequence[tuple[int, int]],
        into: Sequence[np.ndarray | None] | None = None,
    ) -> list[np.ndarray | None]:
        """Each (sequence hash, local hash) block's bytes, or None where the file does not
        hold it intact right now. ``into`` gives, per block, a writable uint8 buffer of
        ``block_bytes`` to read into (None: a new one); a block that misses leaves its buffer
        undefined.

        The index is read once for the whole batch (a read of the table per block cost a
        batch of N pages N table reads), and the bytes go straight into their buffer."""
        targets = [None] * len(blocks) if into is None else list(into)
        if len(targets) != len(blocks):
            raise ValueError(f"{len(blocks)} blocks but {len(targets)} buffers")
        for target in targets:
            if target is not None and target.nbytes != self.block_bytes:
                raise ValueError(
                    f"a buffer of {target.nbytes} bytes for {self.path}'s "
                    f"{self.block_bytes}-byte blocks"
                )
        if not blocks:
            return []
        table = self._table()
        want = index.VALID | index.NAMED
        wanted = np.array(sorted({seq for seq, _ in blocks}), dtype=np.uint64)
        candidates = np.flatnonzero(
            np.isin(table["sequence_hash"], wanted) & ((table["flags"] & want) == want)
        )
        slots: dict[tuple[int, int], list[int]] = {}
        for slot in candidates.tolist():
            key = (int(table["sequence_hash"][slot]), int(table["local_hash"][slot]))
            slots.setdefault(key, []).append(slot)
        out: list[np.ndarray | None] = []
        for block, target in zip(blocks, targets, strict=True):
            page = None
            for slot in slots.get(block, ()):
                page = self._read_slot(slot, target)
                if page is not None:
                    break
            out.append(page)
        return out

    def _read_slot(self, slot: int, target: np.ndarray | None) -> np.ndarray | None:
        """The slot's bytes into ``target`` (or a new buffer), if its entry is intact, they
        match its checksum, and the entry did not change while they were read."""
        entry = self._entry(slot)
        row = np.frombuffer(entry, dtype=ENTRY)
        if not index.intact(row)[0]:
            return None
        buf = np.empty(self.block_bytes, dtype=np.uint8) if target is None else target
        got = os.preadv(self._data_fd, [buf.data], HEADER_BYTES + slot * self.slot_bytes)
        checksum = int(row["checksum"][0])
        if (
            got == self.block_bytes
            and xxhash.xxh3_64_intdigest(buf.data) == checksum
            and self._entry(slot) == entry  # not rewritten while read
        ):
            return buf
        return None

    def close(self) -> None:
        os.close(self._data_fd)
        os.close(self._index_fd)
