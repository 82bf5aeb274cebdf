"""Files and folders kvledger creates: readable by their owner only, whatever the umask.

The event log holds prompts' token ids and block hashes, the G3 file holds their KV bytes, and
state dumps and plots describe them: under the usual umask 022 a plain ``open`` or ``mkdir``
would let every local user read them. So every file kvledger creates is 0600 and every folder
0700, set explicitly after creation (the mode given to ``open`` and ``mkdir`` is masked by the
umask). A file or folder that already exists is the operator's: its mode is left alone, and a
file that others may read is reported once (``LooseFileWarning``) with the command that fixes it.

SQLite creates a database's ``-wal`` and ``-shm`` files with the database file's own mode, so
creating the database file here first (``private_file``) makes all three private.
"""

from __future__ import annotations

import os
import stat
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO

FILE_MODE = 0o600
FOLDER_MODE = 0o700
_OTHERS = stat.S_IRWXG | stat.S_IRWXO

_warned: set[str] = set()


class LooseFileWarning(UserWarning):
    """A file kvledger reuses can be read or written by users other than its owner."""


def private_folder(path: str | os.PathLike[str]) -> Path:
    """Create ``path`` and any missing parent as 0700 folders; an existing one is left as
    it is. Returns the path."""
    folder = Path(path)
    missing: list[Path] = []
    at = folder
    while not at.is_dir():
        missing.append(at)
        if at.parent == at:
            break
        at = at.parent
    for new in reversed(missing):
        try:
            new.mkdir(mode=FOLDER_MODE)
        except FileExistsError:
            if not new.is_dir():  # a file where a folder should be: say so, by name
                raise NotADirectoryError(
                    f"{new} is a file, not a folder; kvledger needs a folder there"
                ) from None
            continue  # made by a process beside us meanwhile: theirs to keep as it is
        os.chmod(new, FOLDER_MODE)  # mkdir's mode is masked by the umask
    return folder


def private_file(path: str | os.PathLike[str]) -> bool:
    """Create ``path`` as an empty 0600 file if it does not exist (True); an existing file is
    checked (``check_private``) and kept (False). Its folder must exist: a missing one is
    reported by name rather than created, so a mistyped path creates nothing."""
    file = Path(path)
    if not file.parent.is_dir():
        raise FileNotFoundError(
            f"folder {file.parent} does not exist (for {file.name}); create it first"
        )
    try:
        fd = os.open(file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, FILE_MODE)
    except FileExistsError:
        check_private(file)
        return False
    try:
        os.fchmod(fd, FILE_MODE)
    finally:
        os.close(fd)
    return True


def check_private(*paths: str | os.PathLike[str]) -> None:
    """Warn once per file about each of ``paths`` that exists and that users other than its
    owner may read or write."""
    for path in paths:
        try:
            mode = os.stat(path).st_mode
        except FileNotFoundError:
            continue
        if not stat.S_ISREG(mode) or not mode & _OTHERS:
            continue
        name = str(path)
        if name in _warned:
            continue
        _warned.add(name)
        warnings.warn(
            f"{name} is readable by other users (mode {stat.S_IMODE(mode):04o}) and holds "
            f"users' prompts or what they cached; run `chmod 600 {name}`",
            LooseFileWarning,
            stacklevel=3,
        )


@contextmanager
def open_private(path: str | os.PathLike[str], mode: str = "wb") -> Iterator[IO[bytes]]:
    """Open ``path`` for writing as a 0600 file, replacing what it held (an export: a state
    dump, a plot). An existing file is made 0600 too: its contents are ours now."""
    if mode not in ("wb", "w+b"):
        raise ValueError(f"open_private writes bytes; mode {mode!r}")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, FILE_MODE)
    try:
        os.fchmod(fd, FILE_MODE)
    except BaseException:
        os.close(fd)
        raise
    with os.fdopen(fd, mode) as file:
        yield file


def write_private(path: str | os.PathLike[str], data: bytes) -> None:
    """``open_private(path)`` and write ``data``."""
    with open_private(path) as file:
        file.write(data)
