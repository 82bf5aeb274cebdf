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
- eviction follows ``cache_policy``, one of kvledger's policies (``registry.policies``, the
  same ones ``BlockManager`` runs): ``lru`` ranks per request (``RankedPolicy``: a request's
  blocks rank when it finishes, tails before heads, so a late completion of an old request
  does not demote a newer one, as vLLM's LRU does); ``arc``, ``lineage`` and ``multi_lru``
  (TinyLFU-gated) see a load, a touch or a store offering a stored block as a use, a request
  finishing as its blocks' recency (tails first), and a store of absent blocks as a miss;
- ``reset_cache`` always succeeds: the pool is replaced and the log says ``Cleared``.

kvledger's G3 and G4 for vLLM are secondary tiers of vLLM's tiering layer
(``disk_tier.KvledgerDiskTier``, ``peer_tier.KvledgerPeerTier``), not part of this manager:
docs/vllm.md says why.

Names: vLLM 0.33 hands the manager ``OffloadKey``s and a ``ReqContext`` (request id,
``kv_transfer_params``, ``kv_hints``, each key's end-token position), never token ids (see
docs/vllm.md), so kvledger's Dynamo-compatible hashes cannot be computed here; blocks are named
by the xxh3 of their vLLM key. Given each KV-cache group's tokens per chunk
(``tokens_per_chunk``, which the spec passes), a stored block's parent is the block one chunk
before it in the same request and group, where the manager saw that one (a load or store of
the request: chunks vLLM's own prefix cache served are never shown), the sequence start for a
first chunk, and unknown (None) otherwise; without it, each store's blocks are logged as one
chain, as before.

Callers hold ``lock`` (vLLM's rule); the manager never takes it.
"""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, cast

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

from kvledger.builder import open_worker
from kvledger.config import Settings
from kvledger.events.log import EventLog
from kvledger.events.types import AnyEvent, Removed, Stored, Tier
from kvledger.integrations.vllm.keys import key_hash
from kvledger.registry.errors import PoolExhausted
from kvledger.registry.policies import (
    POLICY_NAMES,
    EvictionPolicy,
    Rank,
    RankedPolicy,
    make_policy,
)
from kvledger.registry.pool import BlockPool
from kvledger.registry.state import RegistryState

__all__ = ["CACHE_POLICIES", "KvledgerOffloadingManager", "key_hash"]
CACHE_POLICIES = POLICY_NAMES
"""The ``cache_policy`` values: kvledger's eviction policies (vLLM's own "lru" and "arc" among
them, each as kvledger implements it)."""


RANK_SHIFT = 40
"""A block's rank is one int (``RankedPolicy``): its request's rank shifted left by this many
bits, less the block's end-token position, so a request's tails sort before its heads and every
block of an older request before any of a newer one. Token positions stay far below 2**40."""


def _group_of(key: OffloadKey) -> int:
    """The KV-cache group of ``key`` (vLLM's ``get_offload_group_idx``)."""
    return int.from_bytes(key[-4:], "big")


class _Sink:
    """The pools' event sink: the manager's ``_on_event`` through a weak reference. A bound
    method would close a reference cycle (manager -> pool -> emitter -> manager), leaving
    every dropped manager (a restart, a test) for the engine's garbage collector; this way
    reference counting frees it at once."""

    __slots__ = ("_manager",)

    def __init__(self, manager: KvledgerOffloadingManager) -> None:
        self._manager = weakref.ref(manager)

    def __call__(self, event: AnyEvent) -> None:
        manager = self._manager()
        if manager is not None:
            manager._on_event(event)


@dataclass(slots=True)
class _RequestAccess:
    """The keys one request touched, in the order first seen."""

    owner: object
    generation: int
    rank: int
    #: every key the request showed, first seen first, with its end-token position then
    seen: dict[OffloadKey, int | None] = field(default_factory=dict)
    finished: bool = False
    #: (group, end-token position) -> key, for each key the request showed (parent links)
    chunk_keys: dict[tuple[int, int], OffloadKey] = field(default_factory=dict)
    #: for policies other than lru, vLLM's classification of the request's accesses: keys it
    #: stored, keys it read that it had not stored (a reuse), keys whose miss it reported
    inserted: set[OffloadKey] = field(default_factory=set)
    reused: set[OffloadKey] = field(default_factory=set)
    store_missed: set[OffloadKey] = field(default_factory=set)


class KvledgerOffloadingManager(OffloadingManager):  # type: ignore[misc]  # vLLM is untyped here
    """``num_chunks`` G2 slots; ``log_url`` makes every transition durable.

    The constructor takes vLLM's ``CPUOffloadingManager`` arguments, so either can stand in
    for the other. ``cache_policy`` is one of ``CACHE_POLICIES``; ``store_threshold`` >= 2
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
        tokens_per_chunk: Mapping[int, int] | None = None,
        redis_url: str | None = None,
        redis_namespace: str | None = None,
    ) -> None:
        if cache_policy not in CACHE_POLICIES or cache_policy_module_path is not None:
            raise ValueError(
                "kvledger's offloading manager runs kvledger's eviction policies: cache_policy"
                f" (eviction_policy in kv_connector_extra_config) must be one of"
                f" {', '.join(CACHE_POLICIES)} with no cache_policy_module_path; got"
                f" cache_policy={cache_policy!r},"
                f" cache_policy_module_path={cache_policy_module_path!r} (kvledger's policies"
                " for vLLM's own CPU tier are in kvledger.integrations.vllm.policies)"
            )
        self.cache_policy = cache_policy
        if not isinstance(num_chunks, int) or num_chunks < 0:
            raise ValueError(f"num_chunks must be a non-negative integer, got {num_chunks!r}")
        self.medium = Medium.CPU
        self.num_chunks = num_chunks
        self._config_info: ConfigInfoMapping = info.as_config_info() if info is not None else {}
        self._lock = threading.Lock()
        # the log (with the KVLEDGER_EVENT_LOG_* settings), its buffer, the shared registry's
        # publisher and the metrics, as for every entry point (vLLM publishes its own ZMQ
        # events: they come from take_events, below)
        overrides: dict[str, Any] = {"worker_id": worker_id}
        if log_url is not None:
            overrides["event_log_url"] = log_url
        if redis_url is not None:
            overrides["redis_url"] = redis_url
        if redis_namespace is not None:
            overrides["redis_namespace"] = redis_namespace
        self._worker = open_worker(
            Settings.load(**overrides),
            event_log=event_log,
            log_events=log_url is not None,
            zmq=False,
        )
        self.event_log = self._worker.event_log
        self.events: list[OffloadingEvent] | None = [] if enable_events else None
        self._emitter = self._worker.emitter(_Sink(self))
        # keys evicted by the allocation under way, for PrepareStoreOutput.evicted_keys
        self._evicted: list[OffloadKey] = []
        self._keys: dict[int, OffloadKey] = {}  # hash -> vLLM key, for every slot in use
        # vLLM key -> slot, stored or in flight: the pool answers by hash, this saves hashing
        # every key of every call (the pool stays the authority; both change together)
        self._slot_of: dict[OffloadKey, int] = {}
        # events for the log, handed over once per scheduler step to the worker's buffer, which
        # appends them in batches (the log costs a third as much that way; see
        # events/log/buffer.py)
        self._unlogged: list[AnyEvent] = []
        # stores in flight: key -> (slot, its hash), the hash to name the block on completion
        self._pending: dict[OffloadKey, tuple[int, int]] = {}
        self._generation = 0
        self._next_rank = 0
        # parent links: tokens per chunk of each KV-cache group, and each store's parents
        self._chunks = dict(tokens_per_chunk) if tokens_per_chunk else None
        self._store_parent: dict[OffloadKey, int | None] = {}
        self._new_pool()
        self.store_threshold = store_threshold
        self.max_tracker_size = max_tracker_size
        self.counts: OrderedDict[OffloadKey, int] | None = (
            OrderedDict() if store_threshold >= 2 else None
        )
        self.stores_skipped_in_current_batch = 0
        self.allocation_sizes_in_current_batch: list[int] = []
        # a log an earlier run of this worker wrote: go on from its last id, and say that its
        # tiers start empty (G2 here; G3, which earlier versions kept here), so the log
        # replays to this run
        self._worker.resume(self._emitter)

    def _new_pool(self) -> None:
        capacity = max(self.num_chunks, 1)  # a zero-chunk cache still answers lookups
        # lru: ranked per request, as vLLM ranks; the others as BlockManager runs them
        self._ranked = RankedPolicy() if self.cache_policy == "lru" else None
        self._policy: EvictionPolicy = self._ranked or make_policy(self.cache_policy)
        self.pool = BlockPool(
            capacity, tier=Tier.G2, policy=self._policy, emitter=self._emitter, fresh_first=True
        )
        if self.num_chunks == 0:
            self.pool.allocate(1)  # the placeholder slot, never handed out

    # -- events ------------------------------------------------------------------------

    def _on_event(self, event: AnyEvent) -> None:
        """Every pool change: to the durable log, and as vLLM's event for take_events."""
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
        if self._unlogged:
            batch, self._unlogged = self._unlogged, []
            self._worker.extend(batch)

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

    def _rank_fresh(self, keys: Iterable[OffloadKey], *, used: bool = False) -> None:
        """Each key, in order, becomes the most recent (vLLM's touch order); with ``used``,
        each also counts as a use (a touch: ARC and the frequency sketch count it)."""
        where = self._slot_of.get
        slots = [slot for key in keys if (slot := where(key)) is not None]
        if not slots:
            return
        if self._ranked is None:
            self._refresh(slots, used=used)
            return
        first = self._next_rank + 1
        self._next_rank += len(slots)
        step = 1 << RANK_SHIFT
        self._ranked.set_ranks(slots, range(first * step, (first + len(slots)) * step, step))

    def _refresh(self, slots: list[int], *, used: bool) -> None:
        """For a policy that orders by release: each registered slot becomes the most
        recently released (an idle one is taken and given back), counted as a use if
        ``used``. Stores in flight are left alone."""
        policy, pool = self._policy, self.pool
        count = used and policy.tracks_access
        in_flight: set[int] | None = None
        for slot in slots:
            if pool.refcount(slot):  # in use: its recency counts from its release
                if count:
                    if in_flight is None:
                        in_flight = {slot for slot, _ in self._pending.values()}
                    if slot not in in_flight:
                        policy.accessed([slot])
                continue
            one = [slot]
            policy.activated(one)
            if count:
                policy.accessed(one)
            policy.released(one)

    def _set_ranks(self, slots: Sequence[int], ranks: Sequence[Rank]) -> None:
        if self._ranked is not None:
            self._ranked.set_ranks(slots, ranks)

    def _record_access(self, keys: Iterable[OffloadKey], req_context: ReqContext) -> _RequestAccess:
        """First sight of ``keys`` in this request: rank them at the request's rank, tails
        before heads, never lowering a rank a newer request gave. Returns the request's state."""
        state = self._request(req_context)
        slots: list[int] = []
        ranks: list[Rank] = []
        where = self._slot_of.get
        seen, request_rank = state.seen, state.rank << RANK_SHIFT
        position_of = req_context.get_offload_key_position
        finished = state.finished
        for key in keys:
            if key in seen:
                continue
            if finished:
                raise RuntimeError(
                    f"request {req_context.req_id!r} offered a key after it finished"
                )
            position = seen[key] = position_of(key)
            if position is None:
                continue
            slot = where(key)
            if slot is None:
                continue
            slots.append(slot)
            ranks.append(request_rank - position)
        if slots and self._ranked is not None:
            self._ranked.raise_ranks(slots, ranks)
        return state

    def _note_chunks(self, keys: Iterable[OffloadKey], req_context: ReqContext) -> None:
        """Remember where each key sits in the request, to name the parents of its stores."""
        at = self._request(req_context).chunk_keys
        position_of = req_context.get_offload_key_position
        for key in keys:
            position = position_of(key)
            if position is not None:
                at[(int.from_bytes(key[-4:], "big"), position)] = key

    def _parent(self, key: OffloadKey, position: int | None, state: _RequestAccess) -> int | None:
        """The hash of the block one chunk before ``key`` in its request and group; None at
        the start of a sequence or where the manager never saw that block."""
        chunks = self._chunks
        assert chunks is not None
        group = int.from_bytes(key[-4:], "big")
        chunk = chunks.get(group)
        if not chunk or position is None or position <= chunk:
            return None
        before = state.chunk_keys.get((group, position - chunk))
        return None if before is None else key_hash(before)

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
        self._worker.flush()

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
        if self._chunks is not None:
            self._note_chunks(keys, req_context)
        if self._ranked is None:
            state = self._request(req_context)
            state.reused.update(key for key in keys if key not in state.inserted)
        self.pool.acquire(slots, use=False)
        self._record_access(keys, req_context)
        return CPULoadStoreSpec(slots)

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        keys = list(keys)
        self._rank_fresh(reversed(keys), used=True)
        if self._ranked is None:
            absent = [key_hash(key) for key in keys if key not in self._slot_of]
            if absent:
                self.pool.missed(absent)

    def complete_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        where = self._slot_of.get
        found = [where(key) for key in keys]
        if None in found:
            key = list(keys)[found.index(None)]
            raise KeyError(f"complete_load: block {key!r} has no load in flight")
        slots = cast(list[int], found)
        try:
            # tail first, so the head of the prefix is the most recent (as vLLM's touch ranks)
            self.pool.release(slots[::-1])  # checks each reference (takes none back on error)
        except ValueError:
            refcount = self.pool.refcount
            idle = [key for key, slot in zip(keys, slots, strict=True) if not refcount(slot)]
            raise KeyError(
                f"complete_load: block {(idle or list(keys))[0]!r} has no load in flight"
            ) from None

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
        if self._chunks is not None:
            self._note_chunks(keys, req_context)
        pending, slot_of = self._pending, self._slot_of
        to_store: list[OffloadKey] = []
        resident: list[int] = []  # slots of offered keys already stored
        offered: list[OffloadKey] = []  # keys neither in flight nor skipped, in order
        for key in keys:
            if key in pending:
                continue
            offered.append(key)
            slot = slot_of.get(key)
            if slot is None:
                to_store.append(key)
            else:
                resident.append(slot)
        if self.counts is not None:
            offers, threshold = self.counts, self.store_threshold
            wanted = [k for k in to_store if offers.get(k, 0) >= threshold]
            self.stores_skipped_in_current_batch += len(to_store) - len(wanted)
            if len(wanted) < len(to_store):
                skipped = set(to_store).difference(wanted)
                offered = [k for k in offered if k not in skipped]
            to_store = wanted
        if self._ranked is None:
            self._note_offer(offered, to_store, req_context)
        state = self._record_access(offered, req_context)
        if not to_store:
            return PrepareStoreOutput(
                keys_to_store=[], store_spec=CPULoadStoreSpec([]), evicted_keys=[]
            )
        self.allocation_sizes_in_current_batch.append(len(to_store))
        slots = self._allocate(len(to_store), resident)
        if slots is None:
            return None
        evicted, self._evicted = self._evicted, []
        if self._ranked is None:
            state.inserted.update(to_store)
        ranks: list[Rank] = []
        parents = self._store_parent if self._chunks is not None else None
        names, request_rank = self._keys, state.rank << RANK_SHIFT
        known = state.seen  # every key of to_store, with its position when first seen
        for key, slot in zip(to_store, slots, strict=True):
            h = key_hash(key)
            pending[key] = (slot, h)
            slot_of[key] = slot
            names[h] = key
            position = known.get(key)
            if position is None:  # asked again: it may have come since
                position = req_context.get_offload_key_position(key)
            if position is None:
                self._next_rank += 1
                ranks.append(self._next_rank << RANK_SHIFT)
            else:
                ranks.append(request_rank - position)
            if parents is not None:
                parents[key] = self._parent(key, position, state)
        self._set_ranks(slots, ranks)
        return PrepareStoreOutput(
            keys_to_store=to_store, store_spec=CPULoadStoreSpec(slots), evicted_keys=evicted
        )

    def _note_offer(
        self, offered: list[OffloadKey], to_store: list[OffloadKey], req_context: ReqContext
    ) -> None:
        """A store's offer, for a policy other than lru: stored blocks it offers are reused
        (counted when the request finishes, as vLLM does), and the blocks it must store
        were misses, reported once per request before this store evicts (ARC adapts)."""
        state = self._request(req_context)
        missing = set(to_store)
        state.reused.update(
            key
            for key in offered
            if key not in missing and key not in state.inserted and key not in self._pending
        )
        fresh = [key for key in reversed(to_store) if key not in state.store_missed]
        if fresh:
            state.store_missed.update(fresh)
            self.pool.missed([key_hash(key) for key in fresh])

    def _allocate(self, count: int, protected: list[int]) -> list[int] | None:
        """``count`` slots, evicting (never the ``protected`` ones) as needed; None, with
        nothing changed, when that cannot be done."""
        pool = self.pool
        if self.num_chunks == 0:
            return None
        self._evicted = []
        need_eviction = count > pool.num_free
        if need_eviction and protected:
            pool.acquire(protected, use=False)
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
        pop = self._pending.pop
        done: list[OffloadKey] = []
        slots: list[int] = []
        hashes: list[int] = []
        for key in keys:
            entry = pop(key, None)
            if entry is not None:
                done.append(key)
                slots.append(entry[0])
                hashes.append(entry[1])
        if not done:
            return
        parents: list[int | None] | None = None
        if self._chunks is not None:
            store_parent = self._store_parent
            parents = [store_parent.pop(key, None) for key in done]
        if success:
            if parents is None:
                self.pool.register(slots, [(h, h) for h in hashes])
                parents = [None, *hashes[:-1]]
            else:
                self._register_chains(slots, hashes, parents)
            self.pool.release(slots)
            return
        self.pool.release(slots)  # never named: the slots go back to the free list
        for key, h in zip(done, hashes, strict=True):
            self._keys.pop(h, None)
            del self._slot_of[key]
        if self.events is not None:
            self.events.append(
                OffloadingEvent(
                    keys=done,
                    medium=self.medium,
                    removed=True,
                    metadata_only=True,
                )
            )

    def _register_chains(
        self, slots: list[int], hashes: list[int], parents: list[int | None]
    ) -> None:
        """Name the stored blocks, one ``Stored`` per run in which each block's parent is the
        block before it (usually the whole store: consecutive chunks of one request)."""
        start = 0
        for i in range(1, len(hashes) + 1):
            if i == len(hashes) or parents[i] != hashes[i - 1]:
                run = hashes[start:i]
                self.pool.register(slots[start:i], [(h, h) for h in run], parents[start])
                start = i

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
        # The order ranked: by end-token position, then KV-cache group, then first sight;
        # by group, then first sight, where a position is unknown.
        order = state.seen
        positions = list(order.values())
        if None in positions:  # asked again: a key's position may have come since
            positions = list(map(req_context.get_offload_key_position, order))
        if None in positions:
            tail_first = list(reversed(sorted(order, key=_group_of)))
        elif len(set(positions)) == len(positions):  # one group: positions decide alone
            ordered = sorted(zip(positions, order, strict=True), reverse=True)
            tail_first = [key for _, key in ordered]
        else:
            at = dict(zip(order, positions, strict=True))
            tail_first = list(reversed(sorted(order, key=lambda key: (at[key], _group_of(key)))))
        if self._ranked is not None:
            self._rank_fresh(tail_first)
            return
        # vLLM's classification: a block the request stored becomes the most recent, one it
        # reused (read without storing it) is also a use; others (in flight) are left alone
        where, pending, reused = self._slot_of.get, self._pending, state.reused
        for key in tail_first:
            used = key in reused
            if used or key in state.inserted:
                slot = where(key)
                if slot is not None and key not in pending:
                    self._refresh([slot], used=used)

    def reset_cache(self) -> None:
        """Drop everything, in use or not: vLLM guarantees no completion of an earlier job
        arrives after this. The log records a ``Cleared`` of G2."""
        self._generation += 1
        self._pending.clear()
        self._keys.clear()
        self._slot_of.clear()
        self._next_rank = 0
        self._store_parent.clear()
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
        self._worker.close()  # nothing more goes to the log; closed when it is the manager's
