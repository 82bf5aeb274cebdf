"""kvledger's G3 as a secondary tier of vLLM 0.33's tiering layer.

A vLLM user names it in ``secondary_tiers`` (vLLM's ``TieringOffloadingSpec``)::

    "kv_connector_extra_config": {"spec_name": "TieringOffloadingSpec",
        "cpu_bytes_to_use": 8000000000,
        "secondary_tiers": [{"type": "KvledgerDiskTier",
                             "module_path": "kvledger.integrations.vllm.disk_tier",
                             "num_blocks": 100000, "data_dir": "/nvme/kvledger",
                             "log_url": "sqlite:////nvme/kvledger/vllm.db"}]}

Settings (the entry's other keys; vLLM passes them to the constructor):

- ``num_blocks`` (required): G3 slots, each one vLLM chunk (a row of the CPU tier);
- ``data_dir``: where the slot file lives (default ``$KVLEDGER_DATA_DIR`` or
  ``kvledger-data``); ``file_name``: default ``vllm-g3-w<worker_id>.bin``;
- ``log_url``: kvledger's durable event log; every G3 transition goes there, and a restarted
  worker serves again the slots the log vouches for (warm restart);
- ``worker_id``: this worker in the log and the shared registry (default 0);
- ``redis_url``, ``redis_namespace``: the shared registry, where routers and other workers
  see what this worker holds on G3 (needs ``log_url``);
- ``eviction_policy``: G3's policy, one of kvledger's (lru, arc, lineage, multi_lru);
- ``io_threads``: threads reading and writing the file (default 4);
- ``enable_kv_events``: publish vLLM KV events (STORAGE) for G3's stores and removals, when
  vLLM's KV events are on; ``locality``: LOCAL or REMOTE, carried on them.

The tier is the ``DiskTier`` file (checksummed, self-describing slots) and a ``BlockPool``
that says which block each slot holds; vLLM's chunks are named by ``keys.key_hash``. A store
(vLLM's cascade from its CPU tier) writes the chunks' rows into free slots on the I/O
threads and names them when the write is done (``Offloaded(G2 -> G3)``: the copy came from
the CPU tier); a load reads slots into the CPU tier's rows, checking every slot's checksum,
and reports per key what arrived (``JobResult.successful_keys``): a slot that fails its
checksum is dropped (``Removed``) and its key is a miss, never wrong bytes. Bookkeeping is
done on the scheduler thread (vLLM's rule), only bytes move on the I/O threads.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
import torch
from vllm.v1.kv_offload.base import (
    Locality,
    LookupResult,
    Medium,
    OffloadingEvent,
    OffloadKey,
    ReqContext,
    RequestOffloadingContext,
    get_offload_group_idx,
)
from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager, TransferJob

from kvledger.events.files import private_folder
from kvledger.events.types import AnyEvent, BlockInfo, Cleared, Offloaded, Removed, Tier
from kvledger.integrations.vllm.keys import RequestChunks, key_hash
from kvledger.integrations.vllm.tier_worker import TierJobs, TierWorker, open_tier_worker, release
from kvledger.recovery import open_g3
from kvledger.registry.policies import POLICY_NAMES, make_policy
from kvledger.registry.pool import BlockPool
from kvledger.tiers.disk import DiskTier
from kvledger.tiers.layout import BlockShape

if TYPE_CHECKING:
    from vllm.v1.kv_offload.base import OffloadingSpec
    from vllm.v1.kv_offload.tiering.backpressure import BackpressureDetector

__all__ = ["DiskTierParts", "KvledgerDiskTier", "build_disk_parts", "row_shape"]


def row_shape(primary_kv_view: memoryview) -> BlockShape:
    """One vLLM chunk as a kvledger block: a row of the CPU tier's bytes."""
    assert primary_kv_view.strides is not None
    return BlockShape(1, 1, 1, int(primary_kv_view.strides[0]), torch.uint8)


