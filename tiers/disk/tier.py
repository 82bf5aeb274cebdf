"""G3: one preallocated file of fixed-size slots under the data directory.

File layout: a 4 KiB JSON header (so a file made for another block shape is refused, not
misread), a table of ``(xxh3-64, valid)`` per slot, then the slots, each starting on a page so
they can be read and written with O_DIRECT. The space is reserved with ``posix_fallocate`` when
the tier is made, so a full disk is reported once, up front, instead of halfway through an
offload. Every read is checked against the slot's checksum: a mismatch is a miss (and counted),
never bytes handed on.
"""

from __future__ import annotations

import errno
import json
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import xxhash

from kvledger.events.types import Tier
from kvledger.tiers.base import StorageTier
from kvledger.tiers.disk.fileio import Backend, FileIO, open_file_io
from kvledger.tiers.layout import PAGE_ALIGNMENT, BlockShape

MAGIC = "kvledger-g3"
FORMAT_VERSION = 1
HEADER_BYTES = PAGE_ALIGNMENT
ENTRY = np.dtype([("checksum", "<u8"), ("valid", "<u8")])

_WHAT_RAN_OUT = {
    errno.ENOSPC: "the file system is out of space",
    errno.EFBIG: "the file size limit (RLIMIT_FSIZE or the file system's maximum) was reached",
    errno.EDQUOT: "the disk quota is exhausted",
}


class DiskTierError(OSError):
    """A G3 file operation failed; the message names the file and what went wrong."""


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


