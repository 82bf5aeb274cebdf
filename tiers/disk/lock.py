"""One owner per G3 file: an exclusive ``flock`` held for the tier's life.

Two managers writing one slot file would hand each other's bytes to their engines (both
believe they own every slot), so the second one must not start. ``flock`` belongs to the open
file, not the process: it also keeps two managers of one process apart, and the kernel drops
it when the owner dies, so a crash never leaves a stale lock to clean up by hand. The owner
writes its pid and host into the lock file for the error message of whoever is refused.
"""

from __future__ import annotations

import fcntl
import os
import socket
from pathlib import Path


class G3InUse(RuntimeError):
    """Another live manager holds this G3 file."""


class SlotFileLock:
    """``<slot file>.lock``, held exclusively from construction until ``release``."""

    def __init__(self, slot_file: Path) -> None:
        self.path = slot_file.with_name(slot_file.name + ".lock")
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_holder(fd)
            os.close(fd)
            raise G3InUse(
                f"the G3 file {slot_file} is in use by another kvledger manager ({holder}); "
                f"two managers cannot share a data folder: give each its own data_dir "
                f"(KVLEDGER_DATA_DIR), or stop the other one first"
            ) from None
        except BaseException:
            os.close(fd)
            raise
        me = f"pid {os.getpid()} on {socket.gethostname()}\n".encode()
        os.ftruncate(fd, 0)
        os.pwrite(fd, me, 0)
        self._fd: int | None = fd

    def release(self) -> None:
        """Unlock (closing the descriptor drops the flock); the file stays, empty of meaning."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def _read_holder(fd: int) -> str:
    try:
        text = os.pread(fd, 256, 0).decode(errors="replace").strip()
    except OSError:
        text = ""
    return text or "holder unknown"
