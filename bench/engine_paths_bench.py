"""kvledger's engine-side copy paths on real tensors, without the engines around them.

- ``vllm``: kvledger's vLLM ``OffloadingWorker`` (``kvledger.integrations.vllm.worker``) driven
  with vLLM 0.33's own spec classes the way vLLM's connector drives it: store jobs G1 -> G2 and
  load jobs G2 -> G1 against one pinned ``copy_`` of the same bytes (every repetition's ratio),
  with the KV regions in one allocation per region (as vLLM allocates them) and in one
  allocation. Every byte is checked where it lands. (kvledger's G3 for vLLM is a tiering
  secondary tier below vLLM's CPU tier: its copies are host memory to file, which the G3 part
  of the check measures.)
- ``sglang``: kvledger's HiCache storage backend (``kvledger.integrations.sglang``) through
  SGLang 0.5.23's ``HiCacheStorage`` interface: pages stored from and read into device tensors
  (``batch_set``/``batch_get``), and the zero-copy path (``batch_set_v1``/``batch_get_v1``) on a
  pinned host pool with SGLang's host-pool interface, each against O_DIRECT writes and reads of
  the same bytes. SGLang's own host pool is not used: it needs SGLang's device pool and kernels.

On a machine without CUDA both run on CPU tensors (``--device cpu``). The engines' modules must
import: run it with the vLLM or SGLang test venv's interpreter (``make vllm-venv``, ``make
sglang-venv``), or with the slices of them that ``bench/gpu_wheels.sh`` packs on PYTHONPATH.

    .vllm-test-venv/bin/python bench/engine_paths_bench.py vllm
    .sglang-test-venv/bin/python bench/engine_paths_bench.py sglang --json out.json
    ... --imports-only     # only check that every module it would run imports

The last line printed is ``RESULT {json}``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import mmap
import random
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from transfer_bench import direct_io, fill_random, machine, paired, ratio_row, table_row

# -- vLLM's worker ---------------------------------------------------------------------------


def run_job(worker: Any, job_id: int, submit: Any) -> None:
    """Submit one job, wait for it, and check vLLM's ``get_finished`` reports it done."""
    submit()
    worker.wait({job_id})
    for _ in range(1000):
        done = {r.job_id: r.success for r in worker.get_finished()}
        if job_id in done:
            if not done[job_id]:
                raise RuntimeError(f"job {job_id} failed")
            return
        time.sleep(0.001)
    raise RuntimeError(f"job {job_id} is not reported finished after wait()")


def aligned(nbytes: int) -> torch.Tensor:
    """Page-aligned host memory (anonymous mmap), as O_DIRECT wants."""
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=torch.uint8)


