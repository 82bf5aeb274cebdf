"""The event log of a simulated worker: opening it, its lookup records, checking its replay.

Shared by ``kvledger simulate`` for one worker and for a cluster (one log per worker).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from kvledger.config import Settings
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


def open_log(url: str, settings: Settings, *, default: bool) -> EventLog:
    """The run's log; the data folder is made for the default one (``default``), while a
    log given by ``--log`` needs its folder to exist. The log makes a new SQLite file
    readable by its owner only."""
    import sqlalchemy as sa

    from kvledger.events.log import EventLog

    try:
        if default:
            settings.prepare_log_folder()
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
