"""G1: device memory."""

from kvledger.tiers.device.tier import DeviceTier, default_device

__all__ = ["DeviceTier", "default_device"]