def vllm_bench(args: argparse.Namespace, rows: list[dict[str, Any]]) -> None:
    # vLLM is not in the main venv: imported here, for this subcommand only
    from vllm.v1.kv_offload.base import (
        CanonicalKVCacheRef,
        CanonicalKVCaches,
        CanonicalKVCacheTensor,
        GPULoadStoreSpec,
    )
    from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec

    from kvledger.integrations.vllm.worker import KvledgerOffloadingWorker

    if args.imports_only:
        return
    dev = torch.device(args.device)
    cuda = dev.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    n, regions, page = args.blocks, args.regions, args.page_kib * 1024
    nbytes = n * regions * page
    rng = random.Random(0)
    gen = torch.Generator(device=dev).manual_seed(0)
    jobs = iter(range(1, 1 << 30))
    ref_name = "pinned copy_" if cuda else "memcpy (copy_)"
    src = rng.sample(range(2 * n), n)
    dst = sorted(set(range(2 * n)) - set(src))
    rng.shuffle(dst)
    chunks = rng.sample(range(n), n)

    def gpu(ids: list[int]) -> GPULoadStoreSpec:
        return GPULoadStoreSpec(ids, group_sizes=[len(ids)], block_indices=[0])

    def check(tensors: list[torch.Tensor], what: str) -> None:
        sync()
        wrong = [
            d for s, d in zip(src, dst, strict=True) if any(not t[d].equal(t[s]) for t in tensors)
        ]
        if wrong:
            raise RuntimeError(f"{len(wrong)} of {n} blocks arrived wrong in G1 ({what})")

    def one_layout(layout: str, tensors: list[torch.Tensor], folder: Path) -> None:
        for t in tensors:
            fill_random(t, gen)
        caches = CanonicalKVCaches(
            tensors=[CanonicalKVCacheTensor(t, page) for t in tensors],
            group_data_refs=[[CanonicalKVCacheRef(i, page) for i in range(regions)]],
        )
        worker = KvledgerOffloadingWorker(caches, n)
        try:
            ref_host = worker.g2.layout.block_bytes_view().reshape(-1)
            ref_dev = torch.empty(nbytes, dtype=torch.uint8, device=dev)

            def store(job: int) -> None:
                spec = CPULoadStoreSpec(chunks)
                run_job(worker, job, lambda: worker.submit_store(job, gpu(src), spec))

            def load(job: int) -> None:
                spec = CPULoadStoreSpec(chunks)
                run_job(worker, job, lambda: worker.submit_load(job, spec, gpu(dst)))

            down = paired(
                lambda: ref_host.copy_(ref_dev, non_blocking=True),
                lambda: store(next(jobs)),
                args.reps,
                sync,
            )
            up = paired(
                lambda: ref_dev.copy_(ref_host, non_blocking=True),
                lambda: load(next(jobs)),
                args.reps,
                sync,
            )
            check(tensors, f"G2->G1, {layout}")
            rows.append(ratio_row(f"vLLM store G1->G2, {layout}", nbytes, down, ref_name))
            rows.append(ratio_row(f"vLLM load G2->G1, {layout}", nbytes, up, ref_name))
        finally:
            worker.shutdown()

    for layout in ("regions apart", "one allocation"):
        if layout == "regions apart":  # as vLLM allocates them: one tensor per region
            tensors = [
                torch.empty(2 * n, page, dtype=torch.int8, device=dev) for _ in range(regions)
            ]
        else:
            tensors = list(torch.empty(regions, 2 * n, page, dtype=torch.int8, device=dev))
        folder = Path(tempfile.mkdtemp(prefix="kvledger-vllm-", dir=args.dir))
        try:
            one_layout(layout, tensors, folder)
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        del tensors


# -- SGLang's page path ----------------------------------------------------------------------


