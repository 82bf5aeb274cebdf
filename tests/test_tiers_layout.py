"""Block shapes and the two layouts: sizes, validation, and views of one block."""

from __future__ import annotations

import pytest
import torch

from kvledger.tiers.layout import PAGE_ALIGNMENT, BlockShape, FullyContiguous, LayerSeparate

SHAPE = BlockShape(num_layers=3, outer_dim=2, page_size=4, inner_dim=8, dtype=torch.bfloat16)


def test_block_bytes_counts_every_layer_and_kv_half() -> None:
    assert SHAPE.layer_bytes == 2 * 4 * 8 * 2
    assert SHAPE.block_bytes == 3 * SHAPE.layer_bytes
    big = BlockShape(32, 2, 16, 1024, torch.bfloat16)
    assert big.block_bytes == 2 * 1024 * 1024


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"outer_dim": 3}, "outer_dim must be 1"),
        ({"num_layers": 0}, "num_layers must be a positive integer"),
        ({"page_size": -4}, "page_size must be a positive integer"),
        ({"inner_dim": 2.5}, "inner_dim must be a positive integer"),
        ({"dtype": "bf16"}, "dtype must be a torch.dtype"),
    ],
)
def test_bad_block_shape_is_refused_by_name(kwargs: dict[str, object], message: str) -> None:
    fields: dict[str, object] = {
        "num_layers": 2,
        "outer_dim": 2,
        "page_size": 4,
        "inner_dim": 8,
        "dtype": torch.float16,
    }
    fields.update(kwargs)
    with pytest.raises(ValueError, match=message):
        BlockShape(**fields)  # type: ignore[arg-type]


def test_fully_contiguous_block_is_one_run_of_bytes() -> None:
    layout = FullyContiguous.allocate(SHAPE, 5)
    layout.tensor.fill_(0)
    for view in layout.block(2):
        view.fill_(1)
    raw = layout.block_bytes_view()
    assert raw.shape == (5, SHAPE.block_bytes)
    assert bool((raw[2] != 0).all())
    assert int(raw[[0, 1, 3, 4]].count_nonzero()) == 0


def test_host_allocation_starts_on_a_page() -> None:
    for blocks in (1, 3, 7):
        assert FullyContiguous.allocate(SHAPE, blocks).tensor.data_ptr() % PAGE_ALIGNMENT == 0


def test_layer_separate_block_views_touch_only_that_block() -> None:
    layout = LayerSeparate.allocate(SHAPE, 4)
    for t in layout.layers:
        t.zero_()
    views = layout.block(3)
    assert [tuple(v.shape) for v in views] == [SHAPE.layer_shape] * 3
    for v in views:
        v.fill_(7)
    for t in layout.layers:
        assert bool((t[3] == 7).all()) and int(t[:3].count_nonzero()) == 0


def test_layer_view_of_fully_contiguous_is_block_major() -> None:
    layout = FullyContiguous.allocate(SHAPE, 4)
    layout.tensor.copy_(torch.randn(layout.tensor.shape))
    assert torch.equal(layout.layer(1)[2], layout.tensor[2, 1])


def test_block_outside_layout_is_refused() -> None:
    with pytest.raises(IndexError, match="slot 4 is outside this layout's 4 blocks"):
        LayerSeparate.allocate(SHAPE, 4).block(4)


def test_wrapped_tensors_are_validated() -> None:
    good = [torch.empty(6, *SHAPE.layer_shape, dtype=SHAPE.dtype) for _ in range(3)]
    assert LayerSeparate(SHAPE, good).num_blocks == 6
    with pytest.raises(ValueError, match="needs 3 layer tensors, got 2"):
        LayerSeparate(SHAPE, good[:2])
    with pytest.raises(ValueError, match="layer 1 holds 5 blocks but layer 0 holds 6"):
        LayerSeparate(SHAPE, [good[0], good[1][:5], good[2]])
    with pytest.raises(ValueError, match=r"layer 2 must be \[blocks, 2, 4, 8\]"):
        LayerSeparate(SHAPE, [good[0], good[1], torch.empty(6, 2, 4, 9, dtype=SHAPE.dtype)])
    with pytest.raises(ValueError, match=r"layer 0 has dtype torch\.float32"):
        LayerSeparate(SHAPE, [g.float() for g in good])
    with pytest.raises(ValueError, match="must be contiguous"):
        FullyContiguous(SHAPE, torch.empty(3, 8, 4, 2, 3, dtype=SHAPE.dtype).permute(0, 4, 3, 2, 1))
    with pytest.raises(ValueError, match=r"FullyContiguous needs a \[blocks, 3, 2, 4, 8\] tensor"):
        FullyContiguous(SHAPE, torch.empty(4, 2, 2, 4, 8, dtype=SHAPE.dtype))
    with pytest.raises(ValueError, match="positive number of blocks"):
        FullyContiguous.allocate(SHAPE, 0)
