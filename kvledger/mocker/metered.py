"""A ``SimulatedCache`` that reports its admissions to ``kvledger.metrics.Metrics``."""

from __future__ import annotations

import time
from collections.abc import Sequence

from kvledger.events.types import Tier
from kvledger.metrics import Metrics
from kvledger.mocker.cache import Admission, SimulatedCache
from kvledger.registry.tiered import MatchResult, TieredPools


class MeteredCache(SimulatedCache):
    """Counts each prompt lookup (hits per tier, misses) and times the bookkeeping of an
    admission, which events alone cannot tell."""

    def __init__(self, tiered: TieredPools, metrics: Metrics | None = None) -> None:
        super().__init__(tiered)
        self.metrics = metrics if metrics is not None else Metrics()

    def admit(
        self,
        sequence_hashes: Sequence[int],
        local_hashes: Sequence[int],
        *,
        limit: int | None = None,
        full: int | None = None,
        match: MatchResult | None = None,
        num_tokens: int = 0,
    ) -> Admission:
        start = time.perf_counter()
        admission = super().admit(
            sequence_hashes,
            local_hashes,
            limit=limit,
            full=full,
            match=match,
            num_tokens=num_tokens,
        )
        self.metrics.alloc_latency.observe(time.perf_counter() - start)
        wanted = len(sequence_hashes) if limit is None else min(limit, len(sequence_hashes))
        self.metrics.observe_match({Tier.G1: admission.match.g1, **admission.onboarded}, wanted)
        return admission
