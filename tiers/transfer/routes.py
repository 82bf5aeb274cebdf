"""The copy routes of the copier: how a batch of blocks moves between two tiers.

A copy is a list of (source slot, destination slot) pairs. Copying block by block and layer by
layer would issue ``blocks x layers`` small copies (measured: 4 GB/s that way against 48 GB/s
batched), so every route moves whole batches instead:

- device -> host: the blocks are gathered on the device into a block-major staging buffer (one
  ``index_select`` for all layers when they lie at a fixed distance in one storage, else one per
  layer), then copied to the host slots, one copy per run of consecutive destination slots (the
  pairs are sorted by destination so runs form). Host -> device is the reverse (copies in, then
  ``index_copy_`` the same way).
  On CUDA the gather and the copies run on two streams over two staging buffers, so the copy
  copier never waits for the gather of the next chunk.
- memory <-> disk: host slots are written or read in place by the disk tier's I/O threads;
  anything else (device memory, or a layer-separate layout) goes through a host staging tier.

Threads, ordering and results are the copier's (``kvledger.tiers.transfer.copier``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from kvledger.events.types import BlockInfo
from kvledger.tiers.base import MemoryTier, StorageTier
from kvledger.tiers.disk.tier import DiskTier
from kvledger.tiers.host.tier import HostTier
from kvledger.tiers.layout import BlockShape, FullyContiguous, KVLayout

Pairs = list[tuple[int, int]]

DIRECT_PIECES = 128
"""Device<->host copies of at most this many (block, layer) pieces skip staging (see _direct)."""

FIRST_CHUNK_BLOCKS = 4
"""Blocks in the first staged chunk of a device->host copy (see _chunk_bounds)."""

# torch's CUDA Event and Stream constructors carry no annotations; typed aliases keep mypy quiet.
_new_event: Callable[[], torch.cuda.Event] = torch.cuda.Event
_new_stream: Callable[[torch.device], torch.cuda.Stream] = torch.cuda.Stream


class CopyRoutes:
    """The torch side of a copier: which copies move a batch of pairs from one tier to
    another, and the staging buffers and CUDA streams they run on.

    ``staging_blocks`` is the size, in blocks, of each of the two device staging buffers and of
    the host staging buffer used for device <-> disk copies. Not thread-safe: the copier calls
    it from one thread at a time (its worker, or a caller while no transfer is pending).
    """

    def __init__(self, staging_blocks: int) -> None:
        self.staging_blocks = staging_blocks
        self._device_staging: dict[tuple[torch.device, BlockShape], list[torch.Tensor]] = {}
        self._host_staging: dict[BlockShape, HostTier] = {}
        self._streams: dict[torch.device, tuple[torch.cuda.Stream, torch.cuda.Stream]] = {}

    def run(
        self,
        src: StorageTier,
        dst: StorageTier,
        pairs: Pairs,
        blocks: Sequence[BlockInfo] | None,
        ready: torch.cuda.Event | None,
    ) -> Pairs:
        """Copy ``pairs`` and wait until the bytes are there; returns the pairs that read an
        empty or corrupt G3 slot (their destination slot was left alone)."""
        if not pairs:
            return []
        if isinstance(dst, DiskTier):
            assert isinstance(src, MemoryTier)
            self._memory_to_disk(src, dst, pairs, blocks, ready)
            return []
        if isinstance(src, DiskTier):
            assert isinstance(dst, MemoryTier)
            return self._disk_to_memory(src, dst, pairs, ready)
        assert isinstance(src, MemoryTier) and isinstance(dst, MemoryTier)
        settle(self.issue(src, dst, pairs, ready))
        return []

    def issue(
        self, src: MemoryTier, dst: MemoryTier, pairs: Pairs, ready: torch.cuda.Event | None
    ) -> torch.cuda.Event | None:
        """Issue a memory-to-memory copy without waiting for it; returns the CUDA event that
        marks its end (None: already done)."""
        return self._memory_to_memory(src.layout, dst.layout, pairs, ready)

    def drop_staging(self) -> None:
        self._device_staging.clear()
        self._host_staging.clear()

    def _memory_to_memory(
        self, src: KVLayout, dst: KVLayout, pairs: Pairs, ready: torch.cuda.Event | None
    ) -> torch.cuda.Event | None:
        """Issue the copy; returns the CUDA event that marks its end (None: already done)."""
        crossing = src.device.type != dst.device.type
        if crossing and len(pairs) * src.shape.num_layers <= DIRECT_PIECES:
            return self._direct(src, dst, pairs, ready)
        if src.device.type == "cuda" and dst.device.type == "cpu":
            return self._device_to_host(src, _host_layout(dst), pairs, ready)
        if src.device.type == "cpu" and dst.device.type == "cuda":
            return self._host_to_device(_host_layout(src), dst, pairs, ready)
        if src.device == dst.device:
            return self._same_device(src, dst, pairs, ready)
        else:
            raise ValueError(f"no copy route from {src.device} to {dst.device}")

    def _same_device(
        self, src: KVLayout, dst: KVLayout, pairs: Pairs, ready: torch.cuda.Event | None
    ) -> torch.cuda.Event | None:
        """Gather into staging, scatter out of it; a side that is one run of a FullyContiguous
        layout is used in place, so copies into or out of a staging tier take one pass."""
        dev = src.device
        staging = self._staging(dev, src.shape)[0]
        if dev.type != "cuda":
            self._gather_scatter(src, dst, pairs, staging)
            return None
        stream = self._stream_pair(dev)[0]
        with torch.cuda.device(dev), torch.cuda.stream(stream):
            _wait(stream, ready)
            self._gather_scatter(src, dst, pairs, staging)
            return _record(stream)

    def _gather_scatter(
        self, src: KVLayout, dst: KVLayout, pairs: Pairs, staging: torch.Tensor
    ) -> None:
        for chunk in _chunks(pairs, self.staging_blocks):
            s_slots = [s for s, _ in chunk]
            d_slots = [d for _, d in chunk]
            s_run = _single_run(src, s_slots)
            d_run = _single_run(dst, d_slots)
            if d_run is not None:
                _gather(src, _index(s_slots, src.device), d_run)
            elif s_run is not None:
                _scatter(s_run, dst, _index(d_slots, dst.device))
            else:
                rows = staging[: len(chunk)]
                _gather(src, _index(s_slots, src.device), rows)
                _scatter(rows, dst, _index(d_slots, dst.device))

    def _direct(
        self, src: KVLayout, dst: KVLayout, pairs: Pairs, ready: torch.cuda.Event | None
    ) -> torch.cuda.Event:
        """A few blocks: copy each layer of each block straight across, with no staging and no
        index kernels, which is what single-block onboard latency is made of."""
        dev = src.device if src.device.type == "cuda" else dst.device
        copy_stream = self._stream_pair(dev)[1]
        with torch.cuda.device(dev), torch.cuda.stream(copy_stream):
            _wait(copy_stream, ready)
            dst_views = [v for _, d in pairs for v in _layer_views(dst, d)]
            src_views = [v for s, _ in pairs for v in _layer_views(src, s)]
            _copy_all(dst_views, src_views)
            return _record(copy_stream)

    def _device_to_host(
        self, src: KVLayout, dst: FullyContiguous, pairs: Pairs, ready: torch.cuda.Event | None
    ) -> torch.cuda.Event:
        dev = src.device
        gather_stream, copy_stream = self._stream_pair(dev)
        buffers = self._staging(dev, src.shape)
        gathered = [_new_event(), _new_event()]
        free = [_new_event(), _new_event()]
        pairs = sorted(pairs, key=lambda p: p[1])  # consecutive destination slots -> one copy
        # A small first chunk gets the copy engine going sooner; only worth it when a chunk's
        # gather is one op (per-layer gathers cost ~22 us of issuing per layer per chunk).
        one_op = src.block_major() is not None
        first = FIRST_CHUNK_BLOCKS if one_op else self.staging_blocks
        with torch.cuda.device(dev):
            _wait(gather_stream, ready)
            with torch.cuda.stream(gather_stream):
                all_s = _index([s for s, _ in pairs], dev)
            for n, (start, end) in enumerate(_chunk_bounds(len(pairs), self.staging_blocks, first)):
                chunk = pairs[start:end]
                rows = buffers[n % 2][: len(chunk)]
                gather_stream.wait_event(free[n % 2])
                with torch.cuda.stream(gather_stream):
                    _gather(src, all_s[start : start + len(chunk)], rows)
                    gathered[n % 2].record(gather_stream)
                copy_stream.wait_event(gathered[n % 2])
                with torch.cuda.stream(copy_stream):
                    runs = slot_runs([d for _, d in chunk])
                    _copy_all(
                        [dst.tensor[slot : slot + count] for _, slot, count in runs],
                        [rows[row : row + count] for row, _, count in runs],
                    )
                    free[n % 2].record(copy_stream)
            return _record(copy_stream)

    def _host_to_device(
        self, src: FullyContiguous, dst: KVLayout, pairs: Pairs, ready: torch.cuda.Event | None
    ) -> torch.cuda.Event:
        dev = dst.device
        scatter_stream, copy_stream = self._stream_pair(dev)
        buffers = self._staging(dev, dst.shape)
        landed = [_new_event(), _new_event()]
        free = [_new_event(), _new_event()]
        pairs = sorted(pairs)  # consecutive source slots -> one copy
        with torch.cuda.device(dev):
            _wait(copy_stream, ready)
            _wait(scatter_stream, ready)
            with torch.cuda.stream(scatter_stream):
                all_d = _index([d for _, d in pairs], dev)
            for n, start in enumerate(range(0, len(pairs), self.staging_blocks)):
                chunk = pairs[start : start + self.staging_blocks]
                rows = buffers[n % 2][: len(chunk)]
                copy_stream.wait_event(free[n % 2])
                with torch.cuda.stream(copy_stream):
                    runs = slot_runs([s for s, _ in chunk])
                    _copy_all(
                        [rows[row : row + count] for row, _, count in runs],
                        [src.tensor[slot : slot + count] for _, slot, count in runs],
                    )
                    landed[n % 2].record(copy_stream)
                scatter_stream.wait_event(landed[n % 2])
                with torch.cuda.stream(scatter_stream):
                    _scatter(rows, dst, all_d[start : start + len(chunk)])
                    free[n % 2].record(scatter_stream)
            return _record(scatter_stream)

    def _memory_to_disk(
        self,
        src: MemoryTier,
        dst: DiskTier,
        pairs: Pairs,
        blocks: Sequence[BlockInfo] | None,
        ready: torch.cuda.Event | None,
    ) -> None:
        """The disk tier records each block's name beside its bytes, when ``blocks`` names
        them, so a restarted worker can tell what its G3 slots hold."""
        if _is_host_contiguous(src.layout):
            assert isinstance(src.layout, FullyContiguous)
            rows = src.layout.block_bytes_view().numpy()
            dst.write_slots([d for _, d in pairs], [rows[s] for s, _ in pairs], blocks)
            return
        staging = self._host_staging_tier(src.shape)
        rows = staging.layout.block_bytes_view().numpy()
        step = self.staging_blocks
        for start in range(0, len(pairs), step):
            chunk = pairs[start : start + step]
            into_staging = [(s, i) for i, (s, _) in enumerate(chunk)]
            settle(self._memory_to_memory(src.layout, staging.layout, into_staging, ready))
            ready = None
            named = None if blocks is None else blocks[start : start + step]
            dst.write_slots([d for _, d in chunk], [rows[i] for i in range(len(chunk))], named)

    def _disk_to_memory(
        self, src: DiskTier, dst: MemoryTier, pairs: Pairs, ready: torch.cuda.Event | None
    ) -> Pairs:
        if _is_host_contiguous(dst.layout):
            assert isinstance(dst.layout, FullyContiguous)
            rows = dst.layout.block_bytes_view().numpy()
            ok = src.read_slots([s for s, _ in pairs], [rows[d] for _, d in pairs])
            return [p for p, good in zip(pairs, ok, strict=True) if not good]
        staging = self._host_staging_tier(src.shape)
        rows = staging.layout.block_bytes_view().numpy()
        failed: Pairs = []
        for chunk in _chunks(pairs, self.staging_blocks):
            ok = src.read_slots([s for s, _ in chunk], [rows[i] for i in range(len(chunk))])
            good = [(i, d) for i, ((_, d), fine) in enumerate(zip(chunk, ok, strict=True)) if fine]
            failed += [p for p, fine in zip(chunk, ok, strict=True) if not fine]
            if good:  # corrupt slots never reach the destination
                settle(self._memory_to_memory(staging.layout, dst.layout, good, ready))
                ready = None
        return failed

    # -- buffers and streams ------------------------------------------------------------------

    def _staging(self, dev: torch.device, shape: BlockShape) -> list[torch.Tensor]:
        """Two block-major ``[staging_blocks, layers, outer, page, inner]`` buffers on ``dev``.

        Kept for the copier's life, so the allocator never hands them to other streams.
        """
        key = (dev, shape)
        if key not in self._device_staging:
            dims = (self.staging_blocks, shape.num_layers, *shape.layer_shape)
            count = 2 if dev.type == "cuda" else 1
            self._device_staging[key] = [
                torch.empty(dims, dtype=shape.dtype, device=dev) for _ in range(count)
            ]
        return self._device_staging[key]

    def _host_staging_tier(self, shape: BlockShape) -> HostTier:
        if shape not in self._host_staging:
            self._host_staging[shape] = HostTier(shape, self.staging_blocks)
        return self._host_staging[shape]

    def _stream_pair(self, dev: torch.device) -> tuple[torch.cuda.Stream, torch.cuda.Stream]:
        if dev not in self._streams:
            self._streams[dev] = (_new_stream(dev), _new_stream(dev))
        return self._streams[dev]


def record_ready(src: StorageTier, dst: StorageTier) -> torch.cuda.Event | None:
    """An event on the caller's current CUDA stream: the copy starts after work queued so far
    (the kernels that wrote the blocks, or the last reads of the slots being overwritten)."""
    for tier in (src, dst):
        if isinstance(tier, MemoryTier) and tier.device.type == "cuda":
            event = _new_event()
            event.record(torch.cuda.current_stream(tier.device))
            return event
    return None


def issues_on_caller(src: StorageTier, dst: StorageTier) -> bool:
    """Whether a copy between these tiers is memory to memory with a GPU side, so that issuing
    it costs the caller only the issuing (the bytes move asynchronously)."""
    if not (isinstance(src, MemoryTier) and isinstance(dst, MemoryTier)):
        return False
    return "cuda" in (src.device.type, dst.device.type)


def _record(stream: torch.cuda.Stream) -> torch.cuda.Event:
    event = _new_event()
    event.record(stream)
    return event


def settle(event: torch.cuda.Event | None) -> None:
    if event is not None:
        event.synchronize()


def _copy_all(dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
    """``dst[i].copy_(src[i])`` for all i in one call: the loop runs in C++, so issuing many
    host<->device copies costs microseconds each instead of a Python call each."""
    torch._foreach_copy_(dst, src, non_blocking=True)


def _layer_views(layout: KVLayout, slot: int) -> list[torch.Tensor]:
    if isinstance(layout, FullyContiguous):
        return list(layout.tensor[slot].unbind(0))
    return [layout.layer(i)[slot] for i in range(layout.shape.num_layers)]


def _wait(stream: torch.cuda.Stream, event: torch.cuda.Event | None) -> None:
    if event is not None:
        stream.wait_event(event)


def _single_run(layout: KVLayout, slots: list[int]) -> torch.Tensor | None:
    """The ``[n, layers, ...]`` rows of ``slots`` when they are consecutive in a
    FullyContiguous layout, else None."""
    if not isinstance(layout, FullyContiguous) or len(slot_runs(slots)) != 1:
        return None
    return layout.tensor[slots[0] : slots[0] + len(slots)]


def _host_layout(layout: KVLayout) -> FullyContiguous:
    if not isinstance(layout, FullyContiguous):
        raise ValueError("a host side of a device copy must be a FullyContiguous layout")
    return layout


def _is_host_contiguous(layout: KVLayout) -> bool:
    return isinstance(layout, FullyContiguous) and layout.device.type == "cpu"


def _index(values: list[int], dev: torch.device) -> torch.Tensor:
    idx = torch.tensor(values, dtype=torch.int64)
    if dev.type == "cuda":
        return idx.pin_memory().to(dev, non_blocking=True)
    return idx


def _gather(src: KVLayout, idx: torch.Tensor, rows: torch.Tensor) -> None:
    """``rows[i] = block idx[i]`` of ``src`` (block-major rows): one ``index_select`` over all
    layers when the layout has a block-major view, else one per layer (arbitrary engine tensors,
    where each op costs tens of microseconds to issue on a GPU)."""
    whole = src.block_major()
    if whole is not None:
        source, out = _words(whole, rows)
        torch.index_select(source, 0, idx, out=out)
        return
    for layer in range(src.shape.num_layers):
        source, out = _words(src.layer(layer), rows[:, layer])
        torch.index_select(source, 0, idx, out=out)


def _scatter(rows: torch.Tensor, dst: KVLayout, idx: torch.Tensor) -> None:
    """Block ``idx[i]`` of ``dst`` = ``rows[i]``, with as few ops as ``_gather``."""
    whole = dst.block_major()
    if whole is not None:
        target, source = _words(whole, rows)
        target.index_copy_(0, idx, source)
        return
    for layer in range(dst.shape.num_layers):
        target, source = _words(dst.layer(layer), rows[:, layer])
        target.index_copy_(0, idx, source)


def _words(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``a`` and ``b`` (``[..., outer, page, inner]``) with each block's layer as one row of the
    widest integer that both one's sizes, strides and offsets allow: the indexing kernels do
    their address arithmetic per element, so 8-byte elements cost a quarter of bf16 ones."""
    flat = (a.flatten(-3), b.flatten(-3))
    size = a.element_size()
    spans = [t.shape[-1] * size for t in flat] + [t.storage_offset() * size for t in flat]
    spans += [stride * size for t in flat for stride in t.stride()[:-1]]
    word = next(
        (
            w
            for w in (torch.int64, torch.int32, torch.int16)
            if all(s % w.itemsize == 0 for s in spans)
        ),
        torch.uint8,
    )
    return flat[0].view(word), flat[1].view(word)


def slot_runs(slots: list[int]) -> list[tuple[int, int, int]]:
    """``(first row, first slot, count)`` for each run of consecutive slots, rows in order."""
    runs: list[tuple[int, int, int]] = []
    for row, slot in enumerate(slots):
        if runs and runs[-1][1] + runs[-1][2] == slot:
            first_row, first_slot, count = runs[-1]
            runs[-1] = (first_row, first_slot, count + 1)
        else:
            runs.append((row, slot, 1))
    return runs


def _chunk_bounds(total: int, size: int, first: int) -> list[tuple[int, int]]:
    """``(start, end)`` of the staged chunks of a device->host copy: ``first`` blocks, doubling
    up to ``size``, so the copy engine starts after a small gather instead of a whole staging
    buffer's, and later gathers still finish well before the copies they feed."""
    bounds: list[tuple[int, int]] = []
    start, step = 0, min(first, size)
    while start < total:
        bounds.append((start, min(start + step, total)))
        start, step = start + step, min(2 * step, size)
    return bounds


def _chunks(pairs: Pairs, size: int) -> list[Pairs]:
    return [pairs[i : i + size] for i in range(0, len(pairs), size)]
