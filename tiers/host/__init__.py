"""G2: host memory."""

from kvledger.tiers.host.tier import HostTier

__all__ = ["HostTier"]
