"""G3: one preallocated file of fixed-size slots under the data directory, and its index.

Files, all in the data directory (``<name>`` is ``g3-slots.bin`` by default):

- ``<name>``: a 4 KiB JSON header (so a file made for another block shape is refused, not
  misread), then the slots, each starting on a page so they can be read and written with
  O_DIRECT. The space is reserved with ``posix_fallocate`` up front, so a full disk is
  reported once, at start, instead of halfway through an offload.
- ``<name>.idx``: one self-describing entry per slot (``kvledger.tiers.disk.index``): which
  block it holds, the xxh3-64 of its bytes, when it was written.
- ``<name>.lock``: held with ``flock`` while a tier has the file open (``lock.py``).

Every read is checked against the slot's checksum: a mismatch is a miss (and counted), never
bytes handed on. Reopening an existing file keeps the slots that survive ``recovery.py``'s
checks; a different slot count resizes the files in place.
"""

from __future__ import annotations

import errno
import itertools
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import xxhash

from kvledger.events.files import check_private, private_folder
from kvledger.events.types import BlockInfo, Tier
from kvledger.tiers.base import StorageTier
from kvledger.tiers.disk import index, recovery
from kvledger.tiers.disk.fileio import Backend, FileIO, open_file_io
from kvledger.tiers.disk.lock import SlotFileLock
from kvledger.tiers.disk.recovery import KnownBlocks, SlotRecovery
from kvledger.tiers.layout import PAGE_ALIGNMENT, BlockShape

log = logging.getLogger(__name__)

MAGIC = "kvledger-g3"
FORMAT_VERSION = 2
HEADER_BYTES = PAGE_ALIGNMENT
VERIFY_READ_BYTES = 16 << 20
ENTRY = index.ENTRY
#: header fields that must match for the slots to be readable by this tier
LAYOUT_FIELDS = (
    "slot_bytes",
    "block_bytes",
    "num_layers",
    "outer_dim",
    "page_size",
    "inner_dim",
    "dtype",
)

_WHAT_RAN_OUT = {
    errno.ENOSPC: "the file system is out of space",
    errno.EFBIG: "the file size limit (RLIMIT_FSIZE or the file system's maximum) was reached",
    errno.EDQUOT: "the disk quota is exhausted",
}

_T = TypeVar("_T")
_R = TypeVar("_R")


class DiskTierError(OSError):
    """A G3 file operation failed; the message names the file and what went wrong."""


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


