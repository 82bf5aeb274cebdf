"""``BlockManager``: the library API an inference engine uses.

It wires the bookkeeping (``TieredPools``: pools, dedup, eviction, offload rules) to the
bytes (``tiers``: G1 tensors, G2 host memory, G3 file; ``Copier``: batched copies),
and every transition to the durable event log and any other sinks (publishers, metrics).

Thread safety: every public method may be called from any thread; one lock serialises the
bookkeeping, and copies run on the copier's own thread, which takes the same lock
only to record a finished copy. ``aonboard`` is the asyncio form of ``onboard``.

Typical engine loop::

    seq = manager.sequence(prompt_tokens)
    held = manager.onboard(seq)                  # cached prefix, now on G1 (slots)
    fresh = manager.allocate(len(seq) - len(held))
    ... compute the KV of the uncached blocks into G1 slots ``fresh`` ...
    held += manager.register(fresh, seq, start=len(held))
    ... decode ...
    manager.release(held)
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from xxhash import xxh3_64_intdigest

from kvledger.builder import open_worker
from kvledger.config import Settings
from kvledger.events.log import EventLog
from kvledger.events.shared.client import connect
from kvledger.events.shared.publish import RedisPublisher
from kvledger.events.shared.zmq_process import ZmqPublisherProcess
from kvledger.events.shared.zmq_publish import ZmqPublisher
from kvledger.events.types import (
    AnyEvent,
    BlockInfo,
    LogRecord,
    Lookup,
    LookupRecord,
    Released,
    RunInfo,
    Tier,
    lookup_stream,
)
from kvledger.metrics import Metrics
from kvledger.recovery import G3Recovery, OpenedG3, open_g3
from kvledger.registry.errors import PoolExhausted
from kvledger.registry.hashing import TokenBlockSequence
from kvledger.registry.lookups import LookupRecorder
from kvledger.registry.state import RegistryState
from kvledger.registry.tiered import CopyPlan, MatchResult, TieredPools
from kvledger.tiers.base import StorageTier
from kvledger.tiers.device.tier import DeviceTier
from kvledger.tiers.host.tier import HostTier
from kvledger.tiers.layout import BlockShape, KVLayout
from kvledger.tiers.transfer import Copier, TransferHandle, TransferResult

if TYPE_CHECKING:
    from kvledger.tiers.remote import BlockExporter, RemoteAgent, RemoteFetcher

log = logging.getLogger(__name__)

TORCH_DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "uint8": torch.uint8,
}


@dataclass(frozen=True)
class G4Link:
    """What the ``g4`` setting builds: this worker's NIXL agent, the exporter that publishes
    its G2 blocks and the fetcher that reads other workers' G2."""

    agent: RemoteAgent
    exporter: BlockExporter
    fetcher: RemoteFetcher

    def close(self) -> None:
        self.exporter.close()
        self.agent.close()


