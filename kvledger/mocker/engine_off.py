"""Engine off: a workload through a ``SimulatedCache`` with no scheduler and no clock.

Requests in arrival order, each one matched, admitted in full and released. The mock engine
(``kvledger.mocker.engine``) drives the same cache with a scheduler and a clock.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from kvledger.mocker.cache import SimulatedCache
from kvledger.mocker.stats import SimStats, occupancy
from kvledger.mocker.traces import TraceRequest, iter_arrivals, request_hashes


def replay_cache(
    requests: Iterable[TraceRequest],
    cache: SimulatedCache,
    block_size: int,
    *,
    progress: Callable[[int], None] | None = None,
    sample_every: int = 0,
) -> SimStats:
    """Engine off: match, admit and release every request in arrival order."""
    stats = SimStats()
    for i, req in enumerate(iter_arrivals(list(requests))):
        seq, local = request_hashes(req, block_size)
        admission = cache.admit(seq, local, num_tokens=req.input_length)
        stats.record(req, admission, block_size, len(seq))
        cache.finish(admission)
        if progress is not None:
            progress(i + 1)
        if sample_every and (i + 1) % sample_every == 0:
            stats.timeline.append((i + 1, stats.hit_rate, occupancy(cache)))
    return stats
