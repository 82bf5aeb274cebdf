"""G3: a file of fixed-size slots on local disk."""

from kvledger.tiers.disk.tier import DiskTier, DiskTierError

__all__ = ["DiskTier", "DiskTierError"]
