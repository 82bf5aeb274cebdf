"""A G3 file's slots mapped into memory, so that other workers READ them in place over NIXL.

SGLang's L3 lives below its own host pool, so the copy of a page that another rank can read is
the one in its G3 file. Mapping the file (read-only, shared: what the tier writes shows in
the mapping, through the page cache) and registering the mapping with the worker's NIXL agent
as one region lets a peer's READ take a page straight from the file's slots, with no code of
the owner running and no copy into a host buffer first.

The owner keeps writing while peers read, so nothing here promises that a slot still holds
the block its directory entry names: the entry carries the checksum the G3 index recorded when
the block was written (``checksum``), and the reader checks the bytes it got against it and
looks the entry up again afterwards (``RemoteFetcher.execute``). A slot reused in between is a
miss, never another page's bytes.
"""

from __future__ import annotations

import mmap
import os

import numpy as np

from kvledger.events.types import Tier
from kvledger.tiers.disk.tier import DiskTier
from kvledger.tiers.remote.directory import Region


class MappedG3:
    """The slots of ``disk``'s file as one ``Region`` (``region``) for ``RemoteAgent``.

    Map it after the tier is opened (recovery may resize the file) and close it after the
    agent that registered it is closed (a peer's READ must not find the memory unmapped).
    """

    def __init__(self, disk: DiskTier) -> None:
        self.disk = disk
        self.tier = Tier.G3
        self.shape = disk.shape
        fd = os.open(disk.path, os.O_RDONLY)
        try:
            self._map = mmap.mmap(fd, disk.file_bytes, mmap.MAP_SHARED, mmap.PROT_READ)
        finally:
            os.close(fd)  # the mapping holds the file
        self._bytes: np.ndarray | None = np.frombuffer(self._map, dtype=np.uint8)
        self.region = Region(
            tier=Tier.G3,
            mem_type="DRAM",
            device_id=0,
            address=int(self._bytes.ctypes.data) + disk.data_offset,
            num_slots=disk.num_slots,
            stride=disk.slot_bytes,
        )

    def checksum(self, slot: int) -> int:
        """The checksum the G3 index recorded for ``slot``'s block when it was written."""
        return int(self.disk.table["checksum"][slot])

    def slot_bytes(self, slot: int) -> np.ndarray:
        """A read-only view of the block in ``slot`` (what a peer's READ gets)."""
        if self._bytes is None:
            raise ValueError(f"the mapping of {self.disk.path} is closed")
        self.region.slot_address(slot)  # raises for a slot outside the file
        start = self.disk.slot_offset(slot)
        return self._bytes[start : start + self.disk.block_bytes]

    def close(self) -> None:
        """Unmap the file (after the NIXL agent let go of it)."""
        self._bytes = None  # the mapping cannot close while a view of it is alive
        self._map.close()
