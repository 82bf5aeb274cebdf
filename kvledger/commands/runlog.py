"""The event log of a simulated worker: its lookup records, checking its replay (the log itself
comes from ``kvledger.builder.open_worker``, as every entry point's does).

Shared by ``kvledger simulate`` for one worker and for a cluster (one log per worker).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from kvledger.config import Settings
from kvledger.events.types import lookup_stream
from kvledger.registry.lookups import LookupRecorder
from kvledger.registry.state import RegistryState

if TYPE_CHECKING:
    from kvledger.builder import Worker


def lookup_recorder(
    worker: Worker, settings: Settings, clock: Callable[[], float]
) -> LookupRecorder:
    """Lookup records to ``worker``'s log, numbered on from its earlier ones, starting with
    the run's settings."""
    assert worker.event_log is not None  # no lookup records without a log
    recorder = LookupRecorder(
        worker.sink,
        worker_id=worker.worker_id,
        dp_rank=settings.dp_rank,
        first_id=worker.event_log.last_event_id(lookup_stream(worker.worker_id)) + 1,
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
