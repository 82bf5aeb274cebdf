"""The one-op path for layer-separate G1: layers found at a fixed distance in one storage are
moved with one indexing op over a block-major strided view; anything else layer by layer.

Both paths must copy the same bytes, on CPU and (when there is one) on a GPU, and a scatter
through the strided view must never touch the bytes between an engine's layers.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from kvledger.tiers import BlockShape, Copier, DeviceTier, DiskTier, HostTier
from kvledger.tiers.layout import LayerSeparate

SHAPE = BlockShape(num_layers=4, outer_dim=2, page_size=4, inner_dim=8, dtype=torch.bfloat16)
SLOTS = 20
LAYER_NUMEL = SLOTS * 2 * 4 * 8
POISON = 0xA5
GAP = 0x5A

DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=[
            pytest.mark.gpu,
            pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
        ],
    ),
]


def _cut(raw: torch.Tensor, starts: list[int]) -> list[torch.Tensor]:
    """Per-layer tensors at the given element offsets of one flat buffer."""
    return [raw[s : s + LAYER_NUMEL].view(SLOTS, *SHAPE.layer_shape) for s in starts]


def one_buffer(dev: str) -> tuple[list[torch.Tensor], torch.Tensor]:
    """``torch.empty(layers, blocks, ...)`` cut per layer, as ``LayerSeparate.allocate`` does."""
    raw = torch.empty(SHAPE.num_layers * LAYER_NUMEL, dtype=SHAPE.dtype, device=dev)
    return _cut(raw, [i * LAYER_NUMEL for i in range(SHAPE.num_layers)]), raw


def padded(dev: str) -> tuple[list[torch.Tensor], torch.Tensor]:
    """One buffer, layers a fixed distance apart with padding between them and before the first."""
    step = LAYER_NUMEL + 24
    raw = torch.empty(8 + SHAPE.num_layers * step, dtype=SHAPE.dtype, device=dev)
    return _cut(raw, [8 + i * step for i in range(SHAPE.num_layers)]), raw


def odd_offset(dev: str) -> tuple[list[torch.Tensor], torch.Tensor]:
    """One buffer, but starting one bf16 element in: only 2-byte words fit the addresses."""
    step = LAYER_NUMEL + 1
    raw = torch.empty(1 + SHAPE.num_layers * step, dtype=SHAPE.dtype, device=dev)
    return _cut(raw, [1 + i * step for i in range(SHAPE.num_layers)]), raw


def uneven(dev: str) -> tuple[list[torch.Tensor], torch.Tensor]:
    """One buffer, but the gap before the last layer differs: no single stride fits."""
    raw = torch.empty((SHAPE.num_layers + 1) * LAYER_NUMEL, dtype=SHAPE.dtype, device=dev)
    starts = [i * LAYER_NUMEL for i in range(SHAPE.num_layers - 1)] + [
        SHAPE.num_layers * LAYER_NUMEL
    ]
    return _cut(raw, starts), raw


def reordered(dev: str) -> tuple[list[torch.Tensor], torch.Tensor]:
    """One buffer, layers handed over in another order than they lie in memory."""
    layers, raw = one_buffer(dev)
    return [layers[1], layers[0], *layers[2:]], raw


def separate(dev: str) -> tuple[list[torch.Tensor], torch.Tensor | None]:
    """One allocation per layer (what most engines hand over)."""
    dims = (SLOTS, *SHAPE.layer_shape)
    return [torch.empty(dims, dtype=SHAPE.dtype, device=dev) for _ in range(SHAPE.num_layers)], None


Builder = Callable[[str], tuple[list[torch.Tensor], torch.Tensor | None]]
STRIDED: list[Builder] = [one_buffer, padded, odd_offset]
PER_LAYER: list[Builder] = [uneven, reordered, separate]


@pytest.mark.parametrize("build", STRIDED + PER_LAYER, ids=lambda b: b.__name__)
def test_block_major_view_exists_exactly_when_layers_share_one_stride(build: Builder) -> None:
    layers, _ = build("cpu")
    whole = LayerSeparate(SHAPE, layers).block_major()
    if build not in STRIDED:
        assert whole is None
        return
    assert whole is not None and tuple(whole.shape) == (SLOTS, SHAPE.num_layers, 2, 4, 8)
    for layer, t in enumerate(layers):
        t.copy_(torch.randn(t.shape).to(SHAPE.dtype))
        for slot in (0, 7, SLOTS - 1):
            assert whole[slot, layer].data_ptr() == t[slot].data_ptr()
            assert torch.equal(whole[slot, layer], t[slot])


def test_allocated_layer_separate_is_one_storage_of_separate_contiguous_layers() -> None:
    layout = LayerSeparate.allocate(SHAPE, SLOTS)
    assert layout.block_major() is not None
    assert all(layout.layer(i).is_contiguous() for i in range(SHAPE.num_layers))
    ptrs = {layout.layer(i).untyped_storage().data_ptr() for i in range(SHAPE.num_layers)}
    assert len(ptrs) == 1


def _randomize(layers: list[torch.Tensor], raw: torch.Tensor | None, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    if raw is not None:  # the bytes between layers hold a marker the copies must leave alone
        raw.view(torch.uint8).fill_(GAP)
    for t in layers:
        b = t.view(torch.uint8)
        b.copy_(torch.randint(0, 256, b.shape, dtype=torch.uint8, generator=gen).to(t.device))


def _block(layers: list[torch.Tensor], slot: int) -> bytes:
    return b"".join(t[slot].view(torch.uint8).cpu().numpy().tobytes() for t in layers)


def _gap_bytes(layers: list[torch.Tensor], raw: torch.Tensor | None) -> int:
    """How many bytes of ``raw`` outside the layers no longer hold the gap marker."""
    if raw is None:
        return 0
    outside = torch.ones(raw.numel(), dtype=torch.bool)
    base = raw.storage_offset()
    for t in layers:
        start = t.storage_offset() - base
        outside[start : start + t.numel()] = False
    values = raw.view(torch.int16).cpu()[outside]
    return int((values != torch.tensor(GAP * 0x101, dtype=torch.int16)).sum())


@pytest.mark.parametrize("staging", [3, 8])  # equal chunks; a small first chunk, then larger
@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("build", STRIDED + PER_LAYER, ids=lambda b: b.__name__)
def test_engine_tensors_round_trip_through_host_and_disk(
    build: Builder, dev: str, staging: int, tmp_path: Path
) -> None:
    """G1 -> G2 -> G1 and G1 -> G3 -> G1 over several staging chunks, random slots, poisoned
    destinations; the bytes between engine layers stay as they were."""
    rng = random.Random(7)
    copier = Copier(staging_blocks=staging)
    layers, raw = build(dev)
    _randomize(layers, raw, seed=3)
    g1 = DeviceTier.from_layout(LayerSeparate(SHAPE, layers))
    assert (g1.layout.block_major() is not None) == (build in STRIDED)
    g2 = HostTier(SHAPE, SLOTS, pin=False)
    g3 = DiskTier(tmp_path / "g3", SHAPE, SLOTS, io_threads=2)
    g2.layout.tensor.view(torch.uint8).fill_(POISON)
    expected = {s: _block(layers, s) for s in range(SLOTS)}

    count = 11  # more than the few blocks that are copied layer by layer without staging
    src, mid, far = (rng.sample(range(SLOTS), count) for _ in range(3))
    copier.copy(g1, src, g2, mid).wait()
    copier.copy(g1, src, g3, far).wait()
    for s, m in zip(src, mid, strict=True):
        assert g2.layout.block_bytes_view()[m].numpy().tobytes() == expected[s]

    for t in layers:
        t.view(torch.uint8).fill_(POISON)
    back = rng.sample(range(SLOTS), count)
    copier.copy(g2, mid, g1, back).wait()
    for s, b in zip(src, back, strict=True):
        assert _block(layers, b) == expected[s]
    untouched = set(range(SLOTS)) - set(back)
    assert all(_block(layers, u) == bytes([POISON]) * SHAPE.block_bytes for u in untouched)

    for t in layers:
        t.view(torch.uint8).fill_(POISON)
    assert not copier.copy(g3, far, g1, back).wait().failed
    for s, b in zip(src, back, strict=True):
        assert _block(layers, b) == expected[s]
    assert _gap_bytes(layers, raw) == 0
    copier.close()
    g3.close()
