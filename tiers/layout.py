"""How the KV bytes of a block are arranged in memory.

A block holds ``page_size`` tokens of every layer: per layer an ``outer_dim`` of 2 (K and V) or 1
(MLA-style fused KV) times ``page_size`` times ``inner_dim`` elements. Engines hand their G1 cache
over one tensor per layer (``LayerSeparate``), while the host and disk tiers want a block to be one
run of bytes (``FullyContiguous``) so that it moves with a single copy or a single file write. The
transfer engine converts between the two; this module only describes and validates them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

PAGE_ALIGNMENT = 4096
"""Host buffers start on a page so the disk tier can hand them to O_DIRECT reads and writes."""


@dataclass(frozen=True, slots=True)
class BlockShape:
    """The shape and element type of one block, which every tier of a worker shares."""

    num_layers: int
    outer_dim: int
    page_size: int
    inner_dim: int
    dtype: torch.dtype

    def __post_init__(self) -> None:
        for name in ("num_layers", "page_size", "inner_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"BlockShape.{name} must be a positive integer, got {value!r}")
        if self.outer_dim not in (1, 2):
            raise ValueError(
                f"BlockShape.outer_dim must be 1 (fused KV) or 2 (K and V), got {self.outer_dim!r}"
            )
        if not isinstance(self.dtype, torch.dtype):
            raise ValueError(f"BlockShape.dtype must be a torch.dtype, got {self.dtype!r}")

    @property
    def layer_shape(self) -> tuple[int, int, int]:
        """One block of one layer: (outer, page, inner)."""
        return (self.outer_dim, self.page_size, self.inner_dim)

    @property
    def layer_bytes(self) -> int:
        return math.prod(self.layer_shape) * self.dtype.itemsize

    @property
    def block_bytes(self) -> int:
        return self.num_layers * self.layer_bytes


class KVLayout:
    """Tensors that hold ``num_blocks`` blocks of one ``BlockShape``.

    Subclasses differ only in where a block's layers sit. Everything the transfer engine needs
    is ``layer(i)``: a ``[num_blocks, outer, page, inner]`` view of layer ``i`` (a plain tensor for
    LayerSeparate, a strided view for FullyContiguous).
    """

    shape: BlockShape
    num_blocks: int

    def layer(self, index: int) -> torch.Tensor:
        raise NotImplementedError

    def block_major(self) -> torch.Tensor | None:
        """Every block as one ``[blocks, layers, outer, page, inner]`` tensor (a strided view when
        the layers lie apart), or None. With it a batch of blocks moves with one indexing op
        instead of one per layer, which is what keeps the copy engine fed."""
        return None

    def block(self, slot: int) -> list[torch.Tensor]:
        """Views of one block, one ``[outer, page, inner]`` tensor per layer."""
        self.check_slot(slot)
        return [self.layer(i)[slot] for i in range(self.shape.num_layers)]

    @property
    def device(self) -> torch.device:
        return self.layer(0).device

    @property
    def total_bytes(self) -> int:
        return self.num_blocks * self.shape.block_bytes

    def check_slot(self, slot: int) -> None:
        if not 0 <= slot < self.num_blocks:
            raise IndexError(f"slot {slot} is outside this layout's {self.num_blocks} blocks")


class FullyContiguous(KVLayout):
    """One tensor ``[blocks, layers, outer, page, inner]``: each block is one run of bytes."""

    def __init__(self, shape: BlockShape, tensor: torch.Tensor) -> None:
        expected = (shape.num_layers, *shape.layer_shape)
        if tensor.dim() != 5 or tuple(tensor.shape[1:]) != expected:
            raise ValueError(
                f"FullyContiguous needs a [blocks, {', '.join(map(str, expected))}] tensor, "
                f"got shape {tuple(tensor.shape)}"
            )
        _check_tensor(tensor, shape, "FullyContiguous tensor")
        self.shape = shape
        self.tensor = tensor
        self.num_blocks = int(tensor.shape[0])

    @classmethod
    def allocate(
        cls,
        shape: BlockShape,
        num_blocks: int,
        device: torch.device | str = "cpu",
        *,
        pin_memory: bool = False,
    ) -> FullyContiguous:
        """Fresh storage; host storage starts on a page boundary (see ``PAGE_ALIGNMENT``)."""
        _check_count(num_blocks)
        dims = (num_blocks, shape.num_layers, *shape.layer_shape)
        device = torch.device(device)
        if device.type != "cpu":
            return cls(shape, torch.empty(dims, dtype=shape.dtype, device=device))
        nbytes = num_blocks * shape.block_bytes
        raw = torch.empty(nbytes + PAGE_ALIGNMENT, dtype=torch.uint8, pin_memory=pin_memory)
        start = -raw.data_ptr() % PAGE_ALIGNMENT
        aligned = raw[start : start + nbytes].view(shape.dtype).view(dims)
        return cls(shape, aligned)

    def layer(self, index: int) -> torch.Tensor:
        return self.tensor[:, index]

    def block_major(self) -> torch.Tensor:
        return self.tensor

    def block_bytes_view(self) -> torch.Tensor:
        """The storage as ``[blocks, block_bytes]`` uint8: what file I/O reads and writes."""
        return self.tensor.view(torch.uint8).view(self.num_blocks, self.shape.block_bytes)


class LayerSeparate(KVLayout):
    """One ``[blocks, outer, page, inner]`` tensor per layer, as inference engines hold them."""

    def __init__(self, shape: BlockShape, layers: Sequence[torch.Tensor]) -> None:
        if len(layers) != shape.num_layers:
            raise ValueError(
                f"LayerSeparate needs {shape.num_layers} layer tensors, got {len(layers)}"
            )
        num_blocks = int(layers[0].shape[0]) if layers[0].dim() > 0 else 0
        for i, t in enumerate(layers):
            if t.dim() != 4 or tuple(t.shape[1:]) != shape.layer_shape:
                raise ValueError(
                    f"layer {i} must be [blocks, {', '.join(map(str, shape.layer_shape))}], "
                    f"got shape {tuple(t.shape)}"
                )
            if int(t.shape[0]) != num_blocks:
                raise ValueError(
                    f"layer {i} holds {t.shape[0]} blocks but layer 0 holds {num_blocks}"
                )
            if t.device != layers[0].device:
                raise ValueError(f"layer {i} is on {t.device} but layer 0 is on {layers[0].device}")
            _check_tensor(t, shape, f"layer {i}")
        _check_count(num_blocks)
        self.shape = shape
        self.layers = list(layers)
        self.num_blocks = num_blocks
        self._block_major = _stack_layers(self.layers)

    @classmethod
    def allocate(
        cls, shape: BlockShape, num_blocks: int, device: torch.device | str = "cpu"
    ) -> LayerSeparate:
        """One ``[layers, blocks, ...]`` allocation handed out as per-layer tensors, so that
        ``block_major`` finds all layers at a fixed distance in one storage."""
        _check_count(num_blocks)
        dims = (shape.num_layers, num_blocks, *shape.layer_shape)
        return cls(shape, list(torch.empty(dims, dtype=shape.dtype, device=device).unbind(0)))

    def layer(self, index: int) -> torch.Tensor:
        return self.layers[index]

    def block_major(self) -> torch.Tensor | None:
        return self._block_major


def _stack_layers(layers: list[torch.Tensor]) -> torch.Tensor | None:
    """A ``[blocks, layers, outer, page, inner]`` view over contiguous per-layer tensors that are
    slices of one storage with the same, non-overlapping distance from each layer to the next
    (one allocation cut per layer, as ``LayerSeparate.allocate`` and some engines do); None for
    anything else (separate allocations, layers out of order or uneven gaps)."""
    first = layers[0]
    storage = first.untyped_storage()
    offsets = [t.storage_offset() for t in layers]
    step = offsets[1] - offsets[0] if len(layers) > 1 else first.numel()
    if step < first.numel():  # overlapping, or the layers run backwards through the storage
        return None
    expected = range(offsets[0], offsets[0] + step * len(layers), step)
    for t, offset in zip(layers, expected, strict=True):
        if t.untyped_storage().data_ptr() != storage.data_ptr() or t.storage_offset() != offset:
            return None
    end = offsets[0] + step * (len(layers) - 1) + first.numel()
    if end * first.element_size() > storage.nbytes():
        return None
    size = (first.shape[0], len(layers), *first.shape[1:])
    stride = (first.stride(0), step, *first.stride()[1:])
    return first.as_strided(size, stride, offsets[0])


def _check_count(num_blocks: int) -> None:
    if not isinstance(num_blocks, int) or isinstance(num_blocks, bool) or num_blocks < 1:
        raise ValueError(f"a layout needs a positive number of blocks, got {num_blocks!r}")


def _check_tensor(tensor: torch.Tensor, shape: BlockShape, what: str) -> None:
    if tensor.dtype != shape.dtype:
        raise ValueError(f"{what} has dtype {tensor.dtype}, the block shape says {shape.dtype}")
    if not tensor.is_contiguous():
        raise ValueError(f"{what} must be contiguous")
