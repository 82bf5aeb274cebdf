"""Reading another worker's G3 file on a shared file system, without its lock.

The owner keeps writing while a peer reads, so a read is trusted only when the slot's index
entry names the wanted block before and after the bytes are read and the bytes match the
entry's checksum: a slot reused in between is a miss, never another block's bytes.
"""

from __future__ import annotations

import json
import os
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
        table = self._table()
        want = index.VALID | index.NAMED
        hits = np.flatnonzero(
            (table["sequence_hash"] == np.uint64(sequence_hash))
            & (table["local_hash"] == np.uint64(local_hash))
            & ((table["flags"] & want) == want)
        )
        for slot in hits.tolist():
            entry = self._entry(slot)
            if not index.intact(np.frombuffer(entry, dtype=ENTRY))[0]:
                continue
            buf = np.frombuffer(
                os.pread(self._data_fd, self.block_bytes, HEADER_BYTES + slot * self.slot_bytes),
                dtype=np.uint8,
            )
            checksum = int(np.frombuffer(entry, dtype=ENTRY)["checksum"][0])
            if (
                len(buf) == self.block_bytes
                and xxhash.xxh3_64_intdigest(buf.data) == checksum
                and self._entry(slot) == entry  # not rewritten while read
            ):
                return buf.copy()
        return None

    def close(self) -> None:
        os.close(self._data_fd)
        os.close(self._index_fd)
