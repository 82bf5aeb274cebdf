"""Where the bytes live: layouts, the tiers G1/G2/G3 and the transfer engine between them."""

from kvledger.tiers.base import MemoryTier, StorageTier
from kvledger.tiers.device import DeviceTier
from kvledger.tiers.disk import DiskTier, DiskTierError
from kvledger.tiers.host import HostTier
from kvledger.tiers.layout import BlockShape, FullyContiguous, KVLayout, LayerSeparate
from kvledger.tiers.transfer import TransferEngine, TransferHandle, TransferResult

__all__ = [
    "BlockShape",
    "DeviceTier",
    "DiskTier",
    "DiskTierError",
    "FullyContiguous",
    "HostTier",
    "KVLayout",
    "LayerSeparate",
    "MemoryTier",
    "StorageTier",
    "TransferEngine",
    "TransferHandle",
    "TransferResult",
]