class DiskTier(StorageTier):
    """G3 slots in ``<directory>/<file_name>``.

    An existing file with the same header is reopened with its slots and checksums (so a
    restarted worker keeps its disk cache); one with another shape is refused.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        shape: BlockShape,
        num_blocks: int,
        *,
        file_name: str = "g3-slots.bin",
        backend: Backend = "auto",
        direct: bool = True,
        io_threads: int = 4,
    ) -> None:
        if not isinstance(num_blocks, int) or num_blocks < 1:
            raise ValueError(f"G3 needs a positive number of blocks, got {num_blocks!r}")
        if io_threads < 1:
            raise ValueError(f"G3 io_threads must be at least 1, got {io_threads}")
        self.tier = Tier.G3
        self.shape = shape
        self.num_slots = num_blocks
        self.block_bytes = shape.block_bytes
        self.slot_bytes = _round_up(shape.block_bytes, PAGE_ALIGNMENT)
        self.table_offset = HEADER_BYTES
        self.data_offset = HEADER_BYTES + _round_up(num_blocks * ENTRY.itemsize, PAGE_ALIGNMENT)
        self.file_bytes = self.data_offset + num_blocks * self.slot_bytes
        self.corrupt_reads = 0
        self.empty_reads = 0
        self._count_lock = threading.Lock()

        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        self.path = directory / file_name
        header = self._header()
        if self.path.exists():
            self.table = self._reopen(header)
        else:
            self._create(header)
            self.table = np.zeros(num_blocks, dtype=ENTRY)
        self.io: FileIO = open_file_io(str(self.path), backend, direct=direct)
        self._table_fd = os.open(self.path, os.O_RDWR)
        self._pool = ThreadPoolExecutor(io_threads, thread_name_prefix="kvledger-g3")
        self.io_threads = io_threads

    def _header(self) -> bytes:
        fields = {
            "magic": MAGIC,
            "version": FORMAT_VERSION,
            "num_slots": self.num_slots,
            "slot_bytes": self.slot_bytes,
            "block_bytes": self.block_bytes,
            "num_layers": self.shape.num_layers,
            "outer_dim": self.shape.outer_dim,
            "page_size": self.shape.page_size,
            "inner_dim": self.shape.inner_dim,
            "dtype": str(self.shape.dtype),
        }
        return json.dumps(fields, sort_keys=True).encode().ljust(HEADER_BYTES, b"\n")

    def _create(self, header: bytes) -> None:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.posix_fallocate(fd, 0, self.file_bytes)
            os.pwrite(fd, header, 0)
        except OSError as exc:
            os.close(fd)
            self.path.unlink(missing_ok=True)
            raise self._error(exc, f"cannot reserve {self.file_bytes} bytes") from exc
        os.close(fd)

    def _reopen(self, header: bytes) -> np.ndarray:
        with open(self.path, "rb") as f:
            found = f.read(HEADER_BYTES)
            try:
                fields = json.loads(found.rstrip(b"\n"))
            except ValueError:
                fields = None
            if not isinstance(fields, dict) or fields.get("magic") != MAGIC:
                raise ValueError(f"{self.path} exists and is not a kvledger G3 file")
            expected = json.loads(header.rstrip(b"\n"))
            wrong = sorted(k for k in expected if fields.get(k) != expected[k])
            if wrong:
                diffs = ", ".join(f"{k}={fields.get(k)!r} (want {expected[k]!r})" for k in wrong)
                raise ValueError(f"{self.path} was made for another layout: {diffs}")
            f.seek(self.table_offset)
            raw = f.read(self.num_slots * ENTRY.itemsize)
        if os.path.getsize(self.path) < self.file_bytes or len(raw) < self.num_slots * 16:
            raise ValueError(f"{self.path} is truncated: expected {self.file_bytes} bytes")
        return np.frombuffer(raw, dtype=ENTRY).copy()

    def _error(self, exc: OSError, doing: str) -> DiskTierError:
        cause = _WHAT_RAN_OUT.get(exc.errno or 0, exc.strerror or str(exc))
        return DiskTierError(exc.errno, f"G3 file {self.path}: {doing}: {cause}")

    def slot_offset(self, slot: int) -> int:
        return self.data_offset + slot * self.slot_bytes

    def is_valid(self, slot: int) -> bool:
        return bool(self.table["valid"][slot])

    def write_slots(self, slots: Sequence[int], buffers: Sequence[np.ndarray]) -> None:
        """Write each buffer (``block_bytes`` uint8) to its slot with its checksum.

        Raises DiskTierError naming the file and the cause; slots that were being written are
        left invalid, so a failed offload never leaves a slot that reads back as a hit.
        """
        slots = self.check_slots(slots, "destination")
        self._check_buffers(slots, buffers)
        self.table["valid"][slots] = 0
        self._run_split(self._write_share, slots, buffers)

    def read_slots(self, slots: Sequence[int], buffers: Sequence[np.ndarray]) -> list[bool]:
        """Fill the buffers from the slots; False where a slot is empty or fails its checksum.

        A failed slot is invalidated so it is not trusted again; ``corrupt_reads`` counts
        checksum mismatches and ``empty_reads`` slots that were never (successfully) written.
        """
        slots = self.check_slots(slots, "source")
        self._check_buffers(slots, buffers)
        results = self._run_split(self._read_share, slots, buffers)
        return [ok for share in results for ok in share]

    def _check_buffers(self, slots: list[int], buffers: Sequence[np.ndarray]) -> None:
        if len(buffers) != len(slots):
            raise ValueError(f"{len(slots)} G3 slots but {len(buffers)} buffers")
        for b in buffers:
            if b.nbytes != self.block_bytes or b.dtype != np.uint8:
                raise ValueError(
                    f"G3 buffers must be {self.block_bytes} uint8 bytes, got {b.nbytes} {b.dtype}"
                )

    def _run_split(
        self,
        work: Callable[[list[int], Sequence[np.ndarray]], list[bool]],
        slots: list[int],
        buffers: Sequence[np.ndarray],
    ) -> list[list[bool]]:
        """Cut the slots into one contiguous share per I/O thread and run ``work`` on each."""
        if not slots:
            return []
        shares = min(self.io_threads, len(slots))
        step = -(-len(slots) // shares)
        futures = [
            self._pool.submit(work, slots[i : i + step], buffers[i : i + step])
            for i in range(0, len(slots), step)
        ]
        results: list[list[bool]] = []
        first_error: BaseException | None = None
        for f in futures:  # wait for every share, even after a failure, before reporting
            try:
                results.append(f.result())
            except BaseException as exc:
                first_error = first_error or exc
        if first_error is not None:
            raise first_error
        return results

    def _write_share(self, slots: list[int], buffers: Sequence[np.ndarray]) -> list[bool]:
        for slot, buf in zip(slots, buffers, strict=True):
            checksum = xxhash.xxh3_64_intdigest(buf.data)
            try:
                self.io.write(buf, self.slot_offset(slot))
                entry = np.array([(checksum, 1)], dtype=ENTRY)
                os.pwrite(self._table_fd, entry.tobytes(), self.table_offset + slot * 16)
            except OSError as exc:
                raise self._error(exc, f"writing slot {slot}") from exc
            self.table[slot] = (checksum, 1)
        return []

    def _read_share(self, slots: list[int], buffers: Sequence[np.ndarray]) -> list[bool]:
        out = []
        for slot, buf in zip(slots, buffers, strict=True):
            if not self.table["valid"][slot]:
                with self._count_lock:
                    self.empty_reads += 1
                out.append(False)
                continue
            try:
                n = self.io.read(buf, self.slot_offset(slot))
            except OSError as exc:
                raise self._error(exc, f"reading slot {slot}") from exc
            if n != self.block_bytes or xxhash.xxh3_64_intdigest(buf.data) != int(
                self.table["checksum"][slot]
            ):
                with self._count_lock:
                    self.corrupt_reads += 1
                self._invalidate(slot)
                out.append(False)
            else:
                out.append(True)
        return out

    def _invalidate(self, slot: int) -> None:
        self.table["valid"][slot] = 0
        entry = np.array([(0, 0)], dtype=ENTRY)
        os.pwrite(self._table_fd, entry.tobytes(), self.table_offset + slot * 16)

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self.io.close()
        os.close(self._table_fd)