class PinnedHostPool:
    """SGLang's host-pool interface as the v1 path uses it (``page_size`` tokens a page, flat
    pages read and written by token index), over pinned memory where CUDA is present."""

    def __init__(self, pages: int, page_tokens: int, page_bytes: int, cuda: bool) -> None:
        self.page_size = page_tokens
        data = torch.zeros(pages * page_tokens, page_bytes // page_tokens, dtype=torch.uint8)
        self.data = data.pin_memory() if cuda else data

    def get_dummy_flat_data_page(self) -> torch.Tensor:
        return torch.zeros(self.data[: self.page_size].numel(), dtype=torch.uint8)

    def get_data_page(self, index: int, flat: bool = True) -> torch.Tensor:
        return self.data[index : index + self.page_size].flatten()

    def set_from_flat_data_page(self, index: int, page: torch.Tensor) -> None:
        self.data[index : index + self.page_size] = page.view(self.page_size, -1)


def page_keys(n: int, seed: str) -> list[str]:
    """SGLang's page keys: SHA-256 hex of each page chained on the previous key."""
    keys, prev = [], seed
    for i in range(n):
        prev = hashlib.sha256(f"{prev}|page{i}".encode()).hexdigest()
        keys.append(prev)
    return keys


def sglang_bench(args: argparse.Namespace, rows: list[dict[str, Any]]) -> None:
    # SGLang is not in the main venv: imported here, for this subcommand only
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig, HiCacheStorageExtraInfo

    from kvledger.integrations.sglang import KvledgerHiCacheStorage

    if args.imports_only:
        return
    dev = torch.device(args.device)
    cuda = dev.type == "cuda"
    n, page_bytes, page_tokens = args.blocks, args.page_kib * 1024, 64
    nbytes = n * page_bytes
    folder = Path(tempfile.mkdtemp(prefix="kvledger-sglang-", dir=args.dir))
    config = HiCacheStorageConfig(
        tp_rank=0,
        tp_size=1,
        pp_rank=0,
        pp_size=1,
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=False,
        enable_storage_metrics=False,
        is_page_first_layout=True,
        model_name="gpu-check",
        extra_config={"data_dir": str(folder), "capacity_pages": n, "page_bytes": page_bytes},
    )
    backend = KvledgerHiCacheStorage(config)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    gen = torch.Generator(device=dev).manual_seed(0)
    try:
        pages = torch.empty(n, page_bytes, dtype=torch.uint8, device=dev)
        fill_random(pages, gen)
        targets = torch.zeros_like(pages)
        ref = aligned(nbytes)
        ref_file = folder / "ref.bin"
        direct_io(ref_file, ref, 16 << 20, write=True)
        rounds = iter(range(1 << 30))
        keys: list[str] = []

        def store() -> None:
            backend.clear()  # a fresh chain each round: stored keys would not be written again
            keys[:] = page_keys(n, f"round{next(rounds)}")
            if not backend.batch_set(keys, list(pages)):
                raise RuntimeError("batch_set did not store every page")

        def fetch() -> None:
            got = backend.batch_get(keys, list(targets))
            if any(g is None for g in got):
                raise RuntimeError("batch_get missed a stored page")

        put = paired(lambda: direct_io(ref_file, ref, 16 << 20, write=True), store, args.reps, sync)
        get = paired(
            lambda: direct_io(ref_file, ref, 16 << 20, write=False), fetch, args.reps, sync
        )
        sync()
        if not targets.equal(pages):
            raise RuntimeError("pages read into device tensors differ from the pages stored")
        where = "device" if cuda else "CPU"
        rows.append(ratio_row(f"SGLang batch_set from {where}", nbytes, put, "O_DIRECT pwritev", 2))
        rows.append(ratio_row(f"SGLang batch_get into {where}", nbytes, get, "O_DIRECT preadv", 2))

        # v1: pages move by host-pool index; the pool is filled from device memory first, as
        # SGLang's backup does (its L1 -> L2 copy is SGLang's, not timed here)
        pool = PinnedHostPool(2 * n, page_tokens, page_bytes, cuda)
        backend.register_mem_pool_host(pool)
        pool.data[: n * page_tokens].view(n, page_bytes).copy_(pages)
        low = torch.arange(n * page_tokens)
        high = low + n * page_tokens

        def store_v1() -> None:
            backend.clear()
            keys[:] = page_keys(n, f"round{next(rounds)}")
            prefix = HiCacheStorageExtraInfo(prefix_keys=None)
            if not all(backend.batch_set_v1(keys, low, prefix)):
                raise RuntimeError("batch_set_v1 did not store every page")

        def fetch_v1() -> None:
            if not all(backend.batch_get_v1(keys, high)):
                raise RuntimeError("batch_get_v1 missed a stored page")

        put1 = paired(
            lambda: direct_io(ref_file, ref, 16 << 20, write=True), store_v1, args.reps, sync
        )
        get1 = paired(
            lambda: direct_io(ref_file, ref, 16 << 20, write=False), fetch_v1, args.reps, sync
        )
        if not pool.data[n * page_tokens :].equal(pool.data[: n * page_tokens]):
            raise RuntimeError("pages read back by host index differ from the pages stored")
        pinned = "pinned " if cuda else ""
        rows.append(
            ratio_row(f"SGLang batch_set_v1 from {pinned}host pool", nbytes, put1, "O_DIRECT", 2)
        )
        rows.append(
            ratio_row(f"SGLang batch_get_v1 into {pinned}host pool", nbytes, get1, "O_DIRECT", 2)
        )
    finally:
        backend.close()
        shutil.rmtree(folder, ignore_errors=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("engine", choices=("vllm", "sglang"))
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--blocks", type=int, default=128, help="blocks (vLLM) or pages (SGLang)")
    p.add_argument("--regions", type=int, default=32, help="vLLM KV regions (layers)")
    p.add_argument("--page-kib", type=int, default=64, help="vLLM region page / 32 SGLang page")
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--dir", default=None, help="folder for the G3 files (default: tmp)")
    p.add_argument("--imports-only", action="store_true")
    p.add_argument("--json", default=None, help="also write the rows here")
    args = p.parse_args()
    if args.engine == "sglang":
        args.page_kib *= args.regions  # one SGLang page: all layers of its tokens
    rows: list[dict[str, Any]] = []
    (vllm_bench if args.engine == "vllm" else sglang_bench)(args, rows)
    if args.imports_only:
        print(f"RESULT {json.dumps({'engine': args.engine, 'imports': 'ok'})}")
        return
    print(f"machine: {machine()}; {args.engine} path, {args.blocks} blocks, median of {args.reps}")
    header = ("route", "kvledger GB/s", "ref GB/s", "reference", "ratio")
    cells = [header, *map(table_row, rows)]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    for r in cells:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)))
    for row in rows:
        row.pop("digits", None)
    result = {"engine": args.engine, "device": args.device, "reps": args.reps, "rows": rows}
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    print(f"RESULT {json.dumps(result)}")


if __name__ == "__main__":
    main()
