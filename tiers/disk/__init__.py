"""G3: a file of fixed-size slots on local disk, with a self-describing index and a lock."""

from kvledger.tiers.disk.lock import G3InUse
from kvledger.tiers.disk.recovery import KnownBlocks, SlotRecovery
from kvledger.tiers.disk.tier import DiskTier, DiskTierError

__all__ = ["DiskTier", "DiskTierError", "G3InUse", "KnownBlocks", "SlotRecovery"]
