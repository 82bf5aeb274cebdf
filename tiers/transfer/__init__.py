"""Batched, asynchronous block copies between any two tiers: the engine (threads, handles,
results) in ``engine``, the torch copies it runs in ``routes``."""

from kvledger.tiers.transfer.engine import TransferEngine, TransferHandle, TransferResult

__all__ = ["TransferEngine", "TransferHandle", "TransferResult"]
