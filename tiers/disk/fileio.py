"""Positional reads and writes of whole slots, through kvikio or plain POSIX calls.

kvikio (``CuFile``) is optional: it is imported only when asked for, and it needs the CUDA
driver (``libcuda.so.1``) even for host buffers, so its absence or a missing driver selects the
POSIX path instead of failing. The POSIX path keeps two descriptors on the file: one opened with
O_DIRECT (page cache bypassed, as NVMe wants for large sequential slots) and one buffered, used
when a buffer or size is not page aligned or the file system refuses O_DIRECT (tmpfs does).
"""

from __future__ import annotations

import ctypes
import errno
import os
from typing import Any, Literal, Protocol

import numpy as np

from kvledger.tiers.layout import PAGE_ALIGNMENT

Backend = Literal["auto", "posix", "kvikio"]


class FileIO(Protocol):
    """Moves whole buffers to and from byte offsets of one file; raises OSError on failure."""

    name: str

    def write(self, buf: np.ndarray, offset: int) -> None: ...

    def read(self, buf: np.ndarray, offset: int) -> int: ...

    def close(self) -> None: ...


class PosixFileIO:
    """``os.pwritev``/``os.preadv``, with O_DIRECT whenever the buffer and file allow it."""

    def __init__(self, path: str, *, direct: bool = True) -> None:
        self.name = "posix"
        self.buffered_fd = os.open(path, os.O_RDWR)
        self.direct_fd: int | None = None
        if direct and hasattr(os, "O_DIRECT"):
            try:
                self.direct_fd = os.open(path, os.O_RDWR | os.O_DIRECT)
            except OSError as exc:
                if exc.errno != errno.EINVAL:  # EINVAL: this file system has no O_DIRECT
                    os.close(self.buffered_fd)
                    raise
        if self.direct_fd is not None:
            self.name = "posix+odirect"

    def _fd_for(self, buf: np.ndarray, offset: int) -> int:
        if (
            self.direct_fd is not None
            and buf.ctypes.data % PAGE_ALIGNMENT == 0
            and buf.nbytes % PAGE_ALIGNMENT == 0
            and offset % PAGE_ALIGNMENT == 0
        ):
            return self.direct_fd
        return self.buffered_fd

    def write(self, buf: np.ndarray, offset: int) -> None:
        fd = self._fd_for(buf, offset)
        done = 0
        view = buf.data.cast("B")
        while done < len(view):
            n = os.pwritev(fd, [view[done:]], offset + done)
            if n == 0:
                raise OSError(errno.EIO, "write made no progress")
            done += n

    def read(self, buf: np.ndarray, offset: int) -> int:
        """Fill ``buf`` from ``offset``; returns the bytes read (fewer only at end of file)."""
        fd = self._fd_for(buf, offset)
        done = 0
        view = buf.data.cast("B")
        while done < len(view):
            n = os.preadv(fd, [view[done:]], offset + done)
            if n == 0:
                break
            done += n
        return done

    def close(self) -> None:
        for fd in (self.buffered_fd, self.direct_fd):
            if fd is not None:
                os.close(fd)
        self.direct_fd = None


class KvikioFileIO:
    """kvikio ``CuFile``: GPUDirect Storage when the driver has it, its POSIX mode otherwise."""

    def __init__(self, path: str) -> None:
        import kvikio

        self.name = "kvikio"
        self._file: Any = kvikio.CuFile(path, "r+")

    def write(self, buf: np.ndarray, offset: int) -> None:
        written = int(self._file.pwrite(buf, buf.nbytes, offset).get())
        if written != buf.nbytes:
            raise OSError(errno.EIO, f"kvikio wrote {written} of {buf.nbytes} bytes")

    def read(self, buf: np.ndarray, offset: int) -> int:
        return int(self._file.pread(buf, buf.nbytes, offset).get())

    def close(self) -> None:
        self._file.close()


def kvikio_unavailable_reason() -> str | None:
    """Why kvikio cannot be used here, or None when it can."""
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError as exc:
        return f"the CUDA driver library libcuda.so.1 is missing ({exc})"
    try:
        import kvikio  # noqa: F401
    except Exception as exc:  # ImportError, or OSError/RuntimeError from its native parts
        return f"kvikio cannot be imported ({type(exc).__name__}: {exc})"
    return None


def open_file_io(path: str, backend: Backend, *, direct: bool) -> FileIO:
    """The I/O path for ``backend``; ``auto`` prefers kvikio and falls back to POSIX silently."""
    if backend not in ("auto", "posix", "kvikio"):
        raise ValueError(f"unknown G3 I/O backend {backend!r}; expected auto, posix or kvikio")
    if backend != "posix":
        reason = kvikio_unavailable_reason()
        if reason is None:
            return KvikioFileIO(path)
        if backend == "kvikio":
            raise RuntimeError(f"G3 I/O backend 'kvikio' was asked for but {reason}")
    return PosixFileIO(path, direct=direct)
