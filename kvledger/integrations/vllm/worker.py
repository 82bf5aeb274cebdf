"""The worker side: vLLM's ``OffloadingWorker`` moving bytes with kvledger's copier.

vLLM hands the worker its KV cache as canonical tensors, one ``[num_blocks, page_bytes]`` int8
view per region. kvledger sees them as a G1 ``DeviceTier`` whose block is one byte-row of each
region (``LayerSeparate``, one "layer" per region), and keeps G2 in a ``HostTier`` of the same
block shape: a store copies G1 rows into the G2 slots the manager chose (vLLM's chunk ids), a
load copies them back. The copies run on the ``Copier`` (asynchronous; on CUDA the
device copies are issued at once and only their completion waits on the copier's thread).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from vllm.v1.kv_offload.base import (
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingWorker,
    TransferResult,
)
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec

from kvledger.tiers.device import DeviceTier
from kvledger.tiers.host import HostTier
from kvledger.tiers.layout import BlockShape, LayerSeparate
from kvledger.tiers.transfer import Copier, TransferHandle

__all__ = ["KvledgerOffloadingWorker", "block_shape_of"]


def block_shape_of(kv_caches: CanonicalKVCaches) -> tuple[BlockShape, list[torch.Tensor]]:
    """The kvledger block shape of vLLM's canonical KV caches, and one G1 layer per region.

    Refuses, naming the region, what kvledger's layouts cannot address as rows: regions of
    different page sizes or block counts, and strided (packed) regions.
    """
    regions = [t.tensor for t in kv_caches.tensors]
    if not regions:
        raise ValueError("vLLM handed the offloading worker no KV-cache tensors")
    num_blocks, page = (int(d) for d in regions[0].shape)
    layers: list[torch.Tensor] = []
    for i, region in enumerate(regions):
        if region.dim() != 2 or tuple(region.shape) != (num_blocks, page):
            raise ValueError(
                f"KV region {i} is {tuple(region.shape)}; kvledger needs every region to be"
                f" [{num_blocks}, {page}] like region 0"
            )
        if not region.is_contiguous():
            raise ValueError(
                f"KV region {i} is strided (a packed layout); kvledger copies whole rows only"
            )
        layers.append(region.view(torch.int8).view(num_blocks, 1, 1, page))
    return BlockShape(len(regions), 1, 1, page, torch.int8), layers


@dataclass
class _Job:
    handles: list[TransferHandle]
    started: float
    size: int

    def done(self) -> bool:
        return all(h.done() for h in self.handles)


class KvledgerOffloadingWorker(OffloadingWorker):  # type: ignore[misc]  # vLLM is untyped here
    """G1 (vLLM's tensors) <-> G2 (``num_chunks`` host slots), through one copier."""

    def __init__(self, kv_caches: CanonicalKVCaches, num_chunks: int) -> None:
        shape, layers = block_shape_of(kv_caches)
        self.g1 = DeviceTier.from_layout(LayerSeparate(shape, layers))
        self.g2 = HostTier(shape, max(num_chunks, 1))
        self.copier = Copier()
        self._jobs: dict[int, _Job] = {}

    def _submit(
        self, job_id: int, src_is_g1: bool, g1_slots: Sequence[int], g2_slots: Sequence[int]
    ) -> bool:
        """One job: G1 <-> G2 for every (G1 slot, G2 slot) pair."""
        if job_id in self._jobs:
            raise ValueError(f"transfer job {job_id} is already in flight")
        if len(g1_slots) != len(g2_slots):
            raise ValueError(
                f"job {job_id}: {len(g1_slots)} vLLM blocks for {len(g2_slots)} kvledger slots"
                " (kvledger offloads one vLLM block per chunk)"
            )
        started = time.perf_counter()
        if src_is_g1:
            handle = self.copier.copy(self.g1, g1_slots, self.g2, g2_slots)
        else:
            handle = self.copier.copy(self.g2, g2_slots, self.g1, g1_slots)
        size = len(g1_slots) * self.g1.shape.block_bytes
        self._jobs[job_id] = _Job([handle], started, size)
        return True

    def submit_store(
        self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec
    ) -> bool:
        assert isinstance(dst_spec, CPULoadStoreSpec), f"not a kvledger G2 spec: {dst_spec!r}"
        return self._submit(job_id, True, src_spec.block_ids.tolist(), dst_spec.block_ids.tolist())

    def submit_load(
        self,
        job_id: int,
        src_spec: LoadStoreSpec,
        dst_spec: GPULoadStoreSpec,
        expedited: bool = False,
    ) -> bool:
        assert isinstance(src_spec, CPULoadStoreSpec), f"not a kvledger G2 spec: {src_spec!r}"
        return self._submit(job_id, False, dst_spec.block_ids.tolist(), src_spec.block_ids.tolist())

    def _result(self, job_id: int, job: _Job) -> TransferResult:
        success = True
        for handle in job.handles:
            try:
                success = not handle.wait().failed and success
            except Exception:
                success = False
        return TransferResult(
            job_id=job_id,
            success=success,
            transfer_size=job.size,
            transfer_time=time.perf_counter() - job.started,
        )

    def get_finished(self) -> list[TransferResult]:
        done = [job_id for job_id, job in self._jobs.items() if job.done()]
        return [self._result(job_id, self._jobs.pop(job_id)) for job_id in done]

    def wait(self, job_ids: set[int]) -> None:
        for job_id in job_ids:
            job = self._jobs.get(job_id)
            if job is not None:
                for handle in job.handles:
                    with contextlib.suppress(Exception):  # get_finished reports it as failed
                        handle.wait()

    def shutdown(self) -> None:
        self.copier.close()
