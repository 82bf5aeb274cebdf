"""kvledger's vLLM offloading worker with a G3 file, driven with kvledger's specs the way
vLLM's connector worker drives it (runs in the vLLM test venv, from vLLM's test tree).

A store whose spec carries demotions copies the G2 slots down to the G3 file before it
overwrites them; a load reads promoted blocks through G2 and the rest straight from G3; every
byte lands where the spec says, on CPU tensors standing in for vLLM's KV cache.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from vllm.v1.kv_offload.base import (
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    CanonicalKVCacheTensor,
    GPULoadStoreSpec,
)
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec

from kvledger.events.types import BlockInfo
from kvledger.integrations.vllm.specs import DiskMoves, KvledgerLoadSpec, KvledgerStoreSpec
from kvledger.integrations.vllm.worker import KvledgerOffloadingWorker

BLOCKS, PAGE = 8, 4096


def gpu(ids: list[int]) -> GPULoadStoreSpec:
    return GPULoadStoreSpec(ids, group_sizes=[len(ids)], block_indices=[0])


def finish(worker: KvledgerOffloadingWorker, job_id: int) -> None:
    for _ in range(500):
        done = {r.job_id: r.success for r in worker.get_finished()}
        if job_id in done:
            assert done[job_id], f"job {job_id} failed"
            return
        time.sleep(0.01)
    raise AssertionError(f"job {job_id} did not finish")


@pytest.fixture
def kv() -> torch.Tensor:
    return torch.zeros(BLOCKS, PAGE, dtype=torch.int8)


@pytest.fixture
def worker(kv: torch.Tensor, tmp_path: Path):  # type: ignore[no-untyped-def]
    caches = CanonicalKVCaches(
        tensors=[CanonicalKVCacheTensor(kv, PAGE)],
        group_data_refs=[[CanonicalKVCacheRef(0, PAGE)]],
    )
    w = KvledgerOffloadingWorker(caches, 2, g3_blocks=4, g3_file=tmp_path / "g3.bin")
    yield w
    w.shutdown()


def fill(kv: torch.Tensor, block: int, value: int) -> None:
    kv[block].fill_(value)


def test_demote_on_store_then_load_from_g3_direct_and_promoted(
    worker: KvledgerOffloadingWorker, kv: torch.Tensor
) -> None:
    for block, value in ((1, 11), (2, 22), (3, 33), (4, 44)):
        fill(kv, block, value)
    # blocks 1 and 2 into G2 slots 0 and 1
    worker.submit_store(1, gpu([1, 2]), CPULoadStoreSpec([0, 1]))
    finish(worker, 1)
    # blocks 3 and 4 take G2 slots 0 and 1; what was there goes down to G3 slots 2 and 3 first
    names = [BlockInfo(100, 100, None), BlockInfo(200, 200, 100)]
    moves = DiskMoves(demotions=[(0, 2), (1, 3)], names=names)
    worker.submit_store(2, gpu([3, 4]), KvledgerStoreSpec([0, 1], moves))
    finish(worker, 2)
    kv.zero_()
    # block 11 promoted from G3 slot 2 into G2 slot 0 and read from there; block 22 read
    # straight from G3 slot 3
    load = KvledgerLoadSpec([0, -1], [2, 3], DiskMoves(promotions=[(2, 0)]))
    worker.submit_load(3, load, gpu([5, 6]))
    finish(worker, 3)
    assert bool((kv[5] == 11).all()) and bool((kv[6] == 22).all())
    # G2 slot 0 now holds the promoted block, G2 slot 1 still block 44
    worker.submit_load(4, CPULoadStoreSpec([0, 1]), gpu([6, 7]))
    finish(worker, 4)
    assert bool((kv[6] == 11).all()) and bool((kv[7] == 44).all())


def test_disk_moves_without_a_g3_are_refused(kv: torch.Tensor) -> None:
    caches = CanonicalKVCaches(
        tensors=[CanonicalKVCacheTensor(kv, PAGE)],
        group_data_refs=[[CanonicalKVCacheRef(0, PAGE)]],
    )
    w = KvledgerOffloadingWorker(caches, 2)
    try:
        moves = DiskMoves(demotions=[(0, 1)], names=[BlockInfo(1, 1, None)])
        with pytest.raises(ValueError, match="moves blocks to or from G3, and this worker"):
            w.submit_store(1, gpu([1]), KvledgerStoreSpec([0], moves))
    finally:
        w.shutdown()


def test_a_restarted_worker_reuses_the_g3_file_empty(kv: torch.Tensor, tmp_path: Path) -> None:
    caches = CanonicalKVCaches(
        tensors=[CanonicalKVCacheTensor(kv, PAGE)],
        group_data_refs=[[CanonicalKVCacheRef(0, PAGE)]],
    )
    first = KvledgerOffloadingWorker(caches, 1, g3_blocks=2, g3_file=tmp_path / "g3.bin")
    fill(kv, 1, 7)
    first.submit_store(1, gpu([1]), CPULoadStoreSpec([0]))
    finish(first, 1)
    moves = DiskMoves(demotions=[(0, 1)], names=[BlockInfo(5, 5, None)])
    first.submit_store(2, gpu([2]), KvledgerStoreSpec([0], moves))
    finish(first, 2)
    assert first.g3 is not None and [s for s, _ in first.g3.recovered_blocks()] == [1]
    first.shutdown()
    # the manager of a new run starts with an empty G3, and so does the file
    again = KvledgerOffloadingWorker(caches, 1, g3_blocks=2, g3_file=tmp_path / "g3.bin")
    try:
        assert again.g3 is not None and again.g3.recovered_blocks() == []
    finally:
        again.shutdown()
