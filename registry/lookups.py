"""Numbering and stamping of lookup records: what requests asked for and what hit.

Transitions (``emitter.py``) say which blocks were where; lookup records say why: each
request's lookup, how it grew, when it ended, and the settings the run started with. With
them a recorded run can be re-run under other settings (``kvledger whatif``) and checked
against what it really had. They have their own id sequence per worker (``lookup_stream``),
so consumers of transitions never see them.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from kvledger.events.types import Lookup, LookupRecord, Released, RunInfo, Tier

LookupSink = Callable[[LookupRecord], None]


class LookupRecorder:
    """Turns a request's lookup, growth and end into numbered records for ``sink``."""

    __slots__ = ("sink", "worker_id", "dp_rank", "next_id", "clock")

    def __init__(
        self,
        sink: LookupSink,
        *,
        worker_id: int = 0,
        dp_rank: int = 0,
        first_id: int = 0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.sink = sink
        self.worker_id = worker_id
        self.dp_rank = dp_rank
        self.next_id = first_id
        self.clock = clock

    def _take_id(self) -> int:
        rid = self.next_id
        self.next_id = rid + 1
        return rid

    def run(
        self,
        *,
        g1_blocks: int,
        g2_blocks: int,
        g3_blocks: int,
        block_size: int,
        policy: str,
        offload_filter: str,
    ) -> None:
        """A run (or a restart) begins with these settings; its caches start empty."""
        self.sink(
            RunInfo(
                event_id=self._take_id(),
                worker_id=self.worker_id,
                dp_rank=self.dp_rank,
                tier=Tier.G1,
                ts=self.clock(),
                g1_blocks=g1_blocks,
                g2_blocks=g2_blocks,
                g3_blocks=g3_blocks,
                block_size=block_size,
                policy=policy,
                offload_filter=offload_filter,
            )
        )

    def lookup(
        self,
        request_id: int,
        sequence_hashes: Sequence[int],
        hits: tuple[int, int, int],
        *,
        start: int = 0,
        num_tokens: int = 0,
    ) -> None:
        """Request ``request_id`` asked for blocks ``start..`` (``sequence_hashes``);
        ``hits`` of them came from G1, G2, G3."""
        self.sink(
            Lookup(
                event_id=self._take_id(),
                worker_id=self.worker_id,
                dp_rank=self.dp_rank,
                tier=Tier.G1,
                ts=self.clock(),
                request_id=request_id,
                num_tokens=num_tokens,
                start=start,
                sequence_hashes=tuple(sequence_hashes),
                hits=hits,
            )
        )

    def released(self, request_id: int) -> None:
        """Request ``request_id`` let go of its blocks."""
        self.sink(
            Released(
                event_id=self._take_id(),
                worker_id=self.worker_id,
                dp_rank=self.dp_rank,
                tier=Tier.G1,
                ts=self.clock(),
                request_id=request_id,
            )
        )
