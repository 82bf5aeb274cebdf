"""Transfer engine throughput against plain copies of the same bytes, measured in the same run.

Default workload (issue 4): 256 blocks of 2 MiB (32 layers x 2 x 16 tokens x 1024 x bf16),
G1 LayerSeparate, random source and destination slots.

- G1->G2 and G2->G1 against one plain copy of the same byte count between a device buffer and
  G2's own memory: pinned ``copy_`` on a GPU, a contiguous tensor ``copy_`` (memcpy) on CPU.
- G2->G3 and G3->G2 (checksums on) against sequential ``os.pwritev``/``os.preadv`` with O_DIRECT
  of the same bytes into a separate preallocated file, in 16 MiB requests.
- The ceiling once gathering costs nothing: the engine's own device->host copies (one per run
  of consecutive G2 slots) from a contiguous device buffer, against the same plain copy.
- On CUDA, the same copies dealt to 2 and 4 streams: whether overlapping copy engines close the
  gaps between one stream's copies.
- G1<->G2 again with the layers in separate allocations (engine tensors with no block-major
  view: gathered and scattered one layer at a time).
- Engine and reference runs alternate, and each figure is the median of ``--reps`` runs.
- Single-block onboard latency G2->G1 and G3->G1 (submit to ``wait()`` returning).

Run: ``.venv/bin/python bench/transfer_bench.py`` (``--help`` for sizes and the G3 folder).
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import random
import shutil
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from kvledger.tiers import (
    BlockShape,
    DeviceTier,
    DiskTier,
    HostTier,
    LayerSeparate,
    TransferEngine,
)
from kvledger.tiers.transfer.routes import slot_runs


def median_seconds(fn: Callable[[], object], reps: int, sync: Callable[[], object]) -> float:
    fn()  # warm-up: staging buffers, streams, page faults
    sync()
    times = []
    for _ in range(reps):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def paired_medians(
    a: Callable[[], object], b: Callable[[], object], reps: int, sync: Callable[[], object]
) -> tuple[float, float]:
    """Medians of ``a`` and ``b`` timed alternately, so drift of the machine (a shared disk,
    clocks) falls on both alike."""
    ta: list[float] = []
    tb: list[float] = []
    for _ in range(reps):
        ta.append(median_seconds(a, 1, sync))
        tb.append(median_seconds(b, 1, sync))
    return statistics.median(ta), statistics.median(tb)


_streams: list[torch.cuda.Stream] = []


def copies_on_streams(dsts: list[torch.Tensor], srcs: list[torch.Tensor], k: int) -> None:
    """``dst.copy_(src)`` for each pair, the pairs dealt round-robin to ``k`` CUDA streams that
    start after, and are waited for by, the current stream."""
    while len(_streams) < k:
        _streams.append(torch.cuda.Stream())  # type: ignore[no-untyped-call]
    current = torch.cuda.current_stream()
    for i, stream in enumerate(_streams[:k]):
        stream.wait_stream(current)
        with torch.cuda.stream(stream):
            torch._foreach_copy_(dsts[i::k], srcs[i::k], non_blocking=True)
    for stream in _streams[:k]:
        current.wait_stream(stream)


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


def machine() -> str:
    if torch.cuda.is_available():
        return f"GPU {torch.cuda.get_device_name()}"
    out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    name = next((ln.split(":", 1)[1].strip() for ln in out.splitlines() if "Model name" in ln), "?")
    return f"CPU {name}, {os.cpu_count()} cores"


def fill_random(t: torch.Tensor, gen: torch.Generator) -> None:
    raw = t.view(torch.uint8)
    raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=gen, device=t.device))


def memory_bench(args: argparse.Namespace, shape: BlockShape, rows: list[tuple[str, ...]]) -> None:
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cuda = dev.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    n = args.blocks
    nbytes = n * shape.block_bytes
    rng = random.Random(0)
    gen = torch.Generator(device=dev).manual_seed(0)

    g1 = DeviceTier(shape, 2 * n, device=dev)
    for layer in g1.layout.layers:  # type: ignore[attr-defined]
        fill_random(layer, gen)
    g2 = HostTier(shape, 2 * n)
    src, dst = rng.sample(range(2 * n), n), rng.sample(range(2 * n), n)
    engine = TransferEngine(staging_blocks=args.staging_blocks)

    # Reference: one plain copy of the same byte count into and out of G2's own memory (pinned
    # buffers of the same size were seen to copy at 32 to 55 GB/s on one machine, so a separate
    # buffer would measure the buffer, not the engine).
    ref_dev = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    ref_host = g2.layout.block_bytes_view()[:n].reshape(-1)
    fill_random(ref_dev, gen)
    ref_name = "pinned copy_" if cuda else "memcpy (copy_)"
    down_ref, down = paired_medians(
        lambda: ref_host.copy_(ref_dev, non_blocking=True),
        lambda: engine.copy(g1, src, g2, dst).wait(),
        args.reps,
        sync,
    )
    up_ref, up = paired_medians(
        lambda: ref_dev.copy_(ref_host, non_blocking=True),
        lambda: engine.copy(g2, dst, g1, src).wait(),
        args.reps,
        sync,
    )
    # The ceiling left once gathering is free: the same host<->device copies the engine issues,
    # one per run of consecutive host slots, straight from/to a contiguous device buffer.
    host_runs = slot_runs(sorted(dst))  # the runs the engine copies
    dev_rows = ref_dev.view(n, shape.block_bytes)
    host_rows = g2.layout.block_bytes_view()
    runs_down_ref, runs_down = paired_medians(
        lambda: ref_host.copy_(ref_dev, non_blocking=True),
        lambda: torch._foreach_copy_(
            [host_rows[s : s + c] for r, s, c in host_runs],
            [dev_rows[r : r + c] for r, s, c in host_runs],
            non_blocking=True,
        ),
        args.reps,
        sync,
    )
    # The same copies spread over several streams: whether the gaps between one stream's DMA
    # copies (what keeps the engine under the plain copy) close when copy engines overlap.
    spread: list[tuple[str, float, float]] = []
    if cuda:
        down_pairs = (
            [host_rows[s : s + c] for r, s, c in host_runs],
            [dev_rows[r : r + c] for r, s, c in host_runs],
        )
        up_pairs = (down_pairs[1], down_pairs[0])
        for k in (2, 4):
            for name, (dsts, srcs), ref_copy in [
                ("D2H", down_pairs, lambda: ref_host.copy_(ref_dev, non_blocking=True)),
                ("H2D", up_pairs, lambda: ref_dev.copy_(ref_host, non_blocking=True)),
            ]:
                ref_t, t = paired_medians(
                    ref_copy,
                    lambda d=dsts, s=srcs, k=k: copies_on_streams(d, s, k),  # type: ignore[misc]
                    args.reps,
                    sync,
                )
                spread.append((f"{name} copies only, {len(host_runs)} runs, {k} streams", t, ref_t))
    # Engine tensors from one allocation per layer: no block-major view, one op per layer.
    separate = DeviceTier.from_layout(
        LayerSeparate(shape, [torch.empty_like(t) for t in g1.layout.layers])  # type: ignore[attr-defined]
    )
    for mine, theirs in zip(separate.layout.layers, g1.layout.layers, strict=True):  # type: ignore[attr-defined]
        mine.copy_(theirs)
    sep_down_ref, sep_down = paired_medians(
        lambda: ref_host.copy_(ref_dev, non_blocking=True),
        lambda: engine.copy(separate, src, g2, dst).wait(),
        args.reps,
        sync,
    )
    sep_up_ref, sep_up = paired_medians(
        lambda: ref_dev.copy_(ref_host, non_blocking=True),
        lambda: engine.copy(g2, dst, separate, src).wait(),
        args.reps,
        sync,
    )
    for label, t, ref in [
        ("G1->G2", down, down_ref),
        ("G2->G1", up, up_ref),
        (f"D2H copies only, {len(host_runs)} runs", runs_down, runs_down_ref),
        ("G1->G2 layers apart", sep_down, sep_down_ref),
        ("G2->G1 layers apart", sep_up, sep_up_ref),
        *spread,
    ]:
        rows.append(
            (
                label,
                f"{gbps(nbytes, t):.1f}",
                f"{gbps(nbytes, ref):.1f}",
                ref_name,
                f"{ref / t:.3f}",
            )
        )
    one = median_seconds(lambda: engine.copy(g2, [dst[0]], g1, [src[0]]).wait(), 50, sync)
    rows.append(("onboard 1 block G2->G1", f"{one * 1e6:.0f} us", "", "", ""))
    args.g1, args.g2, args.engine, args.sync = g1, g2, engine, sync


def direct_io(path: Path, buf: torch.Tensor, chunk: int, *, write: bool) -> None:
    """Sequential O_DIRECT ``pwritev`` (or ``preadv``) of ``buf`` in ``chunk``-byte requests,
    into a preallocated file, as G3's own file is."""
    view = buf.numpy().data.cast("B")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
    try:
        if write:
            os.posix_fallocate(fd, 0, len(view))
        for off in range(0, len(view), chunk):
            part = [view[off : off + chunk]]
            n = os.pwritev(fd, part, off) if write else os.preadv(fd, part, off)
            assert n == len(part[0]), "short reference I/O"
    finally:
        os.close(fd)


