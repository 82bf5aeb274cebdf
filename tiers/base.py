"""The one protocol every storage tier speaks: a fixed number of block-sized slots.

Tiers know bytes and slot numbers. Which block (hash) sits in which slot is the pools'
business (``kvledger.registry``), so a failed copy can never leave the registry claiming bytes
that are not there. The one exception is G3, which writes each block's name beside its bytes
so that a restarted worker can check what its disk holds; it never decides anything by them.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from kvledger.events.types import Tier
from kvledger.tiers.layout import BlockShape, KVLayout


class StorageTier:
    """``num_slots`` slots of ``shape.block_bytes`` each, on one tier."""

    tier: Tier
    shape: BlockShape
    num_slots: int

    def check_slots(self, slots: Iterable[int], role: str) -> list[int]:
        """Slots as a list of ints; refuse out-of-range slots, and repeats when writing to them."""
        out = [int(s) for s in slots]
        for s in out:
            if not 0 <= s < self.num_slots:
                raise IndexError(
                    f"{role} slot {s} is outside {self.tier.name}'s {self.num_slots} slots"
                )
        if role == "destination" and len(set(out)) != len(out):
            seen: set[int] = set()
            for s in out:
                if s in seen:
                    raise ValueError(f"destination slot {s} on {self.tier.name} appears twice")
                seen.add(s)
        return out

    def close(self) -> None:
        """Release what the tier holds open; memory tiers hold nothing beyond their tensors."""


class MemoryTier(StorageTier):
    """A tier whose slots are tensor rows (G1 on a device, G2 in host memory)."""

    layout: KVLayout

    def __init__(self, tier: Tier, layout: KVLayout) -> None:
        self.tier = tier
        self.layout = layout
        self.shape = layout.shape
        self.num_slots = layout.num_blocks

    @property
    def device(self) -> torch.device:
        return self.layout.device


def cuda_available() -> bool:
    """Whether torch can use a CUDA device here (pinned memory needs one too)."""
    return bool(torch.cuda.is_available())
