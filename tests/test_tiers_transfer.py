"""Copies between every pair of tiers, on CPU: random bytes in, poisoned destination, bytes out.

G1 runs on CPU tensors here (the same code as on a GPU), G2 is pageable, G3 is a real file.
Small staging buffers force transfers to span several chunks.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from kvledger.events.types import BlockInfo, Tier
from kvledger.tiers import (
    BlockShape,
    Copier,
    DeviceTier,
    DiskTier,
    HostTier,
    MemoryTier,
    StorageTier,
    TransferHandle,
    TransferResult,
)
from kvledger.tiers.layout import FullyContiguous, LayerSeparate

SHAPE = BlockShape(num_layers=3, outer_dim=2, page_size=4, inner_dim=8, dtype=torch.bfloat16)
SLOTS = 24
POISON = 0xA5


@pytest.fixture
def copier() -> Iterator[Copier]:
    cop = Copier(staging_blocks=5)
    yield cop
    cop.close()


def make_tier(kind: str, tmp_path: Path) -> StorageTier:
    if kind == "G1-layer-separate":
        return DeviceTier(SHAPE, SLOTS, layout="layer_separate", device="cpu")
    if kind == "G1-fully-contiguous":
        return DeviceTier(SHAPE, SLOTS, layout="fully_contiguous", device="cpu")
    if kind == "G2":
        return HostTier(SHAPE, SLOTS, pin=False)
    if kind == "G3":
        return DiskTier(tmp_path / "g3", SHAPE, SLOTS, io_threads=3)
    raise AssertionError(kind)


def fill_random(tier: StorageTier, copier: Copier, seed: int) -> dict[int, bytes]:
    """Random bytes in every slot; returns them by slot. G3 is filled through a host tier."""
    gen = torch.Generator().manual_seed(seed)
    if isinstance(tier, MemoryTier):
        for layer in range(SHAPE.num_layers):
            view = tier.layout.layer(layer)
            view.view(torch.uint8).copy_(
                torch.randint(
                    0, 256, view.view(torch.uint8).shape, dtype=torch.uint8, generator=gen
                )
            )
        return {s: block_bytes(tier, s) for s in range(SLOTS)}
    host = HostTier(SHAPE, SLOTS, pin=False)
    expected = fill_random(host, copier, seed)
    copier.copy(host, range(SLOTS), tier, range(SLOTS)).wait()
    return expected


def poison(tier: StorageTier, copier: Copier) -> None:
    if isinstance(tier, MemoryTier):
        for layer in range(SHAPE.num_layers):
            tier.layout.layer(layer).view(torch.uint8).fill_(POISON)
        return
    host = HostTier(SHAPE, SLOTS, pin=False)
    host.layout.tensor.view(torch.uint8).fill_(POISON)
    copier.copy(host, range(SLOTS), tier, range(SLOTS)).wait()


def block_bytes(tier: StorageTier, slot: int, copier: Copier | None = None) -> bytes:
    if isinstance(tier, MemoryTier):
        return b"".join(
            v.contiguous().view(torch.uint8).numpy().tobytes() for v in tier.layout.block(slot)
        )
    assert copier is not None
    host = HostTier(SHAPE, 1, pin=False)
    result = copier.copy(tier, [slot], host, [0]).wait()
    assert not result.failed, f"G3 slot {slot} did not read back"
    return block_bytes(host, 0)


KINDS = ["G1-layer-separate", "G1-fully-contiguous", "G2", "G3"]
PAIRS = [(a, b) for a in KINDS for b in KINDS if a != b and not (a == b == "G3")]


@pytest.mark.parametrize(("src_kind", "dst_kind"), PAIRS)
@pytest.mark.parametrize("seed", [1, 2])
def test_every_tier_pair_copies_exact_bytes(
    src_kind: str, dst_kind: str, seed: int, tmp_path: Path, copier: Copier
) -> None:
    rng = random.Random(seed)
    src, dst = make_tier(src_kind, tmp_path / "a"), make_tier(dst_kind, tmp_path / "b")
    expected = fill_random(src, copier, seed)
    poison(dst, copier)
    count = rng.randint(1, SLOTS - 4)
    src_slots = rng.sample(range(SLOTS), count)
    dst_slots = rng.sample(range(SLOTS), count)

    result = copier.copy(src, src_slots, dst, dst_slots).wait()

    assert result.copied == list(zip(src_slots, dst_slots, strict=True))
    assert result.failed == []
    for s, d in result.copied:
        assert block_bytes(dst, d, copier) == expected[s], f"slot {s} -> {d}"
    untouched = sorted(set(range(SLOTS)) - set(dst_slots))
    for d in untouched[:3]:
        assert block_bytes(dst, d, copier) == bytes([POISON]) * SHAPE.block_bytes
    for tier in (src, dst):
        tier.close()


def test_contiguous_runs_and_single_blocks(tmp_path: Path, copier: Copier) -> None:
    """Runs of consecutive slots take the one-copy path; a single block takes the smallest."""
    g1 = make_tier("G1-layer-separate", tmp_path)
    g2 = make_tier("G2", tmp_path)
    expected = fill_random(g1, copier, 7)
    poison(g2, copier)
    copier.copy(g1, [4, 5, 6, 7, 8, 9, 10], g2, [10, 11, 12, 13, 14, 15, 16]).wait()
    copier.copy(g1, [0], g2, [23]).wait()
    for s, d in [*zip(range(4, 11), range(10, 17), strict=True), (0, 23)]:
        assert block_bytes(g2, d) == expected[s]


def test_round_trip_through_every_tier_returns_the_original(tmp_path: Path, copier: Copier) -> None:
    g1 = make_tier("G1-layer-separate", tmp_path)
    g2, g3 = make_tier("G2", tmp_path), make_tier("G3", tmp_path)
    expected = fill_random(g1, copier, 3)
    copier.copy(g1, [2, 9, 17], g2, [0, 1, 2])
    copier.copy(g2, [0, 1, 2], g3, [20, 3, 11])  # queued after the first: same worker
    handle = copier.copy(g3, [20, 3, 11], g1, [5, 6, 7])
    assert handle.wait().dst_slots == [5, 6, 7]
    for s, d in [(2, 5), (9, 6), (17, 7)]:
        assert block_bytes(g1, d) == expected[s]


def test_result_names_the_blocks_that_arrived_with_their_tiers(
    tmp_path: Path,
) -> None:
    """What the manager reads from a finished copy: the tiers, the pairs and the block names."""
    copier = Copier(staging_blocks=4)
    g1, g2 = make_tier("G1-layer-separate", tmp_path), make_tier("G2", tmp_path)
    fill_random(g1, copier, 5)
    blocks = [BlockInfo(100, 10, None), BlockInfo(101, 11, 100)]

    off = copier.copy(g1, [1, 2], g2, [8, 9], blocks=blocks).wait()
    on = copier.copy(g2, [8, 9], g1, [3, 4], blocks=blocks).wait()
    unnamed = copier.copy(g1, [5], g2, [10]).wait()  # no identities: none to tell
    copier.close()

    assert (off.src_tier, off.dst_tier, off.blocks) == (Tier.G1, Tier.G2, blocks)
    assert (on.src_tier, on.dst_tier, on.blocks) == (Tier.G2, Tier.G1, blocks)
    assert (off.copied, on.copied) == ([(1, 8), (2, 9)], [(8, 3), (9, 4)])
    assert (unnamed.copied, unnamed.blocks) == ([(5, 10)], [])


def test_callbacks_run_once_the_copy_is_done(tmp_path: Path, copier: Copier) -> None:
    g1, g2 = make_tier("G1-layer-separate", tmp_path), make_tier("G2", tmp_path)
    fill_random(g1, copier, 9)
    seen: list[tuple[bool, list[int]]] = []

    def on_done(h: TransferHandle) -> None:
        seen.append((h.done(), h.wait().dst_slots))

    handle = copier.copy(g1, [0, 1, 2], g2, [3, 4, 5], callback=on_done)
    handle.wait()
    late: list[bool] = []
    handle.add_done_callback(lambda h: late.append(h.done()))  # after the fact: runs at once
    assert seen == [(True, [3, 4, 5])]
    assert late == [True]
    assert handle.exception() is None


def test_every_result_reaches_its_callback(tmp_path: Path) -> None:
    results: list[TransferResult] = []
    copier = Copier()
    g1, g2 = make_tier("G1-layer-separate", tmp_path), make_tier("G2", tmp_path)
    copier.copy(g1, [0], g2, [1], callback=lambda h: results.append(h.wait())).wait()
    copier.close()
    assert [(r.src_tier, r.dst_tier, r.copied) for r in results] == [(Tier.G1, Tier.G2, [(0, 1)])]


def test_empty_copy_completes_and_names_nothing(tmp_path: Path) -> None:
    copier = Copier()
    g1, g2 = make_tier("G1-layer-separate", tmp_path), make_tier("G2", tmp_path)
    result = copier.copy(g1, [], g2, [], blocks=[]).wait()
    copier.close()
    assert (result.copied, result.failed, result.blocks) == ([], [], [])


@pytest.mark.parametrize(
    ("src_slots", "dst_slots", "message", "error"),
    [
        ([0, 1], [0], "2 source slots but 1 destination slots", ValueError),
        ([0, 24], [0, 1], "source slot 24 is outside G1's 24 slots", IndexError),
        ([0, 1], [-1, 2], "destination slot -1 is outside G2's 24 slots", IndexError),
        ([0, 1], [5, 5], "destination slot 5 on G2 appears twice", ValueError),
    ],
)
def test_bad_slot_lists_are_refused_before_anything_moves(
    src_slots: list[int],
    dst_slots: list[int],
    message: str,
    error: type[Exception],
    tmp_path: Path,
    copier: Copier,
) -> None:
    g1, g2 = make_tier("G1-layer-separate", tmp_path), make_tier("G2", tmp_path)
    poison(g2, copier)
    with pytest.raises(error, match=message):
        copier.copy(g1, src_slots, g2, dst_slots)
    assert all(block_bytes(g2, d) == bytes([POISON]) * SHAPE.block_bytes for d in range(SLOTS))


def test_wrong_shape_or_pairing_is_refused(tmp_path: Path, copier: Copier) -> None:
    g1, g2 = make_tier("G1-layer-separate", tmp_path), make_tier("G2", tmp_path)
    g3 = make_tier("G3", tmp_path / "x")
    other = HostTier(BlockShape(3, 2, 4, 16, torch.bfloat16), 4, pin=False)
    with pytest.raises(ValueError, match=r"G1 holds blocks of .* but G2 of"):
        copier.copy(g1, [0], other, [0])
    with pytest.raises(ValueError, match="same G2 tier"):
        copier.copy(g2, [0], g2, [1])
    with pytest.raises(ValueError, match="disk-to-disk"):
        copier.copy(g3, [0], make_tier("G3", tmp_path / "y"), [0])
    with pytest.raises(ValueError, match="1 blocks named for 2 slot pairs"):
        copier.copy(g1, [0, 1], g2, [0, 1], blocks=[BlockInfo(1, 1, None)])
    with pytest.raises(ValueError, match="staging_blocks must be at least 1"):
        Copier(staging_blocks=0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without CUDA")
def test_pinned_host_tier_without_cuda_is_refused_clearly() -> None:
    with pytest.raises(ValueError, match="pin=True needs CUDA"):
        HostTier(SHAPE, 2, pin=True)
    assert HostTier(SHAPE, 2).pinned is False


def test_unknown_g1_layout_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown G1 layout 'paged'"):
        DeviceTier(SHAPE, 2, layout="paged", device="cpu")  # type: ignore[arg-type]


def test_engine_wraps_an_engines_own_tensors(tmp_path: Path, copier: Copier) -> None:
    """G1 as engines hand it over: their per-layer tensors, not a copy of them."""
    layers = [torch.randn(SLOTS, *SHAPE.layer_shape).to(SHAPE.dtype) for _ in range(3)]
    g1 = DeviceTier.from_layout(LayerSeparate(SHAPE, layers))
    g2 = make_tier("G2", tmp_path)
    copier.copy(g1, [6], g2, [0]).wait()
    assert isinstance(g2, HostTier) and isinstance(g2.layout, FullyContiguous)
    for layer, t in enumerate(layers):
        assert torch.equal(g2.layout.tensor[0, layer], t[6])
