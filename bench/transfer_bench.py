"""Copier throughput against plain copies of the same bytes, measured in the same run.

Default workload (issue 4): 256 blocks of 2 MiB (32 layers x 2 x 16 tokens x 1024 x bf16),
G1 LayerSeparate, random source and destination slots.

- G1->G2 and G2->G1 against one plain copy of the same byte count between a device buffer and
  G2's own memory: pinned ``copy_`` on a GPU, a contiguous tensor ``copy_`` (memcpy) on CPU.
- G2->G3 and G3->G2 (checksums on) against sequential ``os.pwritev``/``os.preadv`` with O_DIRECT
  of the same bytes into a separate preallocated file, in 16 MiB requests.
- The ceiling once gathering costs nothing: the copier's own device->host copies (one per run
  of consecutive G2 slots) from a contiguous device buffer, against the same plain copy.
- On CUDA, the same copies dealt to 2 and 4 streams: whether overlapping copy engines close the
  gaps between one stream's copies.
- G1<->G2 again with the layers in separate allocations (engine tensors with no block-major
  view: gathered and scattered one layer at a time), with a fully contiguous G1, and for 4
  blocks (the direct route: small copies skip staging).
- Engine and reference runs alternate, and each figure is the median of ``--reps`` runs; the
  JSON (``--json``) also keeps every repetition's ratio (reference / copier, same repetition).
- Single-block onboard latency G2->G1 and G3->G1 (submit to ``wait()`` returning).
- G3 through the I/O path ``--g3-backend`` picks (``auto``: kvikio where it imports); with
  kvikio, whether it runs GPUDirect Storage or its compatibility mode, and on CUDA kvikio reading
  and writing device memory straight (no host staging) against the same O_DIRECT reference.

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
from typing import Any

import torch

from kvledger.tiers import (
    BlockShape,
    Copier,
    DeviceTier,
    DiskTier,
    HostTier,
    LayerSeparate,
)
from kvledger.tiers.transfer.routes import DIRECT_PIECES, slot_runs


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


class Paired:
    """Seconds of ``a`` (the reference) and ``b`` (the copier), timed alternately, so drift of
    the machine (a shared disk, clocks) falls on both alike."""

    def __init__(self, ref: list[float], copier: list[float]) -> None:
        self.ref, self.copier = ref, copier

    @property
    def ref_s(self) -> float:
        return statistics.median(self.ref)

    @property
    def engine_s(self) -> float:
        return statistics.median(self.copier)

    def ratios(self) -> list[float]:
        """Reference time / copier time of each repetition."""
        return [round(r / e, 4) for r, e in zip(self.ref, self.copier, strict=True)]


def paired(
    a: Callable[[], object], b: Callable[[], object], reps: int, sync: Callable[[], object]
) -> Paired:
    ta: list[float] = []
    tb: list[float] = []
    for _ in range(reps):
        ta.append(median_seconds(a, 1, sync))
        tb.append(median_seconds(b, 1, sync))
    return Paired(ta, tb)


def ratio_row(
    label: str, nbytes: int, p: Paired, reference: str, digits: int = 1
) -> dict[str, Any]:
    """A measured row: GB/s of both sides (medians), their ratio, and every repetition's."""
    return {
        "route": label,
        "engine_gbps": round(gbps(nbytes, p.engine_s), 3),
        "ref_gbps": round(gbps(nbytes, p.ref_s), 3),
        "reference": reference,
        "ratio": round(p.ref_s / p.engine_s, 4),
        "ratios": p.ratios(),
        "digits": digits,
    }


_streams: list[torch.cuda.Stream] = []


def copies_on_streams(dsts: list[torch.Tensor], srcs: list[torch.Tensor], k: int) -> None:
    """``dst.copy_(src)`` for each pair, the pairs dealt round-robin to ``k`` CUDA streams that
    start after, and are waited for by, the current stream (``k`` = 1: on the current stream)."""
    if k == 1:
        torch._foreach_copy_(dsts, srcs, non_blocking=True)
        return
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


def setup_tiers(args: argparse.Namespace, shape: BlockShape) -> None:
    """G1 (random bytes), G2 and the copier every part of the bench copies between."""
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    n = args.blocks
    gen = torch.Generator(device=dev).manual_seed(0)
    g1 = DeviceTier(shape, 2 * n, device=dev)
    for layer in g1.layout.layers:  # type: ignore[attr-defined]
        fill_random(layer, gen)
    args.dev, args.gen = dev, gen
    args.g1, args.g2 = g1, HostTier(shape, 2 * n)
    args.copier = Copier(staging_blocks=args.staging_blocks)
    args.sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)


