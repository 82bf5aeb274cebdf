"""READ (or WRITE) of blocks between two processes over NIXL (UCX), against a plain copy.

Two processes: the owner registers ``--blocks`` blocks of ``--block-mib`` MiB with its NIXL
agent (through ``kvledger.tiers.remote.RemoteAgent``, the path G4 uses) and hands its agent card
over a pipe; the reader registers as many slots and READs all blocks in one transfer, ``--repeat``
times. The reference, measured in the same run by the reader, is one copy of the same bytes
between two buffers of the same kinds in one process (``torch`` ``copy_``: memcpy for DRAM, a
device copy for VRAM, a pinned host-to-device copy for DRAM -> VRAM).

``--op write`` pushes instead: the reader WRITEs its slots into the owner's (UCX serves the two
directions with different protocols; see ``bench/nixl_ucx_diag.py``). Every run checks the
bytes that moved (xxh3 per block) after the timed transfers.

``--layout scattered`` reads the remote blocks in a shuffled order (one descriptor per block, as
a prefix spread over an LRU pool is); ``contiguous`` lets consecutive blocks merge into one.
``--verify`` adds the xxh3 pass that G4 runs on every block it reads (host destinations only).

``--g3 DIR`` instead compares G3's file I/O paths on a file in DIR: the plain path (O_DIRECT
``pwritev``/``preadv`` of one block per call on the disk tier's 4 I/O threads) against NIXL's
POSIX backend (one transfer of all blocks, file and buffer registered once), alternating
rounds so both see the same disk state.

    python bench/nixl_bench.py                         # DRAM -> DRAM, 64 x 2 MiB
    python bench/nixl_bench.py --src vram --dst vram   # on a CUDA machine
    python bench/nixl_bench.py --g3 kvledger-data      # G3: plain POSIX vs NIXL POSIX
    UCX_TLS=... python bench/nixl_bench.py ...         # UCX settings pass through the env
    python bench/nixl_ucx_diag.py                      # GPU: which UCX settings make VRAM fast

The last line printed is ``RESULT {json}`` for scripts. The ratio printed is NIXL bandwidth /
reference copy bandwidth.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import random
import statistics
import time
from typing import Any

import torch

from kvledger.events.types import Tier
from kvledger.tiers.base import MemoryTier
from kvledger.tiers.device.tier import DeviceTier
from kvledger.tiers.host.tier import HostTier
from kvledger.tiers.layout import BlockShape
from kvledger.tiers.remote import RemoteAgent, block_checksum


def make_tier(kind: str, shape: BlockShape, blocks: int) -> MemoryTier:
    if kind == "vram":
        return DeviceTier(shape, blocks, layout="fully_contiguous", device="cuda")
    return HostTier(shape, blocks, pin=torch.cuda.is_available())


def block_shape(block_mib: float) -> BlockShape:
    # one "layer" of K and V, bf16: 2 x 16 tokens x inner elements = block_mib MiB
    inner = int(block_mib * 1024 * 1024) // (2 * 16 * 2)
    return BlockShape(1, 2, 16, inner, torch.bfloat16)


def owner(conn: Any, kind: str, block_mib: float, blocks: int) -> None:
    """Registers random blocks, hands over its card and their checksums, then answers
    ``("verify", [(slot, checksum), ...])`` with the slots that do not match, until "done"."""
    shape = block_shape(block_mib)
    tier = make_tier(kind, shape, blocks)
    layout: Any = tier.layout
    tensor = layout.tensor
    tensor.view(torch.uint8).copy_(
        torch.randint(0, 256, tensor.view(torch.uint8).shape, dtype=torch.uint8)
    )
    agent = RemoteAgent(worker_id=1)
    agent.register(tier)
    conn.send((agent.card(shape), [block_checksum(layout, s) for s in range(blocks)]))
    while True:
        message = conn.recv()
        if message == "done":
            break
        _, expected = message
        conn.send([slot for slot, want in expected if block_checksum(layout, slot) != want])
    agent.close()


def timed(fn: Any, repeat: int, sync: bool) -> list[float]:
    out = []
    for _ in range(repeat):
        if sync:
            torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        if sync:
            torch.cuda.synchronize()
        out.append(time.perf_counter() - t)
    return out


def g3_bench(directory: str, blocks: int, block_mib: float, repeat: int) -> None:
    from concurrent.futures import ThreadPoolExecutor

    import numpy as np

    from kvledger.tiers.disk.fileio import PosixFileIO
    from kvledger.tiers.remote.nixl import nixl_api

    bb = int(block_mib * 1024 * 1024)
    total = blocks * bb
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, "nixl-bench-g3.bin")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    os.posix_fallocate(fd, 0, total)
    os.close(fd)
    raw = torch.empty(total + 4096, dtype=torch.uint8)
    start = -raw.data_ptr() % 4096
    buf = raw[start : start + total]
    buf.copy_(torch.randint(0, 256, (total,), dtype=torch.uint8))
    rows = buf.numpy().reshape(blocks, bb)
    slots = list(range(blocks))
    random.Random(0).shuffle(slots)  # blocks land in scattered file slots, as G3 evicts

    plain_io = PosixFileIO(path, direct=True)
    pool = ThreadPoolExecutor(4)

    def plain(op: str) -> None:
        fn = plain_io.write if op == "WRITE" else plain_io.read
        list(pool.map(lambda i: fn(rows[i], slots[i] * bb), range(blocks)))

    api = nixl_api()
    agent = api.nixl_agent("g3-bench", api.nixl_agent_config(backends=["POSIX"]))
    direct_fd = os.open(path, os.O_RDWR | os.O_DIRECT)
    agent.register_memory([(buf.data_ptr(), total, 0, "")], "DRAM")
    agent.register_memory([(0, total, direct_fd, "")], "FILE")
    mem = agent.get_xfer_descs(
        np.array([(buf.data_ptr() + i * bb, bb, 0) for i in range(blocks)], dtype=np.uint64),
        "DRAM",
    )
    fil = agent.get_xfer_descs(
        np.array([(slots[i] * bb, bb, direct_fd) for i in range(blocks)], dtype=np.uint64),
        "FILE",
    )

    def nixl(op: str) -> None:
        handle = agent.initialize_xfer(op, mem, fil, "g3-bench")
        state = agent.transfer(handle)
        while state == "PROC":
            state = agent.check_xfer_state(handle)
        agent.release_xfer_handle(handle)
        if state != "DONE":
            raise RuntimeError(f"NIXL POSIX {op} ended {state}")

    times: dict[tuple[str, str], list[float]] = {}
    for _ in range(repeat):
        for name, fn in (("plain", plain), ("nixl", nixl)):
            for op in ("WRITE", "READ"):
                started = time.perf_counter()
                fn(op)
                times.setdefault((name, op), []).append(time.perf_counter() - started)
    print(f"G3 file I/O, {blocks} x {block_mib:g} MiB scattered slots, O_DIRECT, {path}")
    for op in ("WRITE", "READ"):
        plain_gbps = total / 1e9 / statistics.median(times[("plain", op)])
        nixl_gbps = total / 1e9 / statistics.median(times[("nixl", op)])
        print(
            f"  {op:5}: plain {plain_gbps:6.2f} GB/s, NIXL POSIX {nixl_gbps:6.2f} GB/s, "
            f"ratio NIXL/plain {nixl_gbps / plain_gbps:.3f}"
        )
    plain_io.close()
    os.close(direct_fd)
    os.unlink(path)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--src", choices=("dram", "vram"), default="dram")
    p.add_argument("--dst", choices=("dram", "vram"), default="dram")
    p.add_argument("--op", choices=("read", "write"), default="read")
    p.add_argument("--blocks", type=int, default=64)
    p.add_argument("--block-mib", type=float, default=2.0)
    p.add_argument("--repeat", type=int, default=10)
    p.add_argument("--layout", choices=("scattered", "contiguous"), default="scattered")
    p.add_argument("--verify", action="store_true", help="also time the xxh3 check of G4")
    p.add_argument("--g3", metavar="DIR", help="compare G3 file paths on a file in DIR instead")
    args = p.parse_args()
    if args.g3:
        g3_bench(args.g3, args.blocks, args.block_mib, args.repeat)
        return
    cuda = "vram" in (args.src, args.dst)
    if cuda and not torch.cuda.is_available():
        raise SystemExit("VRAM needs CUDA, which torch does not see here")
    # --src is where the bytes start, --dst where they land: a READ pulls from the owner's
    # src, a WRITE pushes from the reader's src into the owner's dst.
    remote_kind, local_kind = (args.src, args.dst) if args.op == "read" else (args.dst, args.src)

    shape = block_shape(args.block_mib)
    total = shape.block_bytes * args.blocks
    parent, child = mp.get_context("spawn").Pipe()
    proc = mp.get_context("spawn").Process(
        target=owner, args=(child, remote_kind, args.block_mib, args.blocks)
    )
    proc.start()
    try:
        if not parent.poll(120):  # the owner died (e.g. NIXL missing there) or hangs
            raise SystemExit(f"the owner process gave no agent card (exit code {proc.exitcode})")
        card, sums = parent.recv()
        tier = make_tier(local_kind, shape, args.blocks)
        layout: Any = tier.layout
        layout.tensor.view(torch.uint8).copy_(
            torch.randint(0, 256, layout.tensor.view(torch.uint8).shape, dtype=torch.uint8)
        )
        agent = RemoteAgent(worker_id=2)
        agent.register(tier)
        remote_region = card.region(Tier.G1 if remote_kind == "vram" else Tier.G2)
        local_tier = Tier.G1 if local_kind == "vram" else Tier.G2
        remote = list(range(args.blocks))
        if args.layout == "scattered":
            random.Random(0).shuffle(remote)
        pairs = list(zip(remote, range(args.blocks), strict=True))
        move = agent.read if args.op == "read" else agent.write

        def transfer() -> None:
            outcome = move(card, remote_region, local_tier, pairs, timeout_s=60)
            if not outcome.ok:
                raise RuntimeError(f"{args.op.upper()} failed: {outcome}")

        transfer()  # connect and warm up (UCX wires up lazily, registers memory types)
        nixl_s = timed(transfer, args.repeat, cuda)
        if args.op == "read":
            bad = [d for s, d in pairs if block_checksum(layout, d) != sums[s]]
        else:
            parent.send(("verify", [(s, block_checksum(layout, d)) for s, d in pairs]))
            bad = parent.recv()
        if bad:
            raise SystemExit(f"{len(bad)} blocks arrived wrong")

        # Reference: the same bytes between two buffers of the same kinds, in this process.
        ref_src = make_tier(args.src, shape, args.blocks).layout.tensor  # type: ignore[attr-defined]
        ref_dst = make_tier(args.dst, shape, args.blocks).layout.tensor  # type: ignore[attr-defined]
        ref_src.view(torch.uint8).fill_(7)
        ref_dst.copy_(ref_src)
        ref_s = timed(lambda: ref_dst.copy_(ref_src, non_blocking=cuda), args.repeat, cuda)

        gb = total / 1e9
        nixl_gbps = gb / statistics.median(nixl_s)
        ref_gbps = gb / statistics.median(ref_s)
        env = {k: v for k, v in sorted(os.environ.items()) if k.startswith("UCX_")}
        print(
            f"{args.src}->{args.dst} {args.op.upper()} {args.blocks} x {args.block_mib:g} MiB "
            f"({args.layout}), median of {args.repeat}, bytes verified; UCX env {env or 'default'}"
        )
        print(f"  NIXL {args.op.upper():5} (2 processes): {nixl_gbps:8.2f} GB/s")
        print(f"  reference copy_ (1 proc) : {ref_gbps:8.2f} GB/s")
        print(f"  ratio NIXL/reference     : {nixl_gbps / ref_gbps:8.3f}")
        result = {
            "route": f"{args.src}->{args.dst}",
            "op": args.op,
            "bytes": total,
            "nixl_gbps": round(nixl_gbps, 3),
            "ref_gbps": round(ref_gbps, 3),
        }
        if args.verify and local_kind == "dram" and args.op == "read":
            check_s = timed(
                lambda: [block_checksum(layout, d) for d in range(args.blocks)],
                args.repeat,
                False,
            )
            check_gbps = gb / statistics.median(check_s)
            both = gb / (statistics.median(nixl_s) + statistics.median(check_s))
            print(f"  xxh3 verify              : {check_gbps:8.2f} GB/s")
            print(f"  READ + verify (G4 fetch) : {both:8.2f} GB/s, ratio {both / ref_gbps:.3f}")
            result["verify_gbps"] = round(check_gbps, 3)
        print("RESULT " + json.dumps(result), flush=True)
        agent.close()
    finally:
        if proc.is_alive():
            parent.send("done")
        proc.join(30)
        if proc.is_alive():
            proc.kill()


if __name__ == "__main__":
    main()
