"""The scheduler side: vLLM's ``OffloadingManager`` kept by a kvledger G2 pool and its log.

vLLM names an offloaded block by an ``OffloadKey`` (its block hash plus the KV-cache group);
kvledger names it by a 64-bit sequence hash, the xxh3 of that key, so the durable log, replay
and the routers see ordinary kvledger events. A G2 ``BlockPool`` holds the blocks; its slots
are vLLM's chunk ids. Every change goes through the pool's emitter, whose events go to the
durable log (``log_url``) and are translated back into vLLM's ``OffloadingEvent`` for
``take_events``, so vLLM's own KV-event stream and kvledger's log tell the same story.

What vLLM's scheduler expects, and how it maps onto the pool:

- a store in flight is a mutable slot (refcount 1, not yet named): ``lookup`` says
  HIT_PENDING; ``complete_store`` names it (``Stored``) and releases it; a failed store frees
  it, having announced nothing to the log;
- a load pins its blocks (``acquire``) until ``complete_load`` releases them;
- keys offered in one ``prepare_store`` are never evicted by it: they are pinned around the
  allocation;
- recency is request-level (``RankedPolicy``): a request's blocks rank when it finishes,
  tails before heads, so a late completion of an old request does not demote a newer one;
- ``reset_cache`` always succeeds: the pool is replaced and the log says ``Cleared``.

Callers hold ``lock`` (vLLM's rule); the manager never takes it.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import xxhash
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
    OffloadingConnectorStats,
)
from vllm.v1.kv_offload.base import (
    ConfigInfoMapping,
    LoadStoreSpec,
    LookupResult,
    Medium,
    OffloadingEvent,
    OffloadingManager,
    OffloadKey,
    PrepareStoreOutput,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
)
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec, CPUOffloadingMetrics
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvledger.events.log import EventLog
from kvledger.events.types import AnyEvent, Removed, Stored, Tier
from kvledger.registry.emitter import EventEmitter
from kvledger.registry.errors import PoolExhausted
from kvledger.registry.policies import Rank, RankedPolicy
from kvledger.registry.pool import BlockPool
from kvledger.registry.state import RegistryState

__all__ = ["KvledgerOffloadingManager", "key_hash"]


def key_hash(key: bytes) -> int:
    """kvledger's sequence hash for a vLLM ``OffloadKey``: stable across processes and runs."""
    return xxhash.xxh3_64_intdigest(key)


@dataclass(slots=True)
class _RequestAccess:
    """The keys one request touched, per KV-cache group, in the order first seen."""

    owner: object
    generation: int
    rank: int
    key_groups: dict[int, list[OffloadKey]] = field(default_factory=dict)
    seen: set[OffloadKey] = field(default_factory=set)
    finished: bool = False


