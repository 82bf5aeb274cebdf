"""G2: host memory, pinned when CUDA is there so the GPU can DMA into it directly."""

from __future__ import annotations

from kvledger.events.types import Tier
from kvledger.tiers.base import MemoryTier, cuda_available
from kvledger.tiers.layout import BlockShape, FullyContiguous


class HostTier(MemoryTier):
    """G2 slots in one page-aligned ``FullyContiguous`` tensor: one block is one run of bytes.

    ``pin=None`` pins when CUDA is available; ``pin=True`` without CUDA is refused up front,
    because torch would raise deep inside the allocation otherwise.
    """

    layout: FullyContiguous

    def __init__(self, shape: BlockShape, num_blocks: int, *, pin: bool | None = None) -> None:
        if pin is None:
            pin = cuda_available()
        elif pin and not cuda_available():
            raise ValueError("G2 pin=True needs CUDA, which torch does not see on this machine")
        self.pinned = pin
        super().__init__(Tier.G2, FullyContiguous.allocate(shape, num_blocks, pin_memory=pin))
