"""Errors the registry raises. Each says what was asked and what was there."""

from __future__ import annotations


class PoolExhausted(RuntimeError):
    """Fewer blocks could be made available than were asked for.

    The pool is left consistent: no block was handed out. Inactive blocks that were
    evicted while trying stay evicted, and their ``Removed`` event has been emitted.
    """

    def __init__(
        self, tier: str, requested: int, available: int, detail: str | None = None
    ) -> None:
        super().__init__(
            f"{tier} pool exhausted: {requested} blocks requested, {available} could be freed "
            f"({detail or 'every other block is in use'})"
        )
        self.tier = tier
        self.requested = requested
        self.available = available


class PoolBusy(RuntimeError):
    """An operation that needs an idle pool (such as ``clear``) found blocks in use."""
