"""Probe for the next step on G1<->G2: SM-driven copies through pinned host memory mapped into
the GPU's address space (UVA), one indexing kernel for all blocks and random host slots, against
a plain pinned ``copy_`` of the same bytes in the same run.

The copier instead gathers into device staging and issues one DMA copy per run of
consecutive host slots; with random slots that is ~130 copies for 256 blocks, and the copy
engine loses a few microseconds and a few percent of rate on each. Needs CUDA (exits otherwise).

Run: ``python bench/mapped_copy_probe.py``
"""

from __future__ import annotations

import random
import statistics
import sys
from collections.abc import Callable

import torch

BLOCKS, SLOTS, BLOCK_BYTES = 256, 512, 2 << 20


class _MappedHost:
    """A CUDA array interface over pinned host memory: under UVA the GPU reaches it at the
    host address, so torch can wrap it as a CUDA tensor without copying."""

    def __init__(self, t: torch.Tensor) -> None:
        self.__cuda_array_interface__ = {
            "shape": (t.numel() // 8,),
            "typestr": "<i8",
            "data": (t.data_ptr(), False),
            "version": 3,
        }


def gpu_ms(fn: Callable[[], object], reps: int = 7) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main() -> None:
    if not torch.cuda.is_available():
        sys.exit("mapped_copy_probe: needs a CUDA device")
    dev = torch.device("cuda")
    host = torch.empty(SLOTS * BLOCK_BYTES, dtype=torch.uint8, pin_memory=True)
    host.view(torch.int64).random_()
    mapped = torch.as_tensor(_MappedHost(host), device=dev).view(SLOTS, BLOCK_BYTES // 8)
    assert mapped.data_ptr() == host.data_ptr()
    rows = torch.randint(0, 1 << 30, (BLOCKS, BLOCK_BYTES // 8), dtype=torch.int64, device=dev)
    slots = torch.tensor(random.Random(0).sample(range(SLOTS), BLOCKS), device=dev)
    flat_host, flat_dev = host[: BLOCKS * BLOCK_BYTES], rows.view(torch.uint8).view(-1)

    down_ref = gpu_ms(lambda: flat_host.copy_(flat_dev, non_blocking=True))
    up_ref = gpu_ms(lambda: flat_dev.copy_(flat_host, non_blocking=True))
    down = gpu_ms(lambda: mapped.index_copy_(0, slots, rows))
    up = gpu_ms(lambda: torch.index_select(mapped, 0, slots, out=rows))
    mapped.index_copy_(0, slots, rows)
    torch.cuda.synchronize()
    landed = host.view(SLOTS, BLOCK_BYTES)[slots.cpu()].view(torch.int64)
    assert torch.equal(landed, rows.cpu()), "mapped writes did not land"

    nbytes = BLOCKS * BLOCK_BYTES
    print(f"GPU {torch.cuda.get_device_name()}: {BLOCKS} blocks of 2 MiB, random host slots")
    for label, ms, ref in [
        ("D2H index_copy_ into mapped G2", down, down_ref),
        ("H2D index_select from mapped G2", up, up_ref),
    ]:
        print(
            f"{label:32s} {nbytes / ms / 1e6:5.1f} GB/s  pinned copy_ "
            f"{nbytes / ref / 1e6:5.1f} GB/s  ratio {ref / ms:.3f}"
        )


if __name__ == "__main__":
    main()
