"""kvledger's G4 as a secondary tier of vLLM 0.33's tiering layer: other workers' blocks, found
through the shared registry and read over NIXL, each read verified.

A vLLM user names it in ``secondary_tiers``, usually after kvledger's G3::

    {"type": "KvledgerPeerTier", "module_path": "kvledger.integrations.vllm.peer_tier",
     "num_blocks": 20000, "worker_id": 3, "log_url": "sqlite:////nvme/kvledger/vllm.db",
     "redis_url": "redis://127.0.0.1:6379/0"}

Each worker keeps an exported pool: ``num_blocks`` host slots (kvledger's G2 on this worker,
registered with its NIXL agent, one ``HostTier``). Every block vLLM stores in its CPU tier is
copied there too (vLLM's cascade), named in the log (``Stored``) and so in the shared
registry, and published with its checksum in the remote directory; evicted, it is withdrawn.
That pool is what other workers read: their own CPU tier is vLLM's, which kvledger neither
logs nor can address.

Looking a key up asks the shared registry whether another worker holds it on its G2. A load
(vLLM's promotion) reads the blocks over NIXL into free slots of this worker's pool, checks
each against the checksum its owner published, looks the entries up again (a block the owner
evicted meanwhile reads as a mismatch or a vanished entry), copies what arrived into vLLM's
CPU rows and names it in the pool (``Onboarded(G4 -> G2)``: now this worker exports it too).
The job reports per key (``JobResult.successful_keys``): a block its owner evicted between the
lookup and the read is a miss for that key, which vLLM recomputes. Bookkeeping runs on the
scheduler thread; NIXL reads and copies on the tier's I/O thread.

Settings: ``num_blocks`` (required), ``worker_id`` (this worker, distinct across workers;
default 0), ``log_url`` and ``redis_url`` (both required), ``redis_namespace``,
``timeout_s`` (a read's deadline, default 5), ``eviction_policy`` (the pool's, one of
kvledger's), ``lease_s`` (the directory entries' lease, default 10).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
from vllm.v1.kv_offload.base import (
    LookupResult,
    OffloadKey,
    ReqContext,
    RequestOffloadingContext,
)
from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager, TransferJob
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvledger.events.types import BlockInfo, Tier
from kvledger.integrations.vllm.disk_tier import row_shape, rows_of
from kvledger.integrations.vllm.keys import RequestChunks, key_hash
from kvledger.integrations.vllm.tier_worker import (
    TierJobs,
    TierWorker,
    open_tier_worker,
    register_runs,
    release,
)
from kvledger.registry.policies import POLICY_NAMES, make_policy
from kvledger.registry.pool import BlockPool
from kvledger.tiers.host import HostTier
from kvledger.tiers.remote import (
    BlockExporter,
    Fetched,
    RemoteAgent,
    RemoteDirectory,
    RemoteFetcher,
    fetch_blocks,
)

if TYPE_CHECKING:
    from vllm.v1.kv_offload.base import OffloadingSpec
    from vllm.v1.kv_offload.tiering.backpressure import BackpressureDetector

__all__ = ["KvledgerPeerTier", "PeerTierParts", "build_peer_parts"]

_G2_BIT = 2  # the shared registry's tier mask bit of G2


@dataclass
class PeerTierParts:
    """What a ``KvledgerPeerTier`` runs on: the worker (its shared registry is required), the
    exported pool (``g2`` bytes, ``pool`` names), the NIXL agent holding ``g2``, the exporter
    publishing it and the fetcher reading other workers'. ``build_peer_parts`` makes them; a
    builder may pass its own."""

    worker: TierWorker
    g2: HostTier
    pool: BlockPool
    agent: RemoteAgent
    exporter: BlockExporter
    fetcher: RemoteFetcher
    owned: bool = True

    def close(self) -> None:
        self.exporter.close()
        self.agent.close()


def build_peer_parts(
    worker: TierWorker,
    g2: HostTier,
    *,
    eviction_policy: str = "lru",
    timeout_s: float = 5.0,
    lease_s: float = 10.0,
) -> PeerTierParts:
    """Register ``g2`` with a new NIXL agent, publish it for remote reads, and start empty
    (``Cleared`` of G2 after an earlier run: the pool's bytes did not survive it)."""
    shared = worker.shared
    if shared is None:
        raise ValueError("kvledger's peer tier needs the shared registry (redis_url)")
    pool = BlockPool(
        g2.num_slots, tier=Tier.G2, policy=make_policy(eviction_policy), emitter=worker.emitter
    )
    if worker.restarted:
        worker.emitter.cleared(Tier.G2)
    # the devices KVLEDGER_G4_INTERFACE names (else UCX_NET_DEVICES, else loopback), as for
    # every kvledger agent: what it serves is readable by whoever reaches those devices
    agent = RemoteAgent(worker.worker_id, devices=worker.builder_worker.settings.g4_interface)
    try:
        agent.register(g2)
        directory = RemoteDirectory(shared.client, shared.namespace, ttl_s=lease_s)
        exporter = BlockExporter(directory, agent.card(g2.shape), g2)
        exporter.bind(pool.lookup).start()
        fetcher = RemoteFetcher(
            agent, directory, shared, g2, worker_id=worker.worker_id, timeout_s=timeout_s
        )
    except BaseException:
        agent.close()
        raise
    return PeerTierParts(worker, g2, pool, agent, exporter, fetcher)


@dataclass
class _Job:
    job_id: int
    is_load: bool
    keys: list[OffloadKey]
    chunks: list[int]
    slots: list[int]
    hashes: list[int]
    parents: list[int | None] = field(default_factory=list)
    future: Future[Any] | None = None
    started: float = field(default_factory=time.monotonic)
    failed: bool = False


class KvledgerPeerTier(TierJobs, SecondaryTierManager):  # type: ignore[misc]  # vLLM is untyped here
    """Other workers' blocks over NIXL, and this worker's exported pool (see the module
    docstring for settings)."""

    medium: ClassVar[None] = None
    cache_hit_source: ClassVar[CacheHitSource] = CacheHitSource.P2P

    def __init__(
        self,
        offloading_spec: OffloadingSpec,
        primary_kv_view: memoryview,
        tier_type: str,
        backpressure_detector: BackpressureDetector | None = None,
        *,
        num_blocks: int | None = None,
        worker_id: int = 0,
        log_url: str | None = None,
        redis_url: str | None = None,
        redis_namespace: str = "kvledger",
        timeout_s: float = 5.0,
        eviction_policy: str = "lru",
        lease_s: float = 10.0,
        parts: PeerTierParts | None = None,
    ) -> None:
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        shape = row_shape(primary_kv_view)
        if parts is None:
            if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 1:
                raise ValueError(
                    f"{tier_type}: num_blocks (exported G2 slots) must be a positive integer,"
                    f" got {num_blocks!r}"
                )
            if log_url is None or redis_url is None:
                raise ValueError(
                    f"{tier_type}: needs log_url and redis_url (the shared registry that other"
                    " workers find blocks in, and the log it catches up from)"
                )
            if eviction_policy not in POLICY_NAMES:
                raise ValueError(
                    f"{tier_type}: eviction_policy must be one of {', '.join(POLICY_NAMES)},"
                    f" got {eviction_policy!r}"
                )
            if not timeout_s > 0:
                raise ValueError(f"{tier_type}: timeout_s must be positive, got {timeout_s!r}")
            worker = open_tier_worker(
                worker_id, log_url=log_url, redis_url=redis_url, redis_namespace=redis_namespace
            )
            try:
                parts = build_peer_parts(
                    worker,
                    HostTier(shape, num_blocks, pin=False),
                    eviction_policy=eviction_policy,
                    timeout_s=timeout_s,
                    lease_s=lease_s,
                )
            except BaseException:
                release(worker)
                raise
        elif parts.g2.shape.block_bytes != shape.block_bytes:
            raise ValueError(
                f"{tier_type}: the exported pool holds {parts.g2.shape.block_bytes}-byte"
                f" blocks, vLLM's CPU tier {shape.block_bytes}-byte chunks"
            )
        self.parts: PeerTierParts = parts
        self.worker = parts.worker
        self.pool = parts.pool
        self.fetcher = parts.fetcher
        self._shared = parts.worker.shared
        self._rows = rows_of(primary_kv_view)
        self._g2_rows = parts.g2.layout.block_bytes_view().numpy()
        self._io = ThreadPoolExecutor(1, thread_name_prefix="kvledger-g4-jobs")
        self._jobs: dict[int, _Job] = {}
        self._copying: set[int] = set()  # hashes on their way into the pool
        # hashes whose read failed -> until when lookups call them a miss: a block its owner
        # reused before the registry heard of the eviction would otherwise be a HIT again at
        # every lookup, and vLLM would promote (and fail) it forever instead of recomputing it
        self._failed: dict[int, float] = {}
        self._failed_for_s = lease_s
        self._observer = parts.exporter
        self._attach()

    def _close_parts(self) -> None:
        self.parts.close()

    # -- lookups -----------------------------------------------------------------------------

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        """HIT when another worker holds the block on its exported pool (the read may still
        find it gone: then it is a miss for this key)."""
        assert self._shared is not None
        me = self.worker.worker_id
        block = key_hash(key)
        until = self._failed.get(block)
        if until is not None:
            if time.monotonic() < until:
                return LookupResult.MISS
            del self._failed[block]
        try:
            (holders,) = self._shared.who_has([block])
        except Exception:  # Redis out of reach: nothing to read from
            return LookupResult.MISS
        found = any(w != me and mask & _G2_BIT for w, mask in holders.items())
        return LookupResult.HIT if found else LookupResult.MISS

    # -- this worker's exported pool: vLLM's cascades ------------------------------------------

    def _bad_chunks(self, job_metadata: TransferJob, chunks: list[int]) -> bool:
        if all(0 <= c < len(self._rows) for c in chunks):
            return False
        self._jobs[job_metadata.job_id] = _Job(
            job_metadata.job_id, job_metadata.is_promotion, [], [], [], [], failed=True
        )
        return True

    def submit_store(self, job_metadata: TransferJob) -> None:
        keys = list(job_metadata.keys)
        chunk_ids = [int(c) for c in job_metadata.chunk_ids]
        if self._bad_chunks(job_metadata, chunk_ids):
            return
        ctx = job_metadata.req_context
        chunks = RequestChunks.of(self, ctx)
        positions = [chunks.note(key, ctx) for key in keys]
        todo: list[tuple[OffloadKey, int, int, int | None]] = []
        for key, chunk, position in zip(keys, chunk_ids, positions, strict=True):
            h = key_hash(key)
            if h not in self.pool and h not in self._copying:
                todo.append((key, chunk, h, chunks.parent(key, position)))
        slots = self.pool.allocate_upto(len(todo)) if todo else []  # may evict: withdrawn
        todo = todo[: len(slots)]
        job = _Job(
            job_metadata.job_id,
            False,
            [t[0] for t in todo],
            [t[1] for t in todo],
            slots,
            [t[2] for t in todo],
            [t[3] for t in todo],
        )
        if todo:
            self._copying.update(job.hashes)
            job.future = self._io.submit(self._copy_in, job.chunks, slots)
        self._jobs[job.job_id] = job

    def _copy_in(self, chunks: Sequence[int], slots: Sequence[int]) -> None:
        self._g2_rows[np.asarray(slots)] = self._rows[np.asarray(chunks)]

    # -- other workers' blocks: vLLM's promotions ----------------------------------------------

    def submit_load(self, job_metadata: TransferJob) -> None:
        keys = list(job_metadata.keys)
        chunk_ids = [int(c) for c in job_metadata.chunk_ids]
        if self._bad_chunks(job_metadata, chunk_ids):
            return
        slots = self.pool.allocate_upto(len(keys))  # landing slots; may evict: withdrawn
        job = _Job(
            job_metadata.job_id,
            True,
            keys,
            chunk_ids,
            slots,
            [key_hash(key) for key in keys],
        )
        job.future = self._io.submit(self._fetch, job.hashes, chunk_ids, slots)
        self._jobs[job.job_id] = job

    def _fetch(self, hashes: list[int], chunks: list[int], slots: list[int]) -> Fetched:
        """Read each block from whoever holds it (``fetch_blocks``: each read checked, a block
        gone meanwhile a miss for its key only) and copy what arrived into vLLM's rows. Runs on
        the I/O thread; touches no bookkeeping."""
        fetched = fetch_blocks(self.fetcher, hashes, slots)
        if fetched.landed:
            at = np.asarray([chunks[i] for i, _ in fetched.landed])
            self._rows[at] = self._g2_rows[np.asarray([s for _, s in fetched.landed])]
        return fetched

    # -- completions -------------------------------------------------------------------------

    def get_finished_jobs(self) -> list[JobResult]:
        if self.fetcher.holding:
            reclaimed = self.fetcher.reclaim()
            if reclaimed:
                self.pool.release(reclaimed)
        return super().get_finished_jobs()

    def _finish(self, job: _Job) -> JobResult:
        if job.failed:
            return JobResult(job.job_id, False)
        error: BaseException | None = None
        outcome: Any = None
        if job.future is not None:
            try:
                outcome = job.future.result()
            except Exception as exc:
                error = exc
        seconds = time.monotonic() - job.started
        if not job.is_load:
            self._copying.difference_update(job.hashes)
            if error is None and job.slots:
                register_runs(self.pool, job.slots, job.hashes, job.parents)  # exported now
                self.pool.release(job.slots)
            elif job.slots:
                self.pool.release(job.slots)
            return JobResult(
                job.job_id, error is None, None, seconds, len(job.slots) * self.block_size_bytes
            )
        fetched: Fetched = outcome if error is None else Fetched()
        return self._finish_load(job, fetched, seconds)

    def _finish_load(self, job: _Job, fetched: Fetched, seconds: float) -> JobResult:
        """Name what arrived in the pool (it is exported from here on), free the rest."""
        held = set(fetched.held_back)  # the fetcher keeps them until their reads end
        landed = fetched.landed
        good_keys = [job.keys[i] for i, _ in landed]
        if landed:
            blocks = [BlockInfo(job.hashes[i], job.hashes[i], None) for i, _ in landed]
            named = self.pool.register_copies([s for _, s in landed], blocks, Tier.G4)
            self.pool.release(named)
        used = {s for _, s in landed} | held
        spare = [s for s in job.slots if s not in used]
        if spare:
            self.pool.release(spare)
        nbytes = len(good_keys) * self.block_size_bytes
        if len(good_keys) == len(job.keys):
            return JobResult(job.job_id, True, None, seconds, nbytes)
        arrived = {i for i, _ in landed}
        self._remember_failed(h for i, h in enumerate(job.hashes) if i not in arrived)
        return JobResult(
            job.job_id, False, tuple(good_keys) if good_keys else None, seconds, nbytes
        )

    def _remember_failed(self, hashes: Iterable[int]) -> None:
        """Lookups call these a miss for a lease: by then the owner's eviction has reached
        the shared registry (or the owner has stored the block again)."""
        now = time.monotonic()
        if len(self._failed) > 4 * self.pool.capacity:
            self._failed = {h: t for h, t in self._failed.items() if t > now}
        for block in hashes:
            self._failed[block] = now + self._failed_for_s
