"""G1: the engine's own KV cache, on the GPU (or on CPU tensors where there is none)."""

from __future__ import annotations

from typing import Literal

import torch

from kvledger.events.types import Tier
from kvledger.tiers.base import MemoryTier, cuda_available
from kvledger.tiers.layout import BlockShape, FullyContiguous, KVLayout, LayerSeparate


class DeviceTier(MemoryTier):
    """G1 slots. Usually wraps the tensors an engine already allocated (``from_layout``)."""

    def __init__(
        self,
        shape: BlockShape,
        num_blocks: int,
        *,
        layout: Literal["layer_separate", "fully_contiguous"] = "layer_separate",
        device: torch.device | str | None = None,
    ) -> None:
        dev = torch.device(device if device is not None else default_device())
        if layout == "layer_separate":
            kv: KVLayout = LayerSeparate.allocate(shape, num_blocks, dev)
        elif layout == "fully_contiguous":
            kv = FullyContiguous.allocate(shape, num_blocks, dev)
        else:
            raise ValueError(
                f"unknown G1 layout {layout!r}; expected 'layer_separate' or 'fully_contiguous'"
            )
        super().__init__(Tier.G1, kv)

    @classmethod
    def from_layout(cls, layout: KVLayout) -> DeviceTier:
        tier = cls.__new__(cls)
        MemoryTier.__init__(tier, Tier.G1, layout)
        return tier


def default_device() -> torch.device:
    """``cuda`` when torch sees a GPU, else ``cpu``: G1 runs the same code on either."""
    return torch.device("cuda" if cuda_available() else "cpu")
