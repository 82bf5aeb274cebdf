"""How long a restarted BlockManager takes to recover a full G3, against reading the same
bytes and checksumming them by hand, measured in the same run.

A manager fills G3 with ``--slots`` blocks (G1 -> G3 directly, offload filter ``always``) and
closes. Then, ``--reps`` times, alternating:

- restart: ``BlockManager(settings)`` on the same data folder and log: fold the log, check
  every index entry, read and checksum every listed slot (the tier's I/O threads, O_DIRECT),
  adopt the blocks. Reported: the whole construction and the tier's part of it.
- reference: one thread reading the slot file start to end with O_DIRECT in 16 MiB requests
  and taking the xxh3-64 of every block: the least work that checks every byte.
- fresh: ``BlockManager`` with the same sizes on an empty folder (reserving the file), so the
  cost of recovering is told apart from the cost of starting at all.

The file's pages are dropped from the page cache (``posix_fadvise(DONTNEED)``) before each
restart and reference read, so both read from the device.

Run: ``.venv/bin/python bench/g3_restart_bench.py`` (``--help`` for sizes and the folder).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import xxhash

from kvledger import BlockManager, Settings
from kvledger.events.types import Tier

CHUNK = 16 << 20


def settings(folder: Path, slots: int, layers: int) -> Settings:
    folder.mkdir(parents=True, exist_ok=True)
    return Settings.load(
        num_layers=layers,
        g1_blocks=512,
        g2_blocks=0,
        g3_blocks=slots,
        offload_filter="always",
        eviction_policy="lru",
        data_dir=folder / "data",
        event_log_url=f"sqlite:///{folder / 'events.db'}",
    )


def fill(s: Settings) -> None:
    with BlockManager(s) as m:
        per_prompt = 64
        for p in range(-(-s.g3_blocks // per_prompt)):
            seq = m.sequence([p * 100_000 + t for t in range(per_prompt * s.block_size)])
            slots = m.allocate(len(seq))  # contents do not matter: xxh3 costs the same
            m.release(m.register(slots, seq, start=0))
            assert m.wait_idle(120)


def drop_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def reference(path: Path, block_bytes: int, slot_bytes: int, slots: int) -> float:
    """Read every slot with O_DIRECT, start to end, and checksum each block."""
    drop_cache(path)
    raw = np.empty(CHUNK + 4096, dtype=np.uint8)
    start = -raw.ctypes.data % 4096
    buf = raw[start : start + CHUNK]
    per_chunk = CHUNK // slot_bytes
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    began = time.perf_counter()
    try:
        for first in range(0, slots, per_chunk):
            count = min(per_chunk, slots - first)
            n = os.preadv(fd, [buf[: count * slot_bytes]], 4096 + first * slot_bytes)
            assert n == count * slot_bytes
            for i in range(count):
                xxhash.xxh3_64_intdigest(buf[i * slot_bytes : i * slot_bytes + block_bytes].data)
    finally:
        os.close(fd)
    return time.perf_counter() - began


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--slots", type=int, default=4096, help="G3 blocks to fill and recover")
    parser.add_argument(
        "--layers", type=int, default=4, help="layers per block (64 KiB each at the defaults)"
    )
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--dir", type=Path, default=None, help="folder on the disk to measure")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="g3-restart-", dir=args.dir))
    try:
        s = settings(root / "cache", args.slots, args.layers)
        fill(s)
        data = s.data_dir / "g3-slots.bin"
        gib = args.slots * s.bytes_per_block / (1 << 30)
        print(f"G3: {args.slots} blocks of {s.bytes_per_block >> 10} KiB ({gib:.2f} GiB) in {data}")
        restart, tier_part, ref, fresh = [], [], [], []
        for rep in range(args.reps):
            drop_cache(data)
            began = time.perf_counter()
            m = BlockManager(s)
            restart.append(time.perf_counter() - began)
            assert m.recovery is not None and m.recovery.recovered == args.slots, m.recovery
            tier_part.append(m.recovery.seconds)
            slot_bytes = m.tier(Tier.G3).slot_bytes  # type: ignore[attr-defined]
            m.close()
            ref.append(reference(data, s.bytes_per_block, slot_bytes, args.slots))
            empty = settings(root / f"fresh{rep}", args.slots, args.layers)
            began = time.perf_counter()
            BlockManager(empty).close()
            fresh.append(time.perf_counter() - began)
            shutil.rmtree(root / f"fresh{rep}")
            print(
                f"  round {rep}: restart {restart[-1]:.3f} s (tier {tier_part[-1]:.3f} s), "
                f"reference read+xxh3 {ref[-1]:.3f} s, fresh start {fresh[-1]:.3f} s"
            )
        r, t, f, b = (statistics.median(x) for x in (restart, tier_part, ref, fresh))
        print(
            f"restart recovering {args.slots} blocks: {r:.3f} s median "
            f"({gib / t:.2f} GiB/s verified by the tier, {t:.3f} s)"
        )
        print(f"reference (1 thread, O_DIRECT read + xxh3): {f:.3f} s ({gib / f:.2f} GiB/s)")
        print(f"fresh start with an empty G3 of the same size: {b:.3f} s")
        print(f"ratio reference / tier recovery: {f / t:.2f} (above 1: faster than reference)")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
