"""SGLang G4: reading another rank's pages over NIXL against reading its G3 file on a shared
file system, and both against raw references, in the same run.

An owner rank (a separate process, ``KvledgerHiCacheStorage`` with ``g4: nixl``) stores
``--pages`` pages in its G3 file; a reader rank in this process, with the same ``data_dir``
(so the shared-file-system path can open the owner's file), reads them:

- end to end, SGLang's ``batch_get`` on a fresh reader, batches of 128 (SGLang's
  ``STORAGE_BATCH_SIZE``), with ``g4: nixl`` and with ``g4: shared_fs``: the registry lookup,
  the read, the checks, and the page kept in the reader's own G3 (``Stored`` in its log);
- the transfer alone: ``NixlPages.read`` (one NIXL READ per run of pages into registered
  staging pages, each page's checksum, the directory looked up again) against
  ``PeerG3.read_many`` per batch (the index read once, each entry read before and after,
  ``preadv`` into the page, checksum);
- references: ``os.preadv`` of the same slots from the owner's file (no checks), and a
  ``memcpy`` (numpy copy) of the same bytes already in this process's memory.

Prints pages/s and GB/s of each, and the ratios. NIXL runs over UCX on loopback (the same
machine: shared memory or TCP, whichever UCX picks), so this measures kvledger's cost around
the transport more than a network.

Runs in the SGLang test venv (`make sglang-venv`), with Redis on 127.0.0.1:6379:
    .sglang-test-venv/bin/python bench/sglang_g4_bench.py [--pages N] [--page-kib K] \
        [--repeat R] [--redis URL]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import redis
import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

from kvledger.integrations.sglang import KvledgerHiCacheStorage, g3_file_name, page_hashes
from kvledger.tiers.disk.index import ENTRY
from kvledger.tiers.disk.peer import PeerG3
from kvledger.tiers.disk.tier import HEADER_BYTES

BATCH = 128  # SGLang's STORAGE_BATCH_SIZE
OWNER = 0
READY = "@ready"


def config(folder: Path, worker: int, pages: int, page_bytes: int, **extra: Any) -> Any:
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
            "data_dir": str(folder),
            "capacity_pages": pages,
            "page_bytes": page_bytes,
            "worker_id": worker,
            "g4_staging_pages": BATCH,
            **extra,
        },
    )


def keys_and_pages(n: int, page_bytes: int) -> tuple[list[str], list[torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    keys = [hashlib.sha256(f"g4|{i}".encode()).hexdigest() for i in range(n)]
    values = [torch.randint(0, 256, (page_bytes,), dtype=torch.uint8, generator=g) for _ in keys]
    return keys, values


def owner_main(folder: str, redis_url: str, namespace: str, pages: int, page_kib: int) -> None:
    """Store the pages, say so, and serve them until stdin closes."""
    page_bytes = page_kib * 1024
    keys, values = keys_and_pages(pages, page_bytes)
    cfg = config(
        Path(folder),
        OWNER,
        pages,
        page_bytes,
        g4="nixl",
        redis_url=redis_url,
        redis_namespace=namespace,
    )
    backend = KvledgerHiCacheStorage(cfg)
    for i in range(0, pages, BATCH):
        assert backend.batch_set(keys[i : i + BATCH], values[i : i + BATCH])
    assert backend.publisher is not None and backend.publisher.wait_applied(60)
    assert backend.nixl is not None and backend.nixl.flush(60)
    print(READY, flush=True)
    sys.stdin.read()
    backend.close()


def timed(work: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    work()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pages", type=int, default=256)
    ap.add_argument("--page-kib", type=int, default=1024)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--redis", default="redis://127.0.0.1:6379/0")
    ap.add_argument("--dir", default=None, help="where the files go (default: a temp dir)")
    args = ap.parse_args()
    page_bytes = args.page_kib * 1024
    keys, values = keys_and_pages(args.pages, page_bytes)
    hashes = [page_hashes(k) for k in keys]
    namespace = f"bench-sglang-g4-{uuid.uuid4().hex[:8]}"
    client = redis.Redis.from_url(args.redis)
    seconds: dict[str, list[float]] = {
        "batch_get nixl": [],
        "batch_get shared_fs": [],
        "NixlPages.read": [],
        "PeerG3.read_many": [],
        "preadv (raw file)": [],
        "memcpy": [],
    }
    with tempfile.TemporaryDirectory(dir=args.dir) as d:
        folder = Path(d)
        owner = subprocess.Popen(
            [
                sys.executable,
                __file__,
                "owner",
                d,
                args.redis,
                namespace,
                str(args.pages),
                str(args.page_kib),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, "NIXL_LOG_LEVEL": "WARN"},
        )
        try:
            assert owner.stdout is not None
            while (line := owner.stdout.readline()) and not line.startswith(READY):
                pass
            if not line:
                raise RuntimeError("the owner process exited before storing its pages")
            owner_file = folder / g3_file_name(OWNER)
            table = np.fromfile(owner_file.with_name(owner_file.name + ".idx"), dtype=ENTRY)
            slot_of = {int(seq): slot for slot, seq in enumerate(table["sequence_hash"].tolist())}
            slots = [slot_of[seq] for seq, _ in hashes]
            memory = np.stack([v.numpy() for v in values])
            dest = np.ones_like(memory)  # touched once: no first-touch faults in a timing
            rows = list(dest)
            tensors = [torch.from_numpy(row) for row in rows]
            peer = PeerG3(owner_file)
            # the owner wrote with O_DIRECT: its pages are on disk, not in the page cache. One
            # untimed read puts them there, so every path below reads the same warm file
            _preadv(owner_file, peer.slot_bytes, slots, rows)
            worker = OWNER
            for _ in range(args.repeat):
                for mode in ("nixl", "shared_fs"):  # a fresh reader: every page is remote
                    worker += 1
                    cfg = config(
                        folder,
                        worker,
                        args.pages,
                        page_bytes,
                        g4=mode,
                        redis_url=args.redis,
                        redis_namespace=namespace,
                    )
                    with KvledgerHiCacheStorage(cfg) as reader:
                        # connected to the owner (NIXL metadata loaded, its file opened)
                        # before the clock starts: once per pair of ranks, not per read
                        if reader.nixl is not None:
                            assert reader.nixl.read([hashes[0][0]])[0] is not None
                        else:
                            assert reader._peer(OWNER) is not None
                        dest.fill(0)

                        def end_to_end(r: Any = reader) -> None:
                            for i in range(0, len(keys), BATCH):
                                got = r.batch_get(keys[i : i + BATCH], tensors[i : i + BATCH])
                                assert all(g is not None for g in got)

                        seconds[f"batch_get {mode}"].append(timed(end_to_end))
                        assert np.array_equal(dest, memory), f"batch_get {mode}: other bytes"
                        if reader.nixl is not None:
                            dest.fill(0)
                            nixl = reader.nixl

                            def transfer(n: Any = nixl) -> None:
                                for i in range(0, len(keys), BATCH):
                                    batch = [seq for seq, _ in hashes[i : i + BATCH]]
                                    got = n.read(batch, rows[i : i + BATCH])
                                    assert all(g is not None for g in got)

                            seconds["NixlPages.read"].append(timed(transfer))
                            assert np.array_equal(dest, memory), "NixlPages.read: other bytes"
                    for path in folder.glob(f"hicache-*-w{worker}.*"):  # the reader's files
                        path.unlink()
                dest.fill(0)

                def peer_read(p: PeerG3 = peer) -> None:
                    for i in range(0, len(hashes), BATCH):
                        got = p.read_many(hashes[i : i + BATCH], rows[i : i + BATCH])
                        assert all(g is not None for g in got)

                seconds["PeerG3.read_many"].append(timed(peer_read))
                assert np.array_equal(dest, memory), "PeerG3.read_many: other bytes"
                dest.fill(0)
                seconds["preadv (raw file)"].append(
                    timed(lambda: _preadv(owner_file, peer.slot_bytes, slots, rows))
                )
                assert np.array_equal(dest, memory), "preadv: other bytes"
                seconds["memcpy"].append(timed(lambda: np.copyto(dest, memory)))
            peer.close()
        finally:
            if owner.stdin is not None:
                owner.stdin.close()
            owner.wait(timeout=60)
            for key in client.scan_iter(match=f"kvl:{{{namespace}*", count=1000):
                client.delete(key)
    total = args.pages * page_bytes
    print(
        f"{args.pages} pages of {args.page_kib} KiB from another process, batches of {BATCH}, "
        f"{args.repeat} runs (median pages/s, GB/s; each run's pages/s)"
    )
    med = {name: statistics.median(s) for name, s in seconds.items()}
    for name, runs in seconds.items():
        each = ", ".join(f"{args.pages / s:,.0f}" for s in runs)
        print(
            f"{name:20s} {args.pages / med[name]:>10,.0f} pages/s {total / med[name] / 1e9:6.2f} "
            f"GB/s  [{each}]"
        )
    print(
        "ratios (medians): batch_get nixl / shared_fs "
        f"{med['batch_get shared_fs'] / med['batch_get nixl']:.2f}x; "
        f"NixlPages.read / PeerG3.read_many "
        f"{med['PeerG3.read_many'] / med['NixlPages.read']:.2f}x; "
        f"NixlPages.read / preadv {med['preadv (raw file)'] / med['NixlPages.read']:.2f}x; "
        f"NixlPages.read / memcpy {med['memcpy'] / med['NixlPages.read']:.3f}x"
    )


def _preadv(path: Path, slot_bytes: int, slots: list[int], bufs: list[np.ndarray]) -> None:
    """The reference: each page's bytes from its slot, one ``preadv`` per page, no checks."""
    fd = os.open(path, os.O_RDONLY)
    try:
        for slot, buf in zip(slots, bufs, strict=True):
            os.preadv(fd, [buf], HEADER_BYTES + slot * slot_bytes)
    finally:
        os.close(fd)


if __name__ == "__main__":
    if sys.argv[1:2] == ["owner"]:
        folder, url, name, n, kib = sys.argv[2:7]
        owner_main(folder, url, name, int(n), int(kib))
    else:
        main()