def disk_bench(args: argparse.Namespace, shape: BlockShape, rows: list[tuple[str, ...]]) -> None:
    n = args.blocks
    nbytes = n * shape.block_bytes
    rng = random.Random(1)
    folder = Path(tempfile.mkdtemp(prefix="kvledger-bench-", dir=args.g3_dir))
    g3 = DiskTier(folder, shape, 2 * n, io_threads=args.io_threads)
    g1, g2, engine, sync = args.g1, args.g2, args.engine, args.sync
    g2_slots, g3_slots = rng.sample(range(2 * n), n), rng.sample(range(2 * n), n)

    # Reference buffer: page-aligned anonymous memory of the same size, random bytes.
    area = mmap.mmap(-1, nbytes)
    ref = torch.frombuffer(area, dtype=torch.uint8)
    ref.copy_(torch.randint(0, 256, (nbytes,), dtype=torch.uint8))
    nothing = lambda: None  # noqa: E731
    ref_file = folder / "ref.bin"
    w_ref, write = paired_medians(
        lambda: direct_io(ref_file, ref, 16 << 20, write=True),
        lambda: engine.copy(g2, g2_slots, g3, g3_slots).wait(),
        args.reps,
        nothing,
    )
    r_ref, read = paired_medians(
        lambda: direct_io(ref_file, ref, 16 << 20, write=False),
        lambda: engine.copy(g3, g3_slots, g2, g2_slots).wait(),
        args.reps,
        nothing,
    )
    ref_file.unlink()
    assert engine.copy(g3, g3_slots, g2, g2_slots).wait().failed == []
    ref_name = "seq O_DIRECT pwritev/preadv"
    for label, t, r in [("G2->G3", write, w_ref), ("G3->G2", read, r_ref)]:
        rows.append(
            (label, f"{gbps(nbytes, t):.2f}", f"{gbps(nbytes, r):.2f}", ref_name, f"{r / t:.3f}")
        )

    g1_slots = rng.sample(range(2 * n), n)
    off = median_seconds(lambda: engine.copy(g1, g1_slots, g3, g3_slots).wait(), args.reps, sync)
    on = median_seconds(lambda: engine.copy(g3, g3_slots, g1, g1_slots).wait(), args.reps, sync)
    rows.append(("G1->G3", f"{gbps(nbytes, off):.2f}", "", "", f"{w_ref / off:.3f}"))
    rows.append(("G3->G1", f"{gbps(nbytes, on):.2f}", "", "", f"{r_ref / on:.3f}"))
    one = median_seconds(lambda: engine.copy(g3, [g3_slots[0]], g1, [0]).wait(), 50, sync)
    rows.append(("onboard 1 block G3->G1", f"{one * 1e6:.0f} us", "", "", ""))
    rows.append(("G3 I/O path", g3.io.name, "", f"{args.io_threads} threads", ""))
    g3.close()
    shutil.rmtree(folder)  # the slot file, its index and its lock


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=256)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--page", type=int, default=16)
    parser.add_argument("--inner", type=int, default=1024)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--staging-blocks", type=int, default=32)
    parser.add_argument("--io-threads", type=int, default=4)
    parser.add_argument("--g3-dir", default=None, help="folder for the G3 files (default: tmp)")
    parser.add_argument("--skip-g3", action="store_true")
    parser.add_argument("--json", default=None, help="also write the rows here")
    args = parser.parse_args()

    shape = BlockShape(args.layers, 2, args.page, args.inner, torch.bfloat16)
    print(f"machine: {machine()}")
    print(
        f"workload: {args.blocks} blocks of {shape.block_bytes / 2**20:.2f} MiB "
        f"({args.blocks * shape.block_bytes / 2**20:.0f} MiB), G1 LayerSeparate, random slots, "
        f"staging {args.staging_blocks} blocks, median of {args.reps}"
    )
    rows: list[tuple[str, ...]] = []
    memory_bench(args, shape, rows)
    if not args.skip_g3:
        disk_bench(args, shape, rows)
    args.engine.close()

    header = ("route", "engine GB/s", "ref GB/s", "reference", "ratio")
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    for r in [header, *rows]:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)))
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": machine(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