class BlockManager:
    """G1/G2/G3 KV blocks of one worker, with offload, onboard and an event log."""

    def __init__(
        self,
        settings: Settings | None = None,
        *,
        g1_layout: KVLayout | None = None,
        device: torch.device | str | None = None,
        event_log: EventLog | None = None,
        log_events: bool = True,
        sinks: Sequence[Callable[[AnyEvent], None]] = (),
        observers: Sequence[Callable[[AnyEvent], None]] = (),
        metrics: Metrics | None = None,
    ) -> None:
        self.settings = s = settings if settings is not None else Settings.load()
        self.shape = BlockShape(
            s.num_layers, s.outer_dim, s.block_size, s.inner_dim, TORCH_DTYPES[s.dtype]
        )
        # the log, its buffer, the publishers, the metrics' watch: one builder for every
        # entry point (kvledger.builder)
        self._worker = open_worker(s, event_log=event_log, log_events=log_events, metrics=metrics)
        self._event_log = self._worker.event_log
        metrics = self._worker.metrics  # the given one, or the settings' served one
        self._tiers: dict[Tier, StorageTier] = {}
        self._g4: G4Link | None = None
        try:
            self._build(s, g1_layout, device, sinks, observers, metrics)
        except BaseException:
            # nothing half-built stays open: the G3 file, the NIXL agent, the log's writer
            if self._g4 is not None:
                self._g4.close()
            for tier in self._tiers.values():
                tier.close()
            self._worker.close(drain_timeout=0)
            raise
        self._deliver()  # a restart's Cleared and Removed events

    def _build(
        self,
        s: Settings,
        g1_layout: KVLayout | None,
        device: torch.device | str | None,
        sinks: Sequence[Callable[[AnyEvent], None]],
        observers: Sequence[Callable[[AnyEvent], None]],
        metrics: Metrics | None,
    ) -> None:
        worker = self._worker
        self.metrics = metrics
        # The publishers take their events from the log's commits (other processes see only
        # what is committed), so they are not sinks here; the log is fed through the worker's
        # buffer (a batch per call of the engine's, not a locked append per event).
        self._sinks: list[Callable[[AnyEvent], None]] = [worker.sink, *sinks]
        self._observers = list(observers)
        self._lock = threading.RLock()
        self._idle = threading.Condition(self._lock)
        self._queue: deque[LogRecord] = deque()
        self._deliver_lock = threading.Lock()
        self._emitter = worker.emitter(self._emit)
        g1_blocks = g1_layout.num_blocks if g1_layout is not None else s.g1_blocks
        self._tiered = TieredPools(
            g1_blocks,
            s.g2_capacity,
            s.g3_capacity,
            policy=s.eviction_policy,
            offload_filter=s.offload_filter,
            emitter=self._emitter,
        )
        if g1_layout is not None:
            if g1_layout.shape != self.shape:
                raise ValueError(
                    f"the engine's G1 blocks are {g1_layout.shape}, settings say {self.shape}"
                )
            g1 = DeviceTier.from_layout(g1_layout)
        else:
            g1 = DeviceTier(self.shape, g1_blocks, device=device)
        self._g1: DeviceTier = g1
        self._tiers[Tier.G1] = g1
        if s.g2_capacity:
            self._tiers[Tier.G2] = HostTier(self.shape, s.g2_capacity)
        #: what a restart kept of the disk cache; None without G3
        self.recovery: G3Recovery | None = None
        g3: OpenedG3 | None = None
        if s.g3_capacity:
            g3 = open_g3(worker, self.shape, s.g3_capacity, s.data_dir)
            self._tiers[Tier.G3] = g3.disk
            tokens = worker.logged_tokens(b.sequence_hash for _, b in g3.kept)
            self._tiered.adopt(
                Tier.G3,
                [slot for slot, _ in g3.kept],
                [b for _, b in g3.kept],
                [tokens.get(b.sequence_hash) for _, b in g3.kept],
            )
            self.recovery = g3.report
        self._transfers = Copier()
        self._in_flight: dict[TransferHandle, CopyPlan] = {}
        self._failed_copies = 0
        self._copy_thread_errors = 0
        if s.g4:
            self._g4 = self._link_g4(s, metrics)
        # A restarted worker's G1 and G2 start empty (and any tier it lacks now), and G3
        # holds what was recovered: say so, so that replay agrees with it.
        self._tiered.resume(worker.last_event_id, keep=() if g3 is None else g3.recovered)
        if g3 is not None:
            g3.announce(worker, self._emitter)
        self._requests: dict[int, _LiveRequest] = {}
        self._next_request = 0
        self._lookups: LookupRecorder | None = None
        if s.log_lookups and self._event_log is not None:
            self._lookups = LookupRecorder(
                self._queue.append,
                worker_id=s.worker_id,
                dp_rank=s.dp_rank,
                first_id=self._event_log.last_event_id(lookup_stream(s.worker_id)) + 1,
            )
            self._lookups.run(
                g1_blocks=g1_blocks,
                g2_blocks=s.g2_capacity,
                g3_blocks=s.g3_capacity,
                block_size=s.block_size,
                policy=s.eviction_policy,
                offload_filter=s.offload_filter,
            )

    def _link_g4(self, s: Settings, metrics: Metrics | None) -> G4Link:
        """Export G2 to the remote directory and read other workers' G2 (``g4`` setting)."""
        from kvledger.tiers.remote import BlockExporter, RemoteAgent, RemoteDirectory, RemoteFetcher

        shared = self._worker.shared
        assert s.redis_url is not None and shared is not None  # checked by Settings
        g2 = self._tiers[Tier.G2]
        agent = RemoteAgent(s.worker_id, devices=s.g4_interface)
        try:
            agent.register(g2)  # type: ignore[arg-type]
            directory = RemoteDirectory(connect(s.redis_url), s.redis_namespace)
            exporter = BlockExporter(directory, agent.card(self.shape), g2)  # type: ignore[arg-type]
            fetcher = RemoteFetcher(
                agent,
                directory,
                shared,
                g2,  # type: ignore[arg-type]
                worker_id=s.worker_id,
                timeout_s=s.g4_timeout_s,
                collector=metrics.collector if metrics is not None else None,
            )
            self.export_g2(exporter)
        except BaseException:
            agent.close()
            raise
        return G4Link(agent, exporter, fetcher)

    def export_g2(self, exporter: BlockExporter) -> None:
        """Publish this worker's G2 blocks for remote reads through ``exporter`` (what the
        ``g4`` setting does; for an exporter built by hand). The exporter sees each event
        under the lock, so it checksums a block before its slot can be reused."""
        with self._lock:
            exporter.bind(self._tiered.pools[Tier.G2].lookup).start()
            self._observers.append(exporter)

    @property
    def g4(self) -> G4Link | None:
        """The remote link the ``g4`` setting built (None without it)."""
        return self._g4

    @property
    def zmq_publisher(self) -> ZmqPublisher | ZmqPublisherProcess | None:
        """The ZMQ publisher the ``zmq_endpoint`` setting built (None without it)."""
        return self._worker.zmq

    # -- events ----------------------------------------------------------------------------

    def add_sink(self, sink: Callable[[AnyEvent], None]) -> None:
        """Hand every event delivered from now on to ``sink`` as well, after the log and the
        sinks given at start. Sinks run outside the manager's lock, one event at a time in
        emission order, so a sink that blocks (the log under back-pressure) holds up other
        sinks but never the bookkeeping."""
        with self._deliver_lock:
            self._sinks.append(sink)

    def add_observer(self, observer: Callable[[AnyEvent], None]) -> None:
        """Call ``observer`` at each event under the manager's lock, right after the change,
        while the tiers are as the event left them (for a G2 exporter that must checksum a
        block before its slot can be reused, or a check of the state at each event). An
        observer must not block: no I/O that can wait, no calls that wait for copies."""
        with self._lock:
            self._observers.append(observer)

    def _emit(self, event: AnyEvent) -> None:
        """The emitter's sink, called under the lock: observers now, sinks after release."""
        for observer in self._observers:
            observer(event)
        self._queue.append(event)

    @contextmanager
    def _changing(self) -> Iterator[None]:
        """Hold the lock for a change, then hand its events to the sinks without it."""
        try:
            with self._lock:
                yield
        finally:
            self._deliver()

    def _deliver(self) -> None:
        """Pass queued events to the sinks in emission order. Whoever holds the delivery lock
        drains the queue, other threads' events included; a caller returns only once the
        events it queued have reached every sink (it waits for the lock, then finds them gone
        or passes them on itself)."""
        queue, sinks = self._queue, self._sinks
        with self._deliver_lock:
            while queue:
                event = queue.popleft()
                if isinstance(event, Lookup | Released | RunInfo):
                    self._log_lookup(event)  # the log alone reads lookup records
                    continue
                for sink in sinks:
                    sink(event)

    def _log_lookup(self, record: LookupRecord) -> None:
        self._worker.sink(record)

    # -- read-only views ---------------------------------------------------------------------

    @property
    def event_log(self) -> EventLog | None:
        """The durable log events go to (None with ``log_events=False`` and no log given)."""
        return self._event_log

    @property
    def publisher(self) -> RedisPublisher | None:
        """The publisher to the shared registry (with the ``redis_url`` setting)."""
        return self._worker.publisher

    @property
    def failed_copies(self) -> int:
        """Copies that failed in whole or in part (I/O error, corrupt G3 slot)."""
        return self._failed_copies

    @property
    def next_event_id(self) -> int:
        """The id the next event of this worker gets."""
        return self._emitter.next_event_id

    def state(self) -> RegistryState:
        """What the tiers hold now, as the event log replays to it."""
        with self._lock:
            return self._tiered.state()

    def counts(self) -> dict[Tier, int]:
        """Blocks registered on each configured tier."""
        with self._lock:
            return self._tiered.counts()

    def capacities(self) -> dict[Tier, int]:
        """Slots of each configured tier."""
        return self._tiered.capacities()

    def num_free(self, tier: Tier = Tier.G1) -> int:
        """Slots of ``tier`` that hold nothing (not counting evictable cached blocks)."""
        with self._lock:
            return self._tiered.pools[tier].num_free

    def slot_of(self, tier: Tier, sequence_hash: int) -> int | None:
        """The slot holding a block on ``tier``, or None."""
        with self._lock:
            return self._tiered.pools[tier].lookup(sequence_hash)

    def tier(self, tier: Tier) -> StorageTier:
        """The bytes of one tier (``KeyError`` when it is not configured)."""
        return self._tiers[tier]

    def lower_tiers(self) -> list[Tier]:
        """The configured tiers below G1."""
        return self._tiered.lower_tiers()

    def remove(self, tier: Tier, sequence_hashes: Iterable[int]) -> list[int]:
        """Drop cached blocks from ``tier`` (``Removed``); returns the hashes dropped. Blocks
        a request holds are not dropped."""
        with self._changing():
            return self._tiered.remove(tier, sequence_hashes)

    def release_slots(self, tier: Tier, slots: Iterable[int]) -> None:
        """Free slots of ``tier`` handed out outside ``allocate`` (a remote read's slots
        from ``RemoteFetcher.reclaim``)."""
        with self._changing():
            self._tiered.release(tier, slots)

    def refresh_metrics(self) -> None:
        """Set the per-tier block gauges from the pools (call before a scrape, or periodically)."""
        if self.metrics is not None:
            with self._lock:
                self.metrics.refresh(self._tiered.pools)

    # -- sequences and lookups -----------------------------------------------------------

    def sequence(
        self, tokens: Sequence[int], *, lora_name: str | None = None, salt: str | None = None
    ) -> TokenBlockSequence:
        """Cut ``tokens`` into hashed blocks with this worker's block size and chain seed.

        A LoRA adapter name or a cache salt seeds the hashes (as Dynamo and vLLM do), and the
        sequence keeps its token ids, so that ``register`` hands both to every event naming
        its blocks: routers hash tokens themselves and need them.
        """
        return TokenBlockSequence(
            tokens,
            self.settings.block_size,
            lora_name=lora_name,
            salt=salt,
            chain_seed=self.settings.chain_seed,
        )

    def match(self, sequence: TokenBlockSequence) -> MatchResult:
        """How much of ``sequence`` is cached: blocks on G1, then continuing on G2, then G3."""
        with self._lock:
            return self._tiered.match(sequence.sequence_hashes)

    @property
    def g1(self) -> DeviceTier:
        """The G1 tier: the engine's KV blocks (its ``layout`` says where each slot lives)."""
        return self._g1

    # -- onboarding ----------------------------------------------------------------------

    def onboard(
        self, sequence: TokenBlockSequence, *, request_id: int | str | None = None
    ) -> list[int]:
        """Take the cached prefix of ``sequence`` onto G1 and return its G1 slots, held.

        G2/G3 hits are copied into fresh G1 blocks first. A copy that fails (a corrupt G3
        slot, an I/O error) ends the prefix there: the caller computes the rest, and the
        registry never names bytes that did not arrive.

        With the ``log_lookups`` setting the lookup is recorded (what was asked, what hit on
        each tier) under ``request_id`` (an integer, or a string hashed to one; default: a
        number of the manager's own). ``register`` and ``release`` find the request again by
        that id, or else by the same ``sequence`` object and the slots it holds.
        """
        hashes = sequence.sequence_hashes
        with self._changing():
            reg = self._tiered
            match = reg.match(hashes)
            reg.note_request(hashes)
            if self.metrics is not None:
                self.metrics.observe_match(
                    {Tier.G1: match.g1, Tier.G2: match.g2, Tier.G3: match.g3}, len(hashes)
                )
            held = reg.g1.match(hashes[: match.g1])
            plans = reg.plan_onboard(hashes, match)
            started = [(plan, self._start(plan)) for plan in plans]
        broken = False
        onboarded = {Tier.G2: 0, Tier.G3: 0}
        for plan, handle in started:
            landed = self._finish(plan, handle)
            if broken:  # after a hole: these blocks are cached on G1 but not part of the prefix
                with self._changing():
                    self._tiered.release(Tier.G1, landed)
                continue
            held.extend(landed)
            onboarded[plan.src_tier] += len(landed)
            broken = len(landed) < len(plan)
        if self._lookups is not None:
            with self._changing():
                rid = self._request_number(request_id)
                self._requests[rid] = _LiveRequest(sequence, len(hashes), set(held))
                hits = (match.g1, onboarded[Tier.G2], onboarded[Tier.G3])
                self._lookups.lookup(rid, hashes, hits, num_tokens=sequence.num_tokens)
        return held

    def _request_number(self, request_id: int | str | None) -> int:
        if request_id is None:
            self._next_request += 1
            return self._next_request - 1
        if isinstance(request_id, str):
            return xxh3_64_intdigest(request_id.encode())
        return request_id

    def _live_request(
        self, request_id: int | str | None, sequence: TokenBlockSequence | None, slots: set[int]
    ) -> int | None:
        """The live request a ``register`` or ``release`` is about: by its id, else by its
        sequence object, else the newest one whose slots are all among ``slots``."""
        if request_id is not None:
            rid = self._request_number(request_id)
            return rid if rid in self._requests else None
        for rid in reversed(self._requests):
            live = self._requests[rid]
            if live.sequence is sequence or (slots and live.slots and live.slots <= slots):
                return rid
        return None

    def onboard_remote(
        self, sequence: TokenBlockSequence, fetcher: RemoteFetcher | None = None
    ) -> list[int]:
        """``onboard``, after reading the blocks that follow the local prefix from another
        worker (G4) into fresh G2 slots over NIXL (``kvledger.tiers.remote``).

        The read runs without the lock (it may take up to the fetcher's timeout). Blocks that
        arrive intact are registered on G2 (``Onboarded(G4 -> G2)``) and onboarded to G1 with
        the local prefix; a block that vanished, a dead owner or a checksum mismatch is a miss
        from there on, and its slots are freed unregistered -- except after a timeout, when
        they stay allocated until the abandoned read ends (a later call frees them; see
        ``RemoteFetcher.reclaim``). The remote read starts where the
        local G1/G2 prefix ends: blocks only on the local G3 are read from another worker's
        memory when one holds them (a local prefix continues from G2 onto G3, never from G3
        back onto G2, so remote blocks after a G3 run could not be matched).
        """
        if fetcher is None:
            if self._g4 is None:
                raise ValueError(
                    "onboard_remote needs a fetcher: pass one, or turn on the g4 setting"
                )
            fetcher = self._g4.fetcher
        hashes = sequence.sequence_hashes
        reclaimed = fetcher.reclaim()  # slots of earlier reads abandoned while in flight
        with self._changing():
            self._tiered.reserve_g4(0)  # raises without a G2
            self._tiered.release(Tier.G2, reclaimed)
            local = self._tiered.match(hashes)
        start = local.g1 + local.g2
        plan = fetcher.plan(hashes[start:]) if start < len(hashes) else None
        landed: list[int] = []
        if plan is not None:
            with self._changing():
                slots = self._tiered.reserve_g4(len(plan))
            result = fetcher.execute(plan, slots) if slots else None
            n = result.count if result is not None else 0
            held_back = result.held_back if result is not None else ()
            infos = [
                BlockInfo(b.sequence_hash, b.local_hash, hashes[i - 1] if i else None)
                for i, b in enumerate(sequence.blocks[start : start + n], start)
            ]
            tokens: list[bytes | None] = list(sequence.block_tokens(start, start + n))
            keys = [sequence.hash_key] * n
            with self._changing():
                landed = self._tiered.land_g4(slots, infos, held_back, tokens, keys)
        try:
            return self.onboard(sequence)
        finally:
            if landed:  # held until onboard copied them up; now cached on G2 like the rest
                with self._changing():
                    self._tiered.release(Tier.G2, reversed(landed))

    async def aonboard(
        self, sequence: TokenBlockSequence, *, request_id: int | str | None = None
    ) -> list[int]:
        """``onboard`` without blocking the event loop."""
        return await asyncio.get_running_loop().run_in_executor(
            None, functools.partial(self.onboard, sequence, request_id=request_id)
        )

    # -- allocation and registration -----------------------------------------------------

    def allocate(self, count: int, *, timeout: float | None = None) -> list[int]:
        """``count`` fresh G1 slots for the engine to fill.

        Blocks the engine released but write-through copies still read (on their way to G2
        or G3) become evictable as those copies land: when only they stand between the pool
        and ``count``, ``allocate`` waits for them, up to ``timeout`` seconds (default: the
        ``allocate_wait_s`` setting). Raises ``PoolExhausted``, handing out nothing, at once
        when the pool is really full (the message says how many blocks requests hold and how
        many copies), or when the copies did not land in time.
        """
        started = time.perf_counter()
        wait = self.settings.allocate_wait_s if timeout is None else timeout
        g1 = self._tiered.g1
        with self._changing():  # an allocation may evict (Removed events)
            while True:
                try:
                    slots = g1.allocate(count)
                    break
                except PoolExhausted:
                    copying = self._held_only_by_copies()
                    available = g1.num_free + g1.num_inactive
                    if available + copying < count:
                        held = g1.num_active - copying
                        detail = (
                            f"{held} are held by requests, {copying} by copies in flight; "
                            "release blocks or raise g1_blocks"
                        )
                        raise PoolExhausted("G1", count, available, detail) from None
                    left = started + wait - time.perf_counter()
                    if left <= 0:
                        detail = (
                            f"{copying} more are held by copies in flight that did not land "
                            f"within {wait:g} s"
                        )
                        raise PoolExhausted("G1", count, available, detail) from None
                    self._idle.wait(left)
        if self.metrics is not None:
            self.metrics.alloc_latency.observe(time.perf_counter() - started)
        return slots

    def _held_only_by_copies(self) -> int:
        """G1 blocks that no request holds, only copies in flight reading them."""
        pins = Counter(
            slot
            for plan in self._in_flight.values()
            if plan.src_tier is Tier.G1
            for slot in plan.src_slots
        )
        refcount = self._tiered.g1.refcount
        return sum(1 for slot, n in pins.items() if refcount(slot) == n)

    def register(
        self,
        slots: Sequence[int],
        sequence: TokenBlockSequence,
        *,
        start: int,
        request_id: int | str | None = None,
    ) -> list[int]:
        """Name filled G1 ``slots`` as blocks ``start..`` of ``sequence``; starts their offload.

        Returns the slots holding the blocks (a block another request registered meanwhile
        is shared and the duplicate slot freed). Blocks past what the request's lookup asked
        for (it grew while decoding) are recorded as its growth.
        """
        end = start + len(slots)
        seqs, locals_ = sequence.sequence_hashes, sequence.local_hashes
        if start < 0 or end > len(seqs):
            raise ValueError(
                f"register: {len(slots)} slots but the sequence has {max(len(seqs) - start, 0)} "
                f"full blocks from position {start}"
            )
        parent = seqs[start - 1] if start else None
        with self._changing():
            held = self._tiered.g1.register(
                slots,
                list(zip(seqs[start:end], locals_[start:end], strict=True)),
                parent,
                sequence.block_tokens(start, end),
                sequence.hash_key,
            )
            for plan in self._tiered.plan_offload(held):
                self._start(plan)
            if self._lookups is not None:
                self._note_registered(request_id, sequence, slots, held, start)
        return held

    def _note_registered(
        self,
        request_id: int | str | None,
        sequence: TokenBlockSequence,
        slots: Sequence[int],
        held: list[int],
        start: int,
    ) -> None:
        rid = self._live_request(request_id, sequence, set())
        if rid is None or self._lookups is None:
            return
        live = self._requests[rid]
        live.slots.update(held)
        end = start + len(held)
        if end > live.asked:
            first = max(start, live.asked)
            shared = sum(1 for s, h in zip(slots, held, strict=True) if s != h)
            grown = sequence.sequence_hashes[first:end]
            self._lookups.lookup(rid, grown, (min(shared, len(grown)), 0, 0), start=first)
            live.asked = end

    def release(self, slots: Iterable[int], *, request_id: int | str | None = None) -> None:
        """Let go of G1 blocks, last first; registered ones stay cached until evicted. The
        request they belonged to (``request_id``, or found by its slots) is recorded as ended."""
        slots = list(slots)
        with self._changing():
            self._tiered.release(Tier.G1, reversed(slots))
            if self._lookups is not None:
                rid = self._live_request(request_id, None, set(slots))
                if rid is not None:
                    del self._requests[rid]
                    self._lookups.released(rid)

    # -- copies --------------------------------------------------------------------------

    def _start(self, plan: CopyPlan) -> TransferHandle:
        """Queue the bytes of a planned copy; its completion is recorded on the copy thread."""
        src, dst = self._tiers[plan.src_tier], self._tiers[plan.dst_tier]
        names = plan.blocks if plan.dst_tier is Tier.G3 else None  # G3 records them per slot
        handle = self._transfers.copy(src, plan.src_slots, dst, plan.dst_slots, blocks=names)
        self._in_flight[handle] = plan
        if self.metrics is not None:
            self._observe_transfer(plan, handle, time.perf_counter())
        if plan.dst_tier is not Tier.G1:
            handle.add_done_callback(lambda h: self._record_offload(plan, h))
        return handle

    def _record_offload(self, plan: CopyPlan, handle: TransferHandle) -> None:
        """Record a finished offload, on the copy thread. A sink that fails here (the log's
        disk is full) fails the engine's next call too, which is where it is reported: on
        this thread it is said once, in one line, not as a traceback per copy."""
        try:
            self._record(plan, handle)
        except Exception as exc:
            if not self._copy_thread_errors:
                log.error("kvledger: recording a finished copy failed: %s", exc)
            self._copy_thread_errors += 1

    def _observe_transfer(self, plan: CopyPlan, handle: TransferHandle, started: float) -> None:
        assert self.metrics is not None
        latency = self.metrics.transfer_latency.labels(plan.src_tier.name, plan.dst_tier.name)
        moved = self.metrics.transfer_bytes.labels(plan.src_tier.name, plan.dst_tier.name)
        block_bytes = self.shape.block_bytes

        def done(h: TransferHandle) -> None:
            latency.observe(time.perf_counter() - started)
            if h.exception() is None:
                moved.inc(len(h.wait().copied) * block_bytes)

        handle.add_done_callback(done)

    def _record(self, plan: CopyPlan, handle: TransferHandle) -> list[int]:
        """Register what arrived, abort what did not; start follow-up copies."""
        error = handle.exception()
        try:
            with self._changing():
                if error is not None:
                    log.warning(
                        "%s -> %s copy of %d blocks failed: %s",
                        plan.src_tier.name,
                        plan.dst_tier.name,
                        len(plan),
                        error,
                    )
                    self._failed_copies += 1
                    self._tiered.abort(plan)
                    return []
                good = _good_prefix(plan, handle.wait())
                if good < len(plan):
                    self._failed_copies += 1
                for follow in self._tiered.complete(plan, arrived=good):
                    self._start(follow)
                return plan.landed
        finally:
            # after the events reached the sinks: a caller of wait_idle reads a complete log
            with self._idle:
                self._in_flight.pop(handle, None)
                self._idle.notify_all()

    def _finish(self, plan: CopyPlan, handle: TransferHandle) -> list[int]:
        """Wait for a local copy (they cannot hang: memory and file I/O) and record it."""
        handle.exception()  # waits; an error is recorded as a failed copy
        return self._record(plan, handle)

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Wait until no copy is in flight (offloads included). False on timeout."""
        with self._idle:
            return self._idle.wait_for(lambda: not self._in_flight, timeout)

    def close(self) -> None:
        """Finish copies, flush the log (when this manager opened it) and close the tiers."""
        self.wait_idle(timeout=120)
        if self._g4 is not None:
            self._g4.close()
        self._transfers.close()
        for tier in self._tiers.values():
            tier.close()
        self._worker.close()

    def __enter__(self) -> BlockManager:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


@dataclass
class _LiveRequest:
    """A request between its lookup and its release: what ``register`` and ``release`` use
    to find it, and how many of its blocks its lookup records asked for so far."""

    sequence: TokenBlockSequence
    asked: int
    slots: set[int]


def _good_prefix(plan: CopyPlan, result: TransferResult) -> int:
    """How many leading pairs of ``plan`` arrived intact."""
    failed = {d for _, d in result.failed}
    for i, dst in enumerate(plan.dst_slots):
        if dst in failed:
            return i
    return len(plan)
