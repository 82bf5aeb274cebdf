"""What a simulated run measures for capacity planning: hits, events by kind, tier occupancy.

Both ways of running a workload fill these: engine off (``kvledger.mocker.engine_off``) and
the mock engine (``kvledger.mocker.engine``).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from kvledger.events.types import (
    AnyEvent,
    BlockInfo,
    HashKey,
    Offloaded,
    Onboarded,
    Removed,
    Stored,
    Tier,
)
from kvledger.mocker.cache import Admission, SimulatedCache
from kvledger.mocker.traces import TraceRequest, iter_arrivals, request_hashes
from kvledger.registry.emitter import BlockTokens, EventEmitter, EventSink

TIERS = (Tier.G1, Tier.G2, Tier.G3)


class EventCounter:
    """A sink that counts events by kind and tier, then passes them on."""

    def __init__(self, downstream: Callable[[AnyEvent], None] | None = None) -> None:
        self.downstream = downstream
        self.events = 0
        self.removed_blocks: Counter[Tier] = Counter()
        self.stored_blocks: Counter[Tier] = Counter()
        self.offloaded_blocks: Counter[Tier] = Counter()
        self.onboarded_blocks: Counter[Tier] = Counter()

    def __call__(self, event: AnyEvent) -> None:
        self.events += 1
        if isinstance(event, Removed):
            self.removed_blocks[event.tier] += len(event.sequence_hashes)
        elif isinstance(event, Stored):
            self.stored_blocks[event.tier] += len(event.blocks)
        elif isinstance(event, Offloaded):
            self.offloaded_blocks[event.tier] += len(event.blocks)
        elif isinstance(event, Onboarded):
            self.onboarded_blocks[event.src_tier] += len(event.blocks)
        if self.downstream is not None:
            self.downstream(event)


class EventTally(Protocol):
    """Events reported by a run, counted by kind and tier (what ``summary`` prints)."""

    @property
    def events(self) -> int: ...

    removed_blocks: Counter[Tier]
    stored_blocks: Counter[Tier]
    offloaded_blocks: Counter[Tier]
    onboarded_blocks: Counter[Tier]


class CountingEmitter(EventEmitter):
    """An ``EventEmitter`` that counts what it reports, as ``EventCounter`` does, without
    building an event when it has no sink: a run with no log pays for no event objects."""

    __slots__ = (
        "removed_blocks",
        "stored_blocks",
        "offloaded_blocks",
        "onboarded_blocks",
        "_first",
    )

    def __init__(self, sink: EventSink | None = None, **kwargs: Any) -> None:
        super().__init__(sink, **kwargs)
        self.removed_blocks: Counter[Tier] = Counter()
        self.stored_blocks: Counter[Tier] = Counter()
        self.offloaded_blocks: Counter[Tier] = Counter()
        self.onboarded_blocks: Counter[Tier] = Counter()
        self._first = self.next_event_id

    @property
    def events(self) -> int:
        return self.next_event_id - self._first

    def stored(
        self,
        tier: Tier,
        parent_hash: int | None,
        blocks: Sequence[tuple[int, int]],
        token_ids: Sequence[BlockTokens] | None = None,
        key: HashKey | None = None,
    ) -> None:
        self.stored_blocks[tier] += len(blocks)
        # the base class by name: super() builds a proxy object on every block registered
        EventEmitter.stored(self, tier, parent_hash, blocks, token_ids, key)

    def removed(self, tier: Tier, sequence_hashes: Iterable[int]) -> None:
        hashes = tuple(sequence_hashes)
        self.removed_blocks[tier] += len(hashes)
        EventEmitter.removed(self, tier, hashes)

    def copied(
        self,
        src_tier: Tier,
        dst_tier: Tier,
        blocks: Sequence[BlockInfo],
        tokens: Sequence[BlockTokens | None] | None = None,
        keys: Sequence[HashKey | None] | None = None,
    ) -> None:
        if blocks and src_tier != dst_tier:
            (self.offloaded_blocks if dst_tier > src_tier else self.onboarded_blocks)[
                dst_tier if dst_tier > src_tier else src_tier
            ] += len(blocks)
        super().copied(src_tier, dst_tier, blocks, tokens, keys)

    def resume(self, last_event_id: int, clear: Iterable[Tier] = ()) -> None:
        super().resume(last_event_id, clear)
        self._first = last_event_id + 1  # the Cleared events of a restart count as this run's


@dataclass
class SimStats:
    """Totals of a run; ``summary()`` is what ``--json`` prints."""

    requests: int = 0
    blocks_requested: int = 0
    blocks_hit: int = 0
    hits_by_tier: Counter[Tier] = field(default_factory=Counter)
    tokens_requested: int = 0
    tokens_hit: int = 0
    blocks_unplaced: int = 0
    #: (request index, cumulative hit rate, blocks per tier) samples for plots
    timeline: list[tuple[int, float, dict[str, int]]] = field(default_factory=list)
    ttft_ms: list[float] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)

    def record(
        self,
        req: TraceRequest,
        admission: Admission,
        block_size: int,
        n_blocks: int,
        *,
        remote: int = 0,
    ) -> None:
        """Count a request's first admission; ``remote``: blocks a peer sent after the
        cached prefix (G4 hits)."""
        self.requests += 1
        self.blocks_requested += n_blocks
        hit = admission.hit_blocks + remote
        self.blocks_hit += hit
        self.hits_by_tier[Tier.G1] += admission.match.g1
        for tier, n in admission.onboarded.items():
            self.hits_by_tier[tier] += n
        if remote:
            self.hits_by_tier[Tier.G4] += remote
        prompt = req.input_length
        self.tokens_requested += prompt
        hit_tokens = hit * block_size  # (a comparison, not min(): the builtin costs more)
        self.tokens_hit += hit_tokens if hit_tokens < prompt else prompt
        self.blocks_unplaced += n_blocks - admission.placed

    @property
    def hit_rate(self) -> float:
        return self.blocks_hit / self.blocks_requested if self.blocks_requested else 0.0

    @property
    def token_hit_rate(self) -> float:
        return self.tokens_hit / self.tokens_requested if self.tokens_requested else 0.0

    def summary(self, cache: SimulatedCache, counter: EventTally) -> dict[str, Any]:
        pools = cache.tiered.pools
        out: dict[str, Any] = {
            "requests": self.requests,
            "blocks_requested": self.blocks_requested,
            "blocks_hit": self.blocks_hit,
            "hit_rate": round(self.hit_rate, 6),
            "token_hit_rate": round(self.token_hit_rate, 6),
            "hits_by_tier": {t.name: self.hits_by_tier.get(t, 0) for t in TIERS},
            "blocks_unplaced": self.blocks_unplaced,
            "evictions": {t.name: counter.removed_blocks.get(t, 0) for t in TIERS},
            "offloaded_blocks": {t.name: counter.offloaded_blocks.get(t, 0) for t in TIERS},
            "onboarded_blocks": {t.name: counter.onboarded_blocks.get(t, 0) for t in TIERS},
            "events_written": counter.events,
            "final_blocks": {t.name: (pools[t].num_registered if t in pools else 0) for t in TIERS},
        }
        if self.ttft_ms:
            ordered = sorted(self.ttft_ms)
            out["ttft_ms_p50"] = round(ordered[len(ordered) // 2], 3)
            out["ttft_ms_p99"] = round(ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))], 3)
        out.update(self.extra)
        return out


def occupancy(cache: SimulatedCache) -> dict[str, int]:
    return {tier.name: pool.num_registered for tier, pool in cache.tiered.pools.items()}


def infinite_cache(requests: list[TraceRequest], block_size: int) -> tuple[float, float]:
    """(block, token) prefix-hit rates of a cache that never evicts: the ceiling any capacity
    or policy can reach on this workload."""
    seen: set[int] = set()
    blocks = hit = tokens = tokens_hit = 0
    for req in iter_arrivals(requests):
        seq, _ = request_hashes(req, block_size)
        n = 0
        for h in seq:
            if h not in seen:
                break
            n += 1
        seen.update(seq)
        blocks += len(seq)
        hit += n
        tokens += req.input_length
        tokens_hit += min(n * block_size, req.input_length)
    return (hit / blocks if blocks else 0.0, tokens_hit / tokens if tokens else 0.0)