def rows_of(primary_kv_view: memoryview) -> np.ndarray:
    """The CPU tier as ``[chunks, row bytes]`` uint8, over its own memory."""
    assert primary_kv_view.strides is not None
    row = int(primary_kv_view.strides[0])
    flat = np.frombuffer(primary_kv_view, dtype=np.uint8)
    return flat.reshape(len(flat) // row, row)


@dataclass
class DiskTierParts:
    """What a ``KvledgerDiskTier`` runs on: the worker (emitter, log, shared registry), the
    slot file and the pool saying which block each slot holds (its recovered blocks adopted).
    ``build_disk_parts`` makes them from settings; a builder may pass its own."""

    worker: TierWorker
    disk: DiskTier
    pool: BlockPool
    owned: bool = True  # released with the tier (the worker back to open_tier_worker)


def build_disk_parts(
    worker: TierWorker,
    shape: BlockShape,
    num_blocks: int,
    directory: Path,
    file_name: str,
    *,
    eviction_policy: str = "lru",
    io_threads: int = 4,
) -> DiskTierParts:
    """Open (or create) the slot file and recover it against ``worker``'s log (the one G3
    recovery, ``kvledger.recovery.open_g3``): slots naming a block the log lists on this
    worker's G3, with the same hashes and an intact checksum, are served again; listed blocks
    that did not survive get a ``Removed``. A new file, or a log that cannot be folded, starts
    G3 empty (``Cleared`` after an earlier run)."""
    opened = open_g3(
        worker.builder_worker,
        shape,
        num_blocks,
        directory,
        file_name=file_name,
        io_threads=io_threads,
    )
    disk = opened.disk
    try:
        pool = BlockPool(
            num_blocks, tier=Tier.G3, policy=make_policy(eviction_policy), emitter=worker.emitter
        )
        if opened.vouched:
            pool.adopt([slot for slot, _ in opened.kept], [block for _, block in opened.kept])
            opened.announce(worker.builder_worker, worker.emitter)
        elif worker.restarted:
            worker.emitter.cleared(Tier.G3)
    except BaseException:
        disk.close()
        raise
    return DiskTierParts(worker, disk, pool)


@dataclass
class _Job:
    """A store or load in flight: its keys, the slots it holds, the I/O under way."""

    job_id: int
    is_load: bool
    keys: list[OffloadKey]
    slots: list[int]
    hashes: list[int]
    parents: list[int | None] = field(default_factory=list)
    future: Future[Any] | None = None
    started: float = field(default_factory=time.monotonic)
    skipped: list[OffloadKey] = field(default_factory=list)  # loads: keys G3 no longer held
    failed: bool = False  # refused at submission


class KvledgerDiskTier(TierJobs, SecondaryTierManager):  # type: ignore[misc]  # vLLM is untyped here
    """kvledger's G3 file under vLLM's CPU tier (see the module docstring for settings)."""

    medium: ClassVar[Medium] = Medium.STORAGE

    def __init__(
        self,
        offloading_spec: OffloadingSpec,
        primary_kv_view: memoryview,
        tier_type: str,
        backpressure_detector: BackpressureDetector | None = None,
        *,
        num_blocks: int | None = None,
        data_dir: str | None = None,
        file_name: str | None = None,
        log_url: str | None = None,
        worker_id: int = 0,
        redis_url: str | None = None,
        redis_namespace: str = "kvledger",
        eviction_policy: str = "lru",
        io_threads: int = 4,
        enable_kv_events: bool = False,
        locality: str | None = None,
        parts: DiskTierParts | None = None,
    ) -> None:
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        self.locality = Locality(locality) if locality is not None else None
        shape = row_shape(primary_kv_view)
        if parts is None:
            if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 1:
                raise ValueError(
                    f"{tier_type}: num_blocks (G3 slots) must be a positive integer, got"
                    f" {num_blocks!r}"
                )
            if eviction_policy not in POLICY_NAMES:
                raise ValueError(
                    f"{tier_type}: eviction_policy must be one of {', '.join(POLICY_NAMES)},"
                    f" got {eviction_policy!r}"
                )
            if isinstance(worker_id, bool) or not isinstance(worker_id, int) or worker_id < 0:
                raise ValueError(
                    f"{tier_type}: worker_id must be a non-negative integer, got {worker_id!r}"
                )
            directory = Path(data_dir or os.environ.get("KVLEDGER_DATA_DIR") or "kvledger-data")
            # before the log: its file usually lies in the tier's folder, which the log will
            # not create (it refuses a missing folder rather than guess its mode)
            private_folder(directory)
            worker = open_tier_worker(
                worker_id, log_url=log_url, redis_url=redis_url, redis_namespace=redis_namespace
            )
            try:
                parts = build_disk_parts(
                    worker,
                    shape,
                    num_blocks,
                    directory,
                    file_name or f"vllm-g3-w{worker_id}.bin",
                    eviction_policy=eviction_policy,
                    io_threads=io_threads,
                )
            except BaseException:
                release(worker)
                raise
        elif parts.disk.shape.block_bytes != shape.block_bytes:
            raise ValueError(
                f"{tier_type}: the G3 file holds {parts.disk.shape.block_bytes}-byte blocks,"
                f" vLLM's CPU tier {shape.block_bytes}-byte chunks"
            )
        self.parts: DiskTierParts = parts
        self.worker = parts.worker
        self.disk = parts.disk
        self.pool = parts.pool
        self._rows = rows_of(primary_kv_view)
        self._io = ThreadPoolExecutor(2, thread_name_prefix="kvledger-g3-jobs")
        self._jobs: dict[int, _Job] = {}
        self._writing: set[int] = set()  # hashes of blocks whose store is in flight
        self._keys: dict[int, OffloadKey] = {}  # hash -> vLLM key, blocks of this run
        self.events: list[OffloadingEvent] | None = None
        if enable_kv_events and offloading_spec.kv_events_config.enable_kv_cache_events:
            self.events = []
        chunk_tokens = {
            group.group_id: group.tokens_per_block * offloading_spec.blocks_per_chunk
            for group in getattr(offloading_spec.config, "groups", ())
        }
        self._chunk_tokens: dict[int, int] = chunk_tokens
        self._observer = self._on_event
        self._attach()

    def _close_parts(self) -> None:
        self.disk.close()

    # -- events ------------------------------------------------------------------------------

    def _on_event(self, event: AnyEvent) -> None:
        """G3's changes as vLLM's STORAGE events (of the blocks this run named)."""
        if event.tier is not Tier.G3:
            return
        events = self.events
        if isinstance(event, Removed):
            gone = [k for h in event.sequence_hashes if (k := self._keys.pop(h, None)) is not None]
            if gone and events is not None:
                events.append(self._event(gone, removed=True))
        elif isinstance(event, Offloaded) and events is not None:
            keys = [k for b in event.blocks if (k := self._keys.get(b.sequence_hash)) is not None]
            if keys:
                events.append(self._event(keys, removed=False))
        elif isinstance(event, Cleared):
            self._keys.clear()

    def _event(self, keys: list[OffloadKey], *, removed: bool) -> OffloadingEvent:
        return OffloadingEvent(
            keys=keys, medium=self.medium, removed=removed, locality=self.locality
        )

    def take_events(self) -> Iterable[OffloadingEvent]:
        if self.events:
            events, self.events = self.events, []
            yield from events

    # -- lookups -----------------------------------------------------------------------------

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        return LookupResult.HIT if key_hash(key) in self.pool else LookupResult.MISS

    # -- stores: vLLM's CPU tier -> G3 -------------------------------------------------------

    def _bad_chunks(self, job_metadata: TransferJob, chunk_ids: list[int]) -> bool:
        """A job naming a chunk outside the CPU tier fails whole (reported, not raised)."""
        if all(0 <= c < len(self._rows) for c in chunk_ids):
            return False
        self._jobs[job_metadata.job_id] = _Job(
            job_metadata.job_id, job_metadata.is_promotion, [], [], [], failed=True
        )
        return True

    def submit_store(self, job_metadata: TransferJob) -> None:
        keys = list(job_metadata.keys)
        chunk_ids = [int(c) for c in job_metadata.chunk_ids]
        if self._bad_chunks(job_metadata, chunk_ids):
            return
        ctx = job_metadata.req_context
        chunks = RequestChunks.of(self, ctx)
        positions = [chunks.note(key, ctx) for key in keys]  # all first: parents may follow
        todo: list[tuple[OffloadKey, int, int, int | None]] = []
        pool, writing = self.pool, self._writing
        for key, chunk, position in zip(keys, chunk_ids, positions, strict=True):
            h = key_hash(key)
            if h in pool or h in writing:
                continue  # already on G3, or on its way
            group_tokens = self._chunk_tokens.get(get_offload_group_idx(key))
            todo.append((key, chunk, h, chunks.parent(key, position, group_tokens)))
        slots = pool.allocate_upto(len(todo)) if todo else []  # may evict: Removed(G3)
        todo = todo[: len(slots)]  # G3 full of blocks in use: the rest is not kept
        job = _Job(
            job_metadata.job_id,
            False,
            [t[0] for t in todo],
            slots,
            [t[2] for t in todo],
            [t[3] for t in todo],
        )
        if todo:
            writing.update(job.hashes)
            rows = [self._rows[t[1]] for t in todo]
            blocks = [BlockInfo(h, h, p) for h, p in zip(job.hashes, job.parents, strict=True)]
            job.future = self._io.submit(self.disk.write_slots, slots, rows, blocks)
        self._jobs[job.job_id] = job

    # -- loads: G3 -> vLLM's CPU tier ---------------------------------------------------------

    def submit_load(self, job_metadata: TransferJob) -> None:
        keys = list(job_metadata.keys)
        chunk_ids = [int(c) for c in job_metadata.chunk_ids]
        if self._bad_chunks(job_metadata, chunk_ids):
            return
        pool = self.pool
        found: list[tuple[OffloadKey, int, int, int]] = []
        skipped: list[OffloadKey] = []
        for key, chunk in zip(keys, chunk_ids, strict=True):
            h = key_hash(key)
            slot = pool.lookup(h)
            if slot is None:
                skipped.append(key)  # evicted since the lookup: a miss for this key
            else:
                found.append((key, chunk, h, slot))
        slots = [f[3] for f in found]
        pool.acquire(slots)  # held until the read is done; a use for G3's policy
        job = _Job(job_metadata.job_id, True, [f[0] for f in found], slots, [f[2] for f in found])
        job.skipped = skipped
        if found:
            rows = [self._rows[f[1]] for f in found]
            job.future = self._io.submit(self.disk.read_slots, slots, rows)
        self._jobs[job.job_id] = job

    # -- completions -------------------------------------------------------------------------

    def _finish(self, job: _Job) -> JobResult:
        if job.failed:
            return JobResult(job.job_id, False)
        error: BaseException | None = None
        outcome: Any = []
        if job.future is not None:
            try:
                outcome = job.future.result()
            except Exception as exc:  # a failed write or read: the job fails, nothing is named
                error = exc
        seconds = time.monotonic() - job.started
        nbytes = len(job.slots) * self.block_size_bytes
        if not job.is_load:
            self._writing.difference_update(job.hashes)
            if error is None and job.slots:
                for key, h in zip(job.keys, job.hashes, strict=True):
                    self._keys[h] = key
                blocks = [BlockInfo(h, h, p) for h, p in zip(job.hashes, job.parents, strict=True)]
                landed = self.pool.register_copies(job.slots, blocks, Tier.G2)
                self.pool.release(landed)
            elif job.slots:
                self.pool.release(job.slots)  # never named: free again
            return JobResult(job.job_id, error is None, None, seconds, nbytes)
        self.pool.release(job.slots)
        fine: Sequence[bool] = outcome if error is None else [False] * len(job.slots)
        good = [key for key, ok in zip(job.keys, fine, strict=True) if ok]
        bad = [h for h, ok in zip(job.hashes, fine, strict=True) if not ok]
        if bad:  # a slot that failed its checksum is gone (the file invalidated it)
            self.pool.remove(bad)
        if not job.skipped and not bad:
            return JobResult(job.job_id, True, None, seconds, nbytes)
        return JobResult(job.job_id, False, tuple(good) if good else None, seconds, nbytes)