class KvledgerOffloadingManager(OffloadingManager):  # type: ignore[misc]  # vLLM is untyped here
    """``num_chunks`` G2 slots; ``log_url`` makes every transition durable.

    The constructor takes vLLM's ``CPUOffloadingManager`` arguments, so either can stand in
    for the other. ``cache_policy`` must be "lru" (request-ranked); ``store_threshold`` >= 2
    stores only keys offered that many times (the offload filter), remembering at most
    ``max_tracker_size`` keys.
    """

    def __init__(
        self,
        num_chunks: int,
        cache_policy: str = "lru",
        cache_policy_module_path: str | None = None,
        enable_events: bool = False,
        store_threshold: int = 1,
        max_tracker_size: int = 64_000,
        info: Any = None,
        *,
        log_url: str | None = None,
        event_log: EventLog | None = None,
        worker_id: int = 0,
    ) -> None:
        if cache_policy != "lru" or cache_policy_module_path is not None:
            raise ValueError(
                f"kvledger's offloading manager ranks blocks per request (cache_policy 'lru');"
                f" got cache_policy={cache_policy!r},"
                f" cache_policy_module_path={cache_policy_module_path!r}"
            )
        if not isinstance(num_chunks, int) or num_chunks < 0:
            raise ValueError(f"num_chunks must be a non-negative integer, got {num_chunks!r}")
        self.medium = Medium.CPU
        self.num_chunks = num_chunks
        self._config_info: ConfigInfoMapping = info.as_config_info() if info is not None else {}
        self._lock = threading.Lock()
        self._own_log = event_log is None and log_url is not None
        self.event_log = EventLog(log_url) if self._own_log and log_url else event_log
        self.events: list[OffloadingEvent] | None = [] if enable_events else None
        self._emitter = EventEmitter(self._on_event, worker_id=worker_id)
        # keys evicted by the allocation under way, for PrepareStoreOutput.evicted_keys
        self._evicted: list[OffloadKey] = []
        self._keys: dict[int, OffloadKey] = {}  # hash -> vLLM key, for every slot in use
        # vLLM key -> slot, stored or in flight: the pool answers by hash, this saves hashing
        # every key of every call (the pool stays the authority; both change together)
        self._slot_of: dict[OffloadKey, int] = {}
        # events for the log, handed over once per scheduler step (one lock, one wake-up)
        self._unlogged: list[AnyEvent] = []
        self._pending: dict[OffloadKey, int] = {}  # stores in flight: key -> slot
        self._generation = 0
        self._next_rank = 0
        self._new_pool()
        self.store_threshold = store_threshold
        self.max_tracker_size = max_tracker_size
        self.counts: OrderedDict[OffloadKey, int] | None = (
            OrderedDict() if store_threshold >= 2 else None
        )
        self.stores_skipped_in_current_batch = 0
        self.allocation_sizes_in_current_batch: list[int] = []

    def _new_pool(self) -> None:
        self._policy = RankedPolicy()
        capacity = max(self.num_chunks, 1)  # a zero-chunk cache still answers lookups
        self.pool = BlockPool(
            capacity, tier=Tier.G2, policy=self._policy, emitter=self._emitter, fresh_first=True
        )
        if self.num_chunks == 0:
            self.pool.allocate(1)  # the placeholder slot, never handed out

    # -- events ------------------------------------------------------------------------

    def _on_event(self, event: AnyEvent) -> None:
        """Every pool change: to the durable log, and as vLLM's event for take_events."""
        if self.event_log is not None:
            self._unlogged.append(event)
        if isinstance(event, Removed):
            keys, slot_of = self._keys, self._slot_of
            gone = [keys.pop(h) for h in event.sequence_hashes]
            for key in gone:
                del slot_of[key]
            self._evicted.extend(gone)
            if self.events is not None:
                self.events.append(OffloadingEvent(keys=gone, medium=self.medium, removed=True))
        elif isinstance(event, Stored) and self.events is not None:
            keys = self._keys
            self.events.append(
                OffloadingEvent(
                    keys=[keys[h] for h, _ in event.blocks], medium=self.medium, removed=False
                )
            )

    def _hand_to_log(self) -> None:
        if self._unlogged and self.event_log is not None:
            batch, self._unlogged = self._unlogged, []
            self.event_log.append_many(batch)

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        self._hand_to_log()

    def take_events(self) -> Iterable[OffloadingEvent]:
        self._hand_to_log()
        if self.events is None:
            return
        events, self.events = self.events, []
        for event in events:
            if event.metadata_only:
                # a retry may already hold a key whose failed store is reported here
                keys = [k for k in event.keys if k not in self._slot_of]
                if not keys:
                    continue
                event = replace(event, keys=keys)
            yield event

    # -- ranks (request-level recency) --------------------------------------------------

    def _request(self, req_context: ReqContext) -> _RequestAccess:
        state: _RequestAccess | None = req_context.get_state(_RequestAccess)
        if state is None or state.owner is not self or state.generation != self._generation:
            self._next_rank += 1
            state = _RequestAccess(self, self._generation, self._next_rank)
            req_context.set_state(state)
        return state

    def _rank_fresh(self, keys: Iterable[OffloadKey]) -> None:
        """Each key, in order, becomes the most recent (vLLM's touch order)."""
        slots: list[int] = []
        ranks: list[Rank] = []
        where, rank = self._slot_of.get, self._next_rank
        for key in keys:
            slot = where(key)
            if slot is not None:
                rank += 1
                slots.append(slot)
                ranks.append((rank, 0))
        self._next_rank = rank
        if slots:
            self._policy.set_ranks(slots, ranks)

    def _record_access(self, keys: Iterable[OffloadKey], req_context: ReqContext) -> None:
        """First sight of ``keys`` in this request: rank them at the request's rank, tails
        before heads, never lowering a rank a newer request gave."""
        state = self._request(req_context)
        slots: list[int] = []
        ranks: list[Rank] = []
        rank_of, where = self._policy.rank, self._slot_of.get
        seen, groups, request_rank = state.seen, state.key_groups, state.rank
        position_of = req_context.get_offload_key_position
        for key in keys:
            if key in seen:
                continue
            if state.finished:
                raise RuntimeError(
                    f"request {req_context.req_id!r} offered a key after it finished"
                )
            group = int.from_bytes(key[-4:], "big")  # vLLM's get_offload_group_idx
            keys_of_group = groups.get(group)
            if keys_of_group is None:
                groups[group] = [key]
            else:
                keys_of_group.append(key)
            seen.add(key)
            slot = where(key)
            if slot is None:
                continue
            position = position_of(key)
            if position is None:
                continue
            rank = (request_rank, -position)
            current = rank_of(slot)
            if current is not None and current >= rank:
                continue
            slots.append(slot)
            ranks.append(rank)
        if slots:
            self._policy.set_ranks(slots, ranks)

    # -- kvledger's view ----------------------------------------------------------------

    @property
    def stores_in_flight(self) -> int:
        return len(self._pending)

    def state(self) -> RegistryState:
        """G2 as it stands: what the event log of this run replays to."""
        worker = self._emitter.worker_id
        return RegistryState.from_mapping({(worker, Tier.G2): self.pool.resident_blocks()})

    def flush_log(self) -> None:
        """Wait until every event so far is durable in the log."""
        self._hand_to_log()
        if self.event_log is not None:
            self.event_log.flush()

    # -- OffloadingManager -----------------------------------------------------------

    @property
    def lock(self) -> threading.Lock:
        return self._lock

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        self._request(req_context)
        return RequestOffloadingContext()

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        if key in self._pending:
            return LookupResult.HIT_PENDING
        if key in self._slot_of:
            return LookupResult.HIT
        return LookupResult.MISS

    def get_load_source(self, key: OffloadKey, req_context: ReqContext) -> CacheHitSource:
        return CacheHitSource.HOST

    def prepare_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> LoadStoreSpec:
        where, pending = self._slot_of.get, self._pending
        slots: list[int] = []
        for key in keys:
            slot = where(key)
            if slot is None or key in pending:
                raise KeyError(f"prepare_load: block {key!r} is not stored (or still in flight)")
            slots.append(slot)
        self.pool.acquire(slots)
        self._record_access(keys, req_context)
        return CPULoadStoreSpec(slots)

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        self._rank_fresh(reversed(list(keys)))

    def complete_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        where, refcount = self._slot_of.get, self.pool.refcount
        slots: list[int] = []
        for key in keys:
            slot = where(key)
            if slot is None or not refcount(slot):
                raise KeyError(f"complete_load: block {key!r} has no load in flight")
            slots.append(slot)
        self.pool.release(slots)

    def _note_offers(self, keys: list[OffloadKey]) -> None:
        """The offload filter: count offers, remembering the most recent keys only."""
        offers = self.counts
        assert offers is not None
        protected = set()
        for key in keys:
            if key in offers:
                offers.move_to_end(key)
                offers[key] += 1
                protected.add(key)
        unprotected = len(offers) - len(protected)
        for key in keys:
            if key in offers:
                continue
            if len(offers) >= self.max_tracker_size:
                if not unprotected:
                    continue
                offers.popitem(last=False)
                unprotected -= 1
            offers[key] = 1

    def prepare_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext
    ) -> PrepareStoreOutput | None:
        keys = list(keys)
        if self.counts is not None:
            self._note_offers(keys)
        pending, slot_of = self._pending, self._slot_of
        to_store: list[OffloadKey] = []
        resident: list[int] = []  # slots of offered keys already stored
        recorded: set[OffloadKey] = set()
        for key in keys:
            if key in pending:
                continue
            slot = slot_of.get(key)
            if slot is None:
                to_store.append(key)
            else:
                resident.append(slot)
                recorded.add(key)
        if self.counts is not None:
            offers, threshold = self.counts, self.store_threshold
            wanted = [k for k in to_store if offers.get(k, 0) >= threshold]
            self.stores_skipped_in_current_batch += len(to_store) - len(wanted)
            to_store = wanted
        recorded.update(to_store)
        self._record_access((k for k in keys if k in recorded), req_context)
        if not to_store:
            return PrepareStoreOutput(
                keys_to_store=[], store_spec=CPULoadStoreSpec([]), evicted_keys=[]
            )
        self.allocation_sizes_in_current_batch.append(len(to_store))
        slots = self._allocate(len(to_store), resident)
        if slots is None:
            return None
        evicted, self._evicted = self._evicted, []
        state = self._request(req_context)
        ranks: list[Rank] = []
        for key, slot in zip(to_store, slots, strict=True):
            pending[key] = slot
            slot_of[key] = slot
            self._keys[key_hash(key)] = key
            position = req_context.get_offload_key_position(key)
            if position is None:
                self._next_rank += 1
                ranks.append((self._next_rank, 0))
            else:
                ranks.append((state.rank, -position))
        self._policy.set_ranks(slots, ranks)
        return PrepareStoreOutput(
            keys_to_store=to_store, store_spec=CPULoadStoreSpec(slots), evicted_keys=evicted
        )

    def _allocate(self, count: int, protected: list[int]) -> list[int] | None:
        """``count`` slots, evicting (never the ``protected`` ones) as needed; None, with
        nothing changed, when that cannot be done."""
        pool = self.pool
        if self.num_chunks == 0:
            return None
        self._evicted = []
        need_eviction = count > pool.num_free
        if need_eviction and protected:
            pool.acquire(protected)
        try:
            return pool.allocate(count)
        except PoolExhausted:
            return None
        finally:
            if need_eviction and protected:
                pool.release(protected)

    def complete_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext, success: bool = True
    ) -> None:
        pending = self._pending
        done = [(key, slot) for key in keys if (slot := pending.pop(key, None)) is not None]
        if not done:
            return
        slots = [slot for _, slot in done]
        if success:
            hashes = [key_hash(key) for key, _ in done]
            self.pool.register(slots, [(h, h) for h in hashes])
            self.pool.release(slots)
            return
        self.pool.release(slots)  # never named: the slots go back to the free list
        for key, _ in done:
            self._keys.pop(key_hash(key), None)
            del self._slot_of[key]
        if self.events is not None:
            self.events.append(
                OffloadingEvent(
                    keys=[key for key, _ in done],
                    medium=self.medium,
                    removed=True,
                    metadata_only=True,
                )
            )

    def on_request_finished(self, req_context: ReqContext) -> None:
        state = req_context.get_state(_RequestAccess)
        if (
            state is None
            or state.owner is not self
            or state.generation != self._generation
            or state.finished
        ):
            return
        state.finished = True
        ordered: list[OffloadKey] = []
        for group in sorted(state.key_groups):
            ordered.extend(state.key_groups[group])
        positions = {
            key: pos
            for key in ordered
            if (pos := req_context.get_offload_key_position(key)) is not None
        }
        if len(positions) == len(ordered):
            ordered.sort(key=positions.__getitem__)
        self._rank_fresh(reversed(ordered))

    def reset_cache(self) -> None:
        """Drop everything, in use or not: vLLM guarantees no completion of an earlier job
        arrives after this. The log records a ``Cleared`` of G2."""
        self._generation += 1
        self._pending.clear()
        self._keys.clear()
        self._slot_of.clear()
        self._next_rank = 0
        self._new_pool()
        self._emitter.cleared(Tier.G2)

    def config_info(self) -> Sequence[ConfigInfoMapping]:
        return [self._config_info]

    def get_stats(self) -> OffloadingConnectorStats | None:
        stats = OffloadingConnectorStats()
        n = self.num_chunks
        used = self.pool.num_active if n else 0
        usage = used / n if n else 0.0
        stats.set_gauge(CPUOffloadingMetrics.CPU_CACHE_USAGE_PERC, usage)
        for size in self.allocation_sizes_in_current_batch:
            stats.observe_histogram(CPUOffloadingMetrics.CPU_ALLOCATION_SIZE, size)
        self.allocation_sizes_in_current_batch.clear()
        write_usage = len(self._pending) / n if n else 0.0
        stats.set_gauge(CPUOffloadingMetrics.CPU_CACHE_WRITE_USAGE_PERC, write_usage)
        stats.set_gauge(
            CPUOffloadingMetrics.CPU_CACHE_READ_USAGE_PERC, max(usage - write_usage, 0.0)
        )
        if self.store_threshold >= 2:
            stats.increase_counter(
                CPUOffloadingMetrics.STORES_SKIPPED, self.stores_skipped_in_current_batch
            )
            self.stores_skipped_in_current_batch = 0
        return stats

    def shutdown(self) -> None:
        self._hand_to_log()
        if self._own_log and self.event_log is not None:
            self.event_log.close()
            self.event_log = None
