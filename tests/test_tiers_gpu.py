"""The CUDA routes: G1 on the GPU to and from pinned G2 and G3, with random bytes."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from kvledger.tiers import BlockShape, Copier, DeviceTier, DiskTier, HostTier

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

SHAPE = BlockShape(num_layers=4, outer_dim=2, page_size=16, inner_dim=64, dtype=torch.bfloat16)
SLOTS = 40


def random_g1(layout: str, seed: int) -> DeviceTier:
    g1 = DeviceTier(SHAPE, SLOTS, layout=layout, device="cuda")  # type: ignore[arg-type]
    gen = torch.Generator(device="cuda").manual_seed(seed)
    for i in range(SHAPE.num_layers):
        raw = g1.layout.layer(i).view(torch.uint8)
        raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, device="cuda", generator=gen))
    return g1


def block_bytes(tier: DeviceTier | HostTier, slot: int) -> bytes:
    return b"".join(
        v.contiguous().view(torch.uint8).cpu().numpy().tobytes() for v in tier.layout.block(slot)
    )


@pytest.mark.parametrize("layout", ["layer_separate", "fully_contiguous"])
@pytest.mark.parametrize("pin", [True, False])
@pytest.mark.parametrize("count", [3, 37])  # direct per-layer copies, and staged chunks
def test_device_host_round_trip(layout: str, pin: bool, count: int) -> None:
    rng = random.Random(11)
    copier = Copier(staging_blocks=3)  # several chunks: both staging buffers in play
    g1, g2 = random_g1(layout, 1), HostTier(SHAPE, SLOTS, pin=pin)
    assert g2.pinned is pin
    g2.layout.tensor.view(torch.uint8).fill_(0xA5)
    expected = {s: block_bytes(g1, s) for s in range(SLOTS)}
    src, mid = rng.sample(range(SLOTS), count), rng.sample(range(SLOTS), count)

    copier.copy(g1, src, g2, mid).wait()
    for s, m in zip(src, mid, strict=True):
        assert block_bytes(g2, m) == expected[s]

    for i in range(SHAPE.num_layers):  # poison G1, then bring the blocks back elsewhere
        g1.layout.layer(i).view(torch.uint8).fill_(0x3C)
    back = rng.sample(range(SLOTS), count)
    assert copier.copy(g2, mid, g1, back).wait().dst_slots == back
    for s, b in zip(src, back, strict=True):
        assert block_bytes(g1, b) == expected[s]
    copier.close()


def test_device_disk_round_trip(tmp_path: Path) -> None:
    copier = Copier(staging_blocks=4)
    g1 = random_g1("layer_separate", 2)
    g3 = DiskTier(tmp_path, SHAPE, SLOTS)
    expected = {s: block_bytes(g1, s) for s in range(SLOTS)}
    copier.copy(g1, [5, 0, 33, 7, 21, 2, 9, 1, 30], g3, [0, 1, 2, 3, 4, 5, 6, 7, 8]).wait()
    for i in range(SHAPE.num_layers):
        g1.layout.layer(i).view(torch.uint8).fill_(0x3C)
    copier.copy(g3, [8, 7, 6, 5, 4, 3, 2, 1, 0], g1, list(range(20, 29))).wait()
    for s, d in zip([30, 1, 9, 2, 21, 7, 33, 0, 5], range(20, 29), strict=True):
        assert block_bytes(g1, d) == expected[s]
    copier.close()


def test_offload_waits_for_work_queued_on_the_callers_stream() -> None:
    """The copy must see what the copier's kernels wrote just before, without a sync."""
    copier = Copier()
    g1, g2 = random_g1("layer_separate", 3), HostTier(SHAPE, SLOTS)
    torch.cuda._sleep(50_000_000)  # keep the current stream busy for a while
    for i in range(SHAPE.num_layers):
        g1.layout.layer(i)[4].fill_(float(i + 1))
    copier.copy(g1, [4], g2, [0]).wait()
    for i in range(SHAPE.num_layers):
        assert bool((g2.layout.tensor[0, i] == i + 1).all())
    copier.close()


def test_copies_asked_for_after_one_issued_at_once_wait_for_it(tmp_path: Path) -> None:
    """An idle copier issues a G1->G2 copy on the caller's thread. A G2->G3 copy of the same
    slots asked for at once must see its bytes; and an onboard of G2 slots asked for right
    after a G3->G2 read into them (queued, so not issued at once) must see the read's bytes."""
    copier = Copier(staging_blocks=4)
    g1, g2 = random_g1("layer_separate", 5), HostTier(SHAPE, SLOTS)
    g3 = DiskTier(tmp_path, SHAPE, SLOTS)
    g2.layout.tensor.view(torch.uint8).fill_(0xA5)
    expected = {s: block_bytes(g1, s) for s in range(SLOTS)}
    src, mid, far = list(range(0, 12)), list(range(20, 32)), list(range(5, 17))

    torch.cuda._sleep(50_000_000)  # the copy starts late on the GPU, after copy() returned
    first = copier.copy(g1, src, g2, mid)
    copier.copy(g2, mid, g3, far).wait()
    assert first.done()

    g2.layout.tensor.view(torch.uint8).fill_(0xA5)
    for i in range(SHAPE.num_layers):
        g1.layout.layer(i).view(torch.uint8).fill_(0x3C)
    read = copier.copy(g3, far, g2, mid)
    onboard = copier.copy(g2, mid, g1, src)
    assert not read.wait().failed
    onboard.wait()
    for s in src:
        assert block_bytes(g1, s) == expected[s]
    copier.close()


def test_an_error_issuing_at_once_reaches_wait_and_leaves_the_copier_usable() -> None:
    copier = Copier(staging_blocks=4)
    host_g1 = DeviceTier(SHAPE, SLOTS, device="cpu")  # layer-separate: no host route to a GPU
    g1, g2 = random_g1("layer_separate", 6), HostTier(SHAPE, SLOTS)
    handle = copier.copy(host_g1, range(SLOTS), g1, range(SLOTS))  # too many to copy directly
    with pytest.raises(ValueError, match="must be a FullyContiguous layout"):
        handle.wait()
    copier.copy(g1, range(10), g2, range(10)).wait()
    for s in range(10):
        assert block_bytes(g2, s) == block_bytes(g1, s)
    copier.close()