def memory_bench(args: argparse.Namespace, shape: BlockShape, rows: list[dict[str, Any]]) -> None:
    dev, gen, g1, g2, copier, sync = args.dev, args.gen, args.g1, args.g2, args.copier, args.sync
    cuda = dev.type == "cuda"
    n = args.blocks
    nbytes = n * shape.block_bytes
    rng = random.Random(0)
    src, dst = rng.sample(range(2 * n), n), rng.sample(range(2 * n), n)

    # Reference: one plain copy of the same byte count into and out of G2's own memory (pinned
    # buffers of the same size were seen to copy at 32 to 55 GB/s on one machine, so a separate
    # buffer would measure the buffer, not the copier).
    ref_dev = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    ref_host = g2.layout.block_bytes_view()[:n].reshape(-1)
    fill_random(ref_dev, gen)
    ref_name = "pinned copy_" if cuda else "memcpy (copy_)"

    def down_ref() -> object:
        return ref_host.copy_(ref_dev, non_blocking=True)

    def up_ref() -> object:
        return ref_dev.copy_(ref_host, non_blocking=True)

    def both_ways(label: str, tier: DeviceTier, s: list[int], d: list[int]) -> None:
        size = len(s) * shape.block_bytes
        down_r = ref_host[:size] if size < nbytes else ref_host
        up_r = ref_dev[:size] if size < nbytes else ref_dev
        down = paired(
            lambda: down_r.copy_(up_r, non_blocking=True),
            lambda: copier.copy(tier, s, g2, d).wait(),
            args.reps,
            sync,
        )
        up = paired(
            lambda: up_r.copy_(down_r, non_blocking=True),
            lambda: copier.copy(g2, d, tier, s).wait(),
            args.reps,
            sync,
        )
        rows.append(ratio_row(f"G1->G2{label}", size, down, ref_name))
        rows.append(ratio_row(f"G2->G1{label}", size, up, ref_name))

    both_ways("", g1, src, dst)
    # The ceiling left once gathering is free: the same host<->device copies the copier issues,
    # one per run of consecutive host slots, straight from/to a contiguous device buffer; on
    # CUDA also dealt to 2 and 4 streams: whether the gaps between one stream's DMA copies (what
    # keeps the copier under the plain copy) close when copy engines overlap.
    host_runs = slot_runs(sorted(dst))  # the runs the copier copies
    dev_rows = ref_dev.view(n, shape.block_bytes)
    host_rows = g2.layout.block_bytes_view()
    down_pairs = (
        [host_rows[s : s + c] for r, s, c in host_runs],
        [dev_rows[r : r + c] for r, s, c in host_runs],
    )
    up_pairs = (down_pairs[1], down_pairs[0])
    for k in (1, 2, 4) if cuda else (1,):
        for name, (dsts, srcs), ref_copy in [
            ("D2H", down_pairs, down_ref),
            ("H2D", up_pairs, up_ref),
        ]:
            p = paired(
                ref_copy,
                lambda d=dsts, s=srcs, k=k: copies_on_streams(d, s, k),  # type: ignore[misc]
                args.reps,
                sync,
            )
            streams = f", {k} streams" if k > 1 else ", 1 stream" if cuda else ""
            label = f"{name} copies only, {len(host_runs)} runs{streams}"
            rows.append(ratio_row(label, nbytes, p, ref_name))
    # Engine tensors from one allocation per layer: no block-major view, one op per layer.
    separate = DeviceTier.from_layout(
        LayerSeparate(shape, [torch.empty_like(t) for t in g1.layout.layers])  # type: ignore[attr-defined]
    )
    for mine, theirs in zip(separate.layout.layers, g1.layout.layers, strict=True):  # type: ignore[attr-defined]
        mine.copy_(theirs)
    both_ways(" layers apart", separate, src, dst)
    del separate
    # A fully contiguous G1 (each block one run of bytes, as the host tiers are).
    contiguous = DeviceTier(shape, 2 * n, layout="fully_contiguous", device=dev)
    fill_random(contiguous.layout.tensor, gen)  # type: ignore[attr-defined]
    both_ways(" fully contiguous", contiguous, src, dst)
    del contiguous
    # A few blocks: the direct route (pieces copied one by one, no staging).
    few = max(1, min(n, DIRECT_PIECES // shape.num_layers))
    both_ways(f" {few} blocks (direct)", g1, src[:few], dst[:few])
    one = median_seconds(lambda: copier.copy(g2, [dst[0]], g1, [src[0]]).wait(), 50, sync)
    rows.append({"route": "onboard 1 block G2->G1", "us": round(one * 1e6)})


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


def kvikio_mode() -> dict[str, Any]:
    """Which path kvikio takes here: GPUDirect Storage, or its compatibility mode (POSIX reads
    and writes through a host bounce buffer) and why."""
    import kvikio
    import kvikio.cufile_driver
    import kvikio.defaults

    mode: dict[str, Any] = {"kvikio": kvikio.__version__}
    for key, fn in [
        ("compat_mode_setting", lambda: getattr(kvikio.defaults.get("compat_mode"), "name", "?")),
        ("compat_mode_preferred", kvikio.defaults.is_compat_mode_preferred),
        ("gds_available", lambda: kvikio.cufile_driver.get("is_gds_available")),
        ("libcufile", kvikio.cufile_driver.libcufile_version),
    ]:
        try:
            mode[key] = fn()
        except Exception as exc:  # no cuFile library or driver: that is the answer
            mode[key] = f"{type(exc).__name__}: {exc}"
    gds = mode["gds_available"] is True and mode["compat_mode_preferred"] is False
    mode["path"] = "GDS" if gds else "compat"
    return mode


def kvikio_device_io(path: Path, buf: torch.Tensor, chunk: int, *, write: bool) -> None:
    """kvikio ``CuFile`` reads or writes of a device buffer in ``chunk``-byte requests: GDS
    moves them between the disk and GPU memory, compatibility mode bounces them through host
    memory."""
    import kvikio

    with kvikio.CuFile(path, "r+" if path.exists() else "w+") as f:
        futures = [
            (f.pwrite if write else f.pread)(
                buf[off : off + chunk], min(chunk, buf.numel() - off), off
            )
            for off in range(0, buf.numel(), chunk)
        ]
        for off, fut in zip(range(0, buf.numel(), chunk), futures, strict=True):
            assert fut.get() == min(chunk, buf.numel() - off), "short kvikio I/O"


def disk_bench(args: argparse.Namespace, shape: BlockShape, rows: list[dict[str, Any]]) -> None:
    n = args.blocks
    nbytes = n * shape.block_bytes
    rng = random.Random(1)
    folder = Path(tempfile.mkdtemp(prefix="kvledger-bench-", dir=args.g3_dir))
    g3 = DiskTier(folder, shape, 2 * n, io_threads=args.io_threads, backend=args.g3_backend)
    g1, g2, copier, sync = args.g1, args.g2, args.copier, args.sync
    g2_slots, g3_slots = rng.sample(range(2 * n), n), rng.sample(range(2 * n), n)
    if g3.io.name == "kvikio":
        args.kvikio = kvikio_mode()
        rows.append({"route": "kvikio path", "value": args.kvikio["path"], "detail": args.kvikio})

    # Reference buffer: page-aligned anonymous memory of the same size, random bytes.
    area = mmap.mmap(-1, nbytes)
    ref = torch.frombuffer(area, dtype=torch.uint8)
    ref.copy_(torch.randint(0, 256, (nbytes,), dtype=torch.uint8))
    nothing = lambda: None  # noqa: E731
    ref_file = folder / "ref.bin"
    write = paired(
        lambda: direct_io(ref_file, ref, 16 << 20, write=True),
        lambda: copier.copy(g2, g2_slots, g3, g3_slots).wait(),
        args.reps,
        nothing,
    )
    read = paired(
        lambda: direct_io(ref_file, ref, 16 << 20, write=False),
        lambda: copier.copy(g3, g3_slots, g2, g2_slots).wait(),
        args.reps,
        nothing,
    )
    assert copier.copy(g3, g3_slots, g2, g2_slots).wait().failed == []
    ref_name = "seq O_DIRECT pwritev/preadv"
    rows.append(ratio_row("G2->G3", nbytes, write, ref_name, 2))
    rows.append(ratio_row("G3->G2", nbytes, read, ref_name, 2))

    # G1 <-> G3 through the copier (staged through host memory), alternating with the same
    # O_DIRECT reference
    g1_slots = rng.sample(range(2 * n), n)
    off = paired(
        lambda: direct_io(ref_file, ref, 16 << 20, write=True),
        lambda: copier.copy(g1, g1_slots, g3, g3_slots).wait(),
        args.reps,
        sync,
    )
    on = paired(
        lambda: direct_io(ref_file, ref, 16 << 20, write=False),
        lambda: copier.copy(g3, g3_slots, g1, g1_slots).wait(),
        args.reps,
        sync,
    )
    rows.append(ratio_row("G1->G3", nbytes, off, ref_name, 2))
    rows.append(ratio_row("G3->G1", nbytes, on, ref_name, 2))
    one = median_seconds(lambda: copier.copy(g3, [g3_slots[0]], g1, [0]).wait(), 50, sync)
    rows.append({"route": "onboard 1 block G3->G1", "us": round(one * 1e6)})
    if g3.io.name == "kvikio" and args.dev.type == "cuda":
        # kvikio with device memory, no staging: what a direct G1 <-> G3 route would give
        dev_buf = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        dev_buf.copy_(ref)
        dev_file = folder / "kvikio-device.bin"
        kv_write = paired(
            lambda: direct_io(ref_file, ref, 16 << 20, write=True),
            lambda: kvikio_device_io(dev_file, dev_buf, 16 << 20, write=True),
            args.reps,
            sync,
        )
        kv_read = paired(
            lambda: direct_io(ref_file, ref, 16 << 20, write=False),
            lambda: kvikio_device_io(dev_file, dev_buf, 16 << 20, write=False),
            args.reps,
            sync,
        )
        path = args.kvikio["path"]
        rows.append(ratio_row(f"device->file kvikio {path}", nbytes, kv_write, ref_name, 2))
        rows.append(ratio_row(f"file->device kvikio {path}", nbytes, kv_read, ref_name, 2))
    ref_file.unlink()
    rows.append(
        {"route": "G3 I/O path", "value": g3.io.name, "detail": f"{args.io_threads} threads"}
    )
    g3.close()
    shutil.rmtree(folder)  # the slot file, its index and its lock


def table_row(row: dict[str, Any]) -> tuple[str, ...]:
    if "ratio" in row:
        d = row["digits"]
        return (
            row["route"],
            f"{row['engine_gbps']:.{d}f}",
            f"{row['ref_gbps']:.{d}f}",
            row["reference"],
            f"{row['ratio']:.3f}",
        )
    if "us" in row:
        return (row["route"], f"{row['us']} us", "", "", "")
    return (row["route"], str(row["value"]), "", str(row.get("detail", ""))[:60], "")


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
    parser.add_argument(
        "--g3-backend",
        choices=("auto", "posix", "kvikio"),
        default="auto",
        help="G3's I/O path (auto: kvikio where it imports, else O_DIRECT pwritev/preadv)",
    )
    parser.add_argument("--skip-g3", action="store_true")
    parser.add_argument("--skip-memory", action="store_true", help="only the G3 rows")
    parser.add_argument("--json", default=None, help="also write the rows here")
    args = parser.parse_args()

    shape = BlockShape(args.layers, 2, args.page, args.inner, torch.bfloat16)
    print(f"machine: {machine()}")
    print(
        f"workload: {args.blocks} blocks of {shape.block_bytes / 2**20:.2f} MiB "
        f"({args.blocks * shape.block_bytes / 2**20:.0f} MiB), G1 LayerSeparate, random slots, "
        f"staging {args.staging_blocks} blocks, median of {args.reps}"
    )
    rows: list[dict[str, Any]] = []
    setup_tiers(args, shape)
    if not args.skip_memory:
        memory_bench(args, shape, rows)
    if not args.skip_g3:
        disk_bench(args, shape, rows)
    args.copier.close()

    header = ("route", "copier GB/s", "ref GB/s", "reference", "ratio")
    cells = [header, *map(table_row, rows)]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    for r in cells:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)))
    if args.json:
        for row in rows:
            row.pop("digits", None)
        report = {"machine": machine(), "reps": args.reps, "rows": rows}
        Path(args.json).write_text(json.dumps(report, indent=1, default=str))


if __name__ == "__main__":
    main()
