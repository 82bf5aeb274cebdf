"""SGLang HiCache L3 page I/O: kvledger's backend (G3 file + event log) against SGLang 0.5.23's
own file backend (``HiCacheFile``: one file per page), on the same pages, in the same run.

Each round stores a batch of new pages (``batch_set``), asks which exist (``batch_exists``) and
reads them back (``batch_get``), then stores the next batch; capacity is large enough that
nothing is evicted. Prints pages/s of set and get for each and the ratio kvledger / SGLang.
Both write through the page cache (kvledger's G3 uses O_DIRECT only where the file system has
it; a tmpfs has not), so this compares the bookkeeping and syscalls, not the disk.

Runs in the SGLang test venv (`make sglang-venv`):
    .sglang-test-venv/bin/python bench/sglang_bench.py [--pages N] [--page-kib K] [--repeat R] \
        [--dir D]
"""

from __future__ import annotations

import argparse
import hashlib
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheFile, HiCacheStorageConfig

from kvledger.integrations.sglang import KvledgerHiCacheStorage

BATCH = 128  # SGLang's STORAGE_BATCH_SIZE


def config(directory: Path, pages: int, page_bytes: int) -> HiCacheStorageConfig:
    return HiCacheStorageConfig(
        tp_rank=0,
        tp_size=1,
        pp_rank=0,
        pp_size=1,
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=False,
        enable_storage_metrics=False,
        is_page_first_layout=True,
        model_name="bench",
        extra_config={
            "data_dir": str(directory),
            "capacity_pages": pages,
            "page_bytes": page_bytes,
        },
    )


def run(backend: Any, keys: list[str], values: list[torch.Tensor]) -> tuple[float, float]:
    """Seconds spent in set and in exists + get over all batches."""
    t_set = t_get = 0.0
    for i in range(0, len(keys), BATCH):
        k, v = keys[i : i + BATCH], values[i : i + BATCH]
        t0 = time.perf_counter()
        assert backend.batch_set(k, v)
        t1 = time.perf_counter()
        assert backend.batch_exists(k) == len(k)
        got = backend.batch_get(k, [torch.empty_like(x) for x in v])
        t2 = time.perf_counter()
        assert all(g is not None and torch.equal(g, x) for g, x in zip(got, v, strict=True))
        t_set += t1 - t0
        t_get += t2 - t1
    return t_set, t_get


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pages", type=int, default=2048)
    ap.add_argument("--page-kib", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--dir", default=None, help="where the files go (default: a temp dir)")
    args = ap.parse_args()
    page_bytes = args.page_kib * 1024
    g = torch.Generator().manual_seed(0)
    values = [
        torch.randint(0, 256, (page_bytes,), dtype=torch.uint8, generator=g)
        for _ in range(args.pages)
    ]
    rates: dict[str, list[tuple[float, float]]] = {"kvledger": [], "sglang-file": []}
    for r in range(args.repeat):
        keys = [hashlib.sha256(f"{r}|{i}".encode()).hexdigest() for i in range(args.pages)]
        for name in rates:
            with tempfile.TemporaryDirectory(dir=args.dir) as d:
                cfg = config(Path(d), args.pages, page_bytes)
                backend: Any
                if name == "kvledger":
                    backend = KvledgerHiCacheStorage(cfg)
                else:
                    backend = HiCacheFile(cfg, file_path=d)
                t_set, t_get = run(backend, keys, values)
                if name == "kvledger":
                    backend.close()
                rates[name].append((args.pages / t_set, args.pages / t_get))
    print(f"{args.pages} pages of {args.page_kib} KiB, batches of {BATCH}, {args.repeat} runs")
    med = {
        n: (statistics.median(s for s, _ in v), statistics.median(g for _, g in v))
        for n, v in rates.items()
    }
    for name, v in rates.items():
        sets = ", ".join(f"{s:,.0f}" for s, _ in v)
        gets = ", ".join(f"{g:,.0f}" for _, g in v)
        print(f"{name:12s} set pages/s [{sets}]  exists+get pages/s [{gets}]")
    k, f = med["kvledger"], med["sglang-file"]
    print(f"ratio kvledger / sglang-file (medians): set {k[0] / f[0]:.2f}x  get {k[1] / f[1]:.2f}x")


if __name__ == "__main__":
    main()
