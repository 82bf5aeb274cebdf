"""The event log of a simulated worker: opening it, its lookup records, checking its replay.

Shared by ``kvledger simulate`` for one worker and for a cluster (one log per worker).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from kvledger.config import Settings, ensure_log_folder
from kvledger.events.types import lookup_stream
from kvledger.registry.lookups import LookupRecorder
from kvledger.registry.state import RegistryState

if TYPE_CHECKING:  # SQLAlchemy loads only for a run that writes a log
    from kvledger.events.log import EventLog


def lookup_recorder(
    log: EventLog, settings: Settings, clock: Callable[[], float]
) -> LookupRecorder:
    """Lookup records to ``log``, numbered on from the worker's earlier ones, starting with
    the run's settings."""
    worker = settings.worker_id
    recorder = LookupRecorder(
        log.append,
        worker_id=worker,
        dp_rank=settings.dp_rank,
        first_id=log.last_event_id(lookup_stream(worker)) + 1,
        clock=clock,
    )
    recorder.run(
        g1_blocks=settings.g1_blocks,
        g2_blocks=settings.g2_capacity,
        g3_blocks=settings.g3_capacity,
        block_size=settings.block_size,
        policy=settings.eviction_policy,
        offload_filter=settings.offload_filter,
    )
    return recorder


def open_log(url: str, settings: Settings) -> EventLog:
    """The event log at ``url``; a new SQLite file is made readable by its owner only (SQLite
    gives its journal the same mode), as prompts' hashes are users' data."""
    import sqlalchemy as sa

    from kvledger.events.log import EventLog

    try:
        ensure_log_folder(url)
        parsed = sa.make_url(url)
        if parsed.get_backend_name() == "sqlite" and parsed.database not in (None, "", ":memory:"):
            private_file(Path(parsed.database))
        return EventLog(url, **settings.event_log_options())
    except sa.exc.ArgumentError as exc:  # unparsable URL, unknown driver
        raise ValueError(f"cannot open the event log {url!r}: {exc}") from None


def replay_matches(url: str, worker: int, live: RegistryState, note: Callable[[str], None]) -> bool:
    """Replay the log and compare this worker's part of it with the live state."""
    from kvledger.events.log.replay import replay

    replayed = replay(url)
    mine = RegistryState.from_mapping({k: v for k, v in replayed.tiers.items() if k[0] == worker})
    if mine == live:
        return True
    for line in mine.diff(live)[:10]:
        note(f"replay differs: {line}")
    return False


def private_file(path: Path) -> None:
    """Create ``path`` empty, readable and writable by its owner only, unless it exists."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return
    os.close(fd)
