"""Where the bytes live: layouts, the tiers G1/G2/G3 and the copier between them."""

from kvledger.tiers.base import MemoryTier, StorageTier
from kvledger.tiers.device import DeviceTier
from kvledger.tiers.disk import DiskTier, DiskTierError
from kvledger.tiers.host import HostTier
from kvledger.tiers.layout import BlockShape, FullyContiguous, KVLayout, LayerSeparate
from kvledger.tiers.transfer import Copier, TransferHandle, TransferResult

__all__ = [
    "BlockShape",
    "Copier",
    "DeviceTier",
    "DiskTier",
    "DiskTierError",
    "FullyContiguous",
    "HostTier",
    "KVLayout",
    "LayerSeparate",
    "MemoryTier",
    "StorageTier",
    "TransferHandle",
    "TransferResult",
]
