"""A log that lies where it cannot be written still reads: replay, inspect and tail.

The tests run as root, which file permissions do not stop, so the log goes where the kernel
refuses every writer: a read-only mount, or a folder marked immutable (``chattr +i``). SQLite
cannot create the log's -shm file next to it there, which is what a plain open needs.
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from event_streams import tee

from kvledger.cli import main
from kvledger.events.log import EventLog
from kvledger.events.log.replay import replay
from kvledger.events.types import AnyEvent, BlockInfo, Tier
from kvledger.registry.emitter import EventEmitter
from kvledger.registry.state import RegistryState


def _run(*cmd: str) -> bool:
    return subprocess.run(cmd, capture_output=True).returncode == 0


def _write_log(path: Path) -> list[AnyEvent]:
    seen: list[AnyEvent] = []
    with EventLog(str(path)) as log:
        emitter = EventEmitter(tee(log.append, seen.append), worker_id=3)
        for i in range(50):
            emitter.stored(Tier.G1, None, [(i, i)])
            if i % 3 == 0:
                emitter.copied(Tier.G1, Tier.G2, [BlockInfo(i, i, None)])
            if i % 4 == 0:
                emitter.removed(Tier.G1, [i])
    return seen


@pytest.fixture(params=["read-only mount", "immutable folder"])
def read_only_log(
    request: pytest.FixtureRequest, tmp_path: Path
) -> Iterator[tuple[Path, list[AnyEvent]]]:
    """(path of a closed log nobody may write next to, the events it holds)."""
    folder = tmp_path / "logs"
    folder.mkdir()
    path = folder / "events.db"
    if request.param == "read-only mount":
        if not _run("mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(folder)):
            pytest.skip("cannot mount a tmpfs here (needs CAP_SYS_ADMIN)")
        try:
            events = _write_log(path)
            assert _run("mount", "-o", "remount,ro", str(folder))
            yield path, events
        finally:
            _run("umount", str(folder))
    else:
        events = _write_log(path)
        if not _run("chattr", "+i", str(folder)):
            pytest.skip("cannot mark a folder immutable here (chattr, CAP_LINUX_IMMUTABLE)")
        try:
            yield path, events
        finally:
            _run("chattr", "-i", str(folder))
    assert not Path(f"{path}-shm").exists()


def test_the_folder_really_refuses_writes(read_only_log: tuple[Path, list[AnyEvent]]) -> None:
    path, _ = read_only_log
    with pytest.raises(OSError):
        Path(f"{path}-shm").touch()


def test_read_only_log_reads_and_replays(read_only_log: tuple[Path, list[AnyEvent]]) -> None:
    path, events = read_only_log
    with EventLog(str(path), read_only=True) as log:
        assert not log.writable
        assert list(log.read()) == events
        assert log.summary().rows == len(events)
        assert log.last_event_id(3) == len(events) - 1
        state = replay(log, checkpoint_every=10)  # no checkpoint can be stored: none is tried
    assert state == RegistryState.from_events(events)


def test_replay_inspect_and_tail_commands_read_it(
    read_only_log: tuple[Path, list[AnyEvent]], capsys: pytest.CaptureFixture[str]
) -> None:
    path, events = read_only_log
    assert main(["replay", str(path)]) == 0
    assert main(["inspect", str(path)]) == 0
    assert f"rows: {len(events)} (positions 1..{len(events)}): {len(events)} events" in (
        capsys.readouterr().out
    )
    assert main(["tail", str(path), "--no-follow", "-n", "3"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 3 and lines[-1].split()[1] == f"w3#{len(events) - 1}"