class DiskTier(StorageTier):
    """G3 slots in ``<directory>/<file_name>``.

    An existing file is reopened and its slots recovered (``recovery`` tells what survived):
    with ``known`` (``{sequence_hash: (local_hash, parent_hash)}``, what the event log says
    this tier holds, or a function returning it, called once the file is locked so that a
    refused second owner does no work) only slots that name one of those blocks exactly and
    pass their checksum are kept; without it every intact slot is. A file of another slot
    count is resized: growing keeps everything, shrinking keeps the most recently written
    slots that fit. A file made for another block shape is refused with what to do.
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
        known: KnownBlocks | Callable[[], KnownBlocks] | None = None,
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
        self.data_offset = HEADER_BYTES
        self.file_bytes = self.data_offset + num_blocks * self.slot_bytes
        self.corrupt_reads = 0
        self.empty_reads = 0
        self.io_threads = io_threads
        self._count_lock = threading.Lock()

        directory = private_folder(directory)  # 0700: its files are prompts' KV bytes
        self.path = directory / file_name
        self.index_path = self.path.with_name(self.path.name + ".idx")
        check_private(self.path, self.index_path)  # made by hand, or by an older kvledger
        self._lock = SlotFileLock(self.path)
        self._fds: list[int] = []
        try:
            old_slots = self._existing_slots()
            if old_slots is None:
                self._create()
            self._data_fd = self._open_fd(self.path)
            self._index_fd = self._open_fd(self.index_path)
            self.io: FileIO = open_file_io(str(self.path), backend, direct=direct)
            self._pool = ThreadPoolExecutor(io_threads, thread_name_prefix="kvledger-g3")
        except BaseException:
            self._close_fds()
            self._lock.release()
            raise
        try:
            if old_slots is None:
                self.table = np.zeros(num_blocks, dtype=ENTRY)
                self.recovery = SlotRecovery()
            else:
                self.recovery = self._recover(old_slots, known() if callable(known) else known)
        except BaseException:
            self.close()
            raise
        stamps = self.table["stamp"]
        self._stamps = itertools.count(int(stamps.max()) + 1 if len(stamps) else 1)

    # -- opening -------------------------------------------------------------------------------

    def _header(self, num_slots: int) -> bytes:
        fields: dict[str, Any] = {
            "magic": MAGIC,
            "version": FORMAT_VERSION,
            "num_slots": num_slots,
            "slot_bytes": self.slot_bytes,
            "block_bytes": self.block_bytes,
            "num_layers": self.shape.num_layers,
            "outer_dim": self.shape.outer_dim,
            "page_size": self.shape.page_size,
            "inner_dim": self.shape.inner_dim,
            "dtype": str(self.shape.dtype),
        }
        return json.dumps(fields, sort_keys=True).encode().ljust(HEADER_BYTES, b"\n")

    def _existing_slots(self) -> int | None:
        """The slot count of a usable existing file; None when there is none to reopen.

        A file of format 1 (slots that do not name their blocks) cannot be recovered and is
        replaced; anything that is not a G3 file, or one made for another block shape, is
        refused with what to do, since its bytes would be misread.
        """
        if not self.path.exists() or os.path.getsize(self.path) == 0:
            return None
        with open(self.path, "rb") as f:
            found = f.read(HEADER_BYTES)
        try:
            fields = json.loads(found.rstrip(b"\n"))
        except ValueError:
            fields = None
        if not isinstance(fields, dict) or fields.get("magic") != MAGIC:
            raise ValueError(
                f"{self.path} exists and is not a kvledger G3 file; move it away or point "
                "data_dir (KVLEDGER_DATA_DIR) elsewhere"
            )
        expected = json.loads(self._header(self.num_slots).rstrip(b"\n"))
        wrong = sorted(k for k in LAYOUT_FIELDS if fields.get(k) != expected[k])
        if wrong:
            diffs = ", ".join(f"{k}={fields.get(k)!r} (want {expected[k]!r})" for k in wrong)
            raise ValueError(
                f"{self.path} was made for another layout: {diffs}; its blocks cannot serve "
                f"this model: delete {self.path} and {self.index_path.name} to start an empty "
                "disk cache, or point data_dir (KVLEDGER_DATA_DIR) elsewhere"
            )
        if fields.get("version") != FORMAT_VERSION or not self.index_path.exists():
            log.warning(
                "%s has G3 format %s without a slot index; its slots cannot be recovered, "
                "starting an empty disk cache",
                self.path,
                fields.get("version"),
            )
            self.path.unlink()
            return None
        slots = fields.get("num_slots")
        if not isinstance(slots, int) or slots < 0:
            raise ValueError(f"{self.path} has a damaged header: num_slots={slots!r}")
        return slots

    def _create(self) -> None:
        """A new data file and an empty index; nothing is left behind when space runs out."""
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                os.posix_fallocate(fd, 0, self.file_bytes)
                os.pwrite(fd, self._header(self.num_slots), 0)
            finally:
                os.close(fd)
            fd = os.open(self.index_path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
            try:  # reserved too: a sparse index would run out of room at its first writes
                os.posix_fallocate(fd, 0, self.num_slots * ENTRY.itemsize)
            finally:
                os.close(fd)
        except OSError as exc:
            self.path.unlink(missing_ok=True)
            self.index_path.unlink(missing_ok=True)
            raise self._error(exc, f"cannot reserve {self.file_bytes} bytes") from exc

    def _open_fd(self, path: Path) -> int:
        fd = os.open(path, os.O_RDWR)
        self._fds.append(fd)
        return fd

    def _recover(self, old_slots: int, known: KnownBlocks | None) -> SlotRecovery:
        """Keep what survives the checks, resized to ``num_slots``; rewrite index and header."""
        started = time.perf_counter()
        size = old_slots * ENTRY.itemsize
        raw = os.pread(self._index_fd, size, 0).ljust(size, b"\0")  # a short index: invalid
        old = np.frombuffer(raw, dtype=ENTRY).copy()
        slots, report = recovery.candidates(old, known)
        in_file_order = sorted(slots)  # each I/O thread then reads one stretch of the file
        fine = dict(zip(in_file_order, self._verify(in_file_order, old["checksum"]), strict=True))
        good = [fine[slot] for slot in slots]
        plan = recovery.place(old, slots, good, report, self.num_slots)
        # growing, cut short, or sparse (copied, or made before its space was reserved): the
        # room every later write needs is reserved now, or refused now, by name
        self._reserve(self.file_bytes)
        self.table = np.zeros(self.num_slots, dtype=ENTRY)
        for src, dst in plan.moves:
            self._move(src, dst)
        for src, dst in plan.placed:
            self.table[dst] = old[src]
        os.fsync(self._data_fd)
        os.pwrite(self._index_fd, self.table.tobytes(), 0)
        os.ftruncate(self._index_fd, self.num_slots * ENTRY.itemsize)
        os.fsync(self._index_fd)
        if self.num_slots != old_slots:
            os.pwrite(self._data_fd, self._header(self.num_slots), 0)
            os.ftruncate(self._data_fd, self.file_bytes)
            os.fsync(self._data_fd)
            log.info("resized %s from %d to %d slots", self.path, old_slots, self.num_slots)
        plan.report.seconds = time.perf_counter() - started
        return plan.report

    def _reserve(self, nbytes: int) -> None:
        try:
            os.posix_fallocate(self._data_fd, 0, nbytes)
        except OSError as exc:
            raise self._error(exc, f"cannot grow the file to {nbytes} bytes") from exc

    def _verify(self, slots: list[int], checksums: np.ndarray) -> list[bool]:
        """Whether each slot's bytes match its checksum, read by the I/O threads in parallel.

        ``slots`` in file order: each thread reads runs of consecutive slots in requests of
        up to ``VERIFY_READ_BYTES`` (slot by slot, a restart reads a large G3 at about half
        the disk's speed). A slot beyond the end of a file cut short (a crash while it
        shrank) reads short: not intact either."""
        per_read = max(1, VERIFY_READ_BYTES // self.slot_bytes)

        def share(part: list[int]) -> list[bool]:
            buf = _aligned(min(per_read, len(part)) * self.slot_bytes)
            out = []
            for first, count in _runs(part, per_read):
                try:
                    n = self.io.read(buf[: count * self.slot_bytes], self.slot_offset(first))
                except OSError as exc:
                    raise self._error(exc, f"reading slots {first}.. to verify them") from exc
                for i in range(count):
                    at = i * self.slot_bytes
                    block = buf[at : at + self.block_bytes]
                    fine = n >= at + self.block_bytes
                    checksum = int(checksums[first + i])
                    out.append(fine and xxhash.xxh3_64_intdigest(block.data) == checksum)
            return out

        return [ok for part in self._parallel(share, slots) for ok in part]

    def _move(self, src: int, dst: int) -> None:
        """Copy a slot's bytes to another slot of the same file (shrinking keeps them)."""
        buf = _aligned(self.block_bytes)
        try:
            self.io.read(buf, self.slot_offset(src))
            self.io.write(buf, self.slot_offset(dst))
        except OSError as exc:
            raise self._error(exc, f"moving slot {src} to {dst}") from exc

    def _error(self, exc: OSError, doing: str) -> DiskTierError:
        cause = _WHAT_RAN_OUT.get(exc.errno or 0, exc.strerror or str(exc))
        return DiskTierError(exc.errno, f"G3 file {self.path}: {doing}: {cause}")

    # -- slots ---------------------------------------------------------------------------------

    def slot_offset(self, slot: int) -> int:
        return self.data_offset + slot * self.slot_bytes

    def is_valid(self, slot: int) -> bool:
        return bool(self.table["flags"][slot] & index.VALID)

    def recovered_blocks(self) -> list[tuple[int, BlockInfo]]:
        """``(slot, block)`` of every slot that names its block, oldest write first."""
        named = [
            (int(slot), block)
            for slot in np.flatnonzero(self.table["flags"] & index.NAMED)
            if (block := index.block_of(self.table[slot])) is not None
        ]
        return sorted(named, key=lambda sb: int(self.table["stamp"][sb[0]]))

    def write_slots(
        self,
        slots: Sequence[int],
        buffers: Sequence[np.ndarray],
        blocks: Sequence[BlockInfo] | None = None,
    ) -> None:
        """Write each buffer (``block_bytes`` uint8) to its slot, then its index entry
        (checksum, and the block's name when ``blocks`` gives it, so a restart can tell
        what the slot holds).

        Raises DiskTierError naming the file and the cause; slots that were being written are
        left invalid, so a failed offload never leaves a slot that reads back as a hit.
        """
        slots = self.check_slots(slots, "destination")
        self._check_buffers(slots, buffers)
        if blocks is not None and len(blocks) != len(slots):
            raise ValueError(f"{len(slots)} G3 slots but {len(blocks)} block names")
        self.table["flags"][slots] = 0
        named: Sequence[BlockInfo | None] = blocks if blocks is not None else [None] * len(slots)
        stamps = [next(self._stamps) for _ in slots]  # write order, for recovery to prefer
        self._parallel(self._write_share, list(zip(slots, buffers, named, stamps, strict=True)))

    def read_slots(self, slots: Sequence[int], buffers: Sequence[np.ndarray]) -> list[bool]:
        """Fill the buffers from the slots; False where a slot is empty or fails its checksum.

        A failed slot is invalidated so it is not trusted again; ``corrupt_reads`` counts
        checksum mismatches and ``empty_reads`` slots that were never (successfully) written.
        """
        slots = self.check_slots(slots, "source")
        self._check_buffers(slots, buffers)
        jobs = list(zip(slots, buffers, strict=True))
        return [ok for part in self._parallel(self._read_share, jobs) for ok in part]

    def _check_buffers(self, slots: list[int], buffers: Sequence[np.ndarray]) -> None:
        if len(buffers) != len(slots):
            raise ValueError(f"{len(slots)} G3 slots but {len(buffers)} buffers")
        for b in buffers:
            if b.nbytes != self.block_bytes or b.dtype != np.uint8:
                raise ValueError(
                    f"G3 buffers must be {self.block_bytes} uint8 bytes, got {b.nbytes} {b.dtype}"
                )

    def _parallel(self, work: Callable[[list[_T]], _R], items: list[_T]) -> list[_R]:
        """Cut ``items`` into one contiguous share per I/O thread and run ``work`` on each."""
        if not items:
            return []
        shares = min(self.io_threads, len(items))
        step = -(-len(items) // shares)
        futures = [self._pool.submit(work, items[i : i + step]) for i in range(0, len(items), step)]
        results: list[_R] = []
        first_error: BaseException | None = None
        for f in futures:  # wait for every share, even after a failure, before reporting
            try:
                results.append(f.result())
            except BaseException as exc:
                first_error = first_error or exc
        if first_error is not None:
            raise first_error
        return results

    def _write_share(self, jobs: list[tuple[int, np.ndarray, BlockInfo | None, int]]) -> None:
        for slot, buf, block, stamp in jobs:
            checksum = xxhash.xxh3_64_intdigest(buf.data)
            entry = index.entry_bytes(checksum, stamp, block)
            try:
                self.io.write(buf, self.slot_offset(slot))
                os.pwrite(self._index_fd, entry, slot * ENTRY.itemsize)
            except OSError as exc:
                raise self._error(exc, f"writing slot {slot}") from exc
            self.table[slot] = np.frombuffer(entry, dtype=ENTRY)[0]

    def _read_share(self, jobs: list[tuple[int, np.ndarray]]) -> list[bool]:
        out = []
        for slot, buf in jobs:
            if not self.table["flags"][slot] & index.VALID:
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
        self.table["flags"][slot] = 0
        os.pwrite(self._index_fd, bytes(ENTRY.itemsize), slot * ENTRY.itemsize)

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self.io.close()
        self._close_fds()
        self._lock.release()

    def _close_fds(self) -> None:
        for fd in self._fds:
            os.close(fd)
        self._fds.clear()


def _runs(slots: list[int], longest: int) -> list[tuple[int, int]]:
    """``(first slot, count)`` of each run of consecutive ``slots``, at most ``longest`` long."""
    runs: list[tuple[int, int]] = []
    for slot in slots:
        if runs and runs[-1][0] + runs[-1][1] == slot and runs[-1][1] < longest:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((slot, 1))
    return runs


def _aligned(nbytes: int) -> np.ndarray:
    """A page-aligned uint8 buffer, so O_DIRECT reads can go into it."""
    raw = np.empty(nbytes + PAGE_ALIGNMENT, dtype=np.uint8)
    start = -raw.ctypes.data % PAGE_ALIGNMENT
    return raw[start : start + nbytes]


__all__ = ["DiskTier", "DiskTierError", "KnownBlocks", "SlotRecovery"]
