"""Batched, asynchronous block copies between any two tiers: the copier (threads, handles,
results) in ``copier``, the torch copies it runs in ``routes``."""

from kvledger.tiers.transfer.copier import Copier, TransferHandle, TransferResult

__all__ = ["Copier", "TransferHandle", "TransferResult"]
