"""A router's index fed by the shared registry's Redis stream, as the tests build one."""

from __future__ import annotations

from kvledger.events.shared.registry import SharedRegistry
from kvledger.events.shared.subscribe import StreamSubscriber
from kvledger.registry.index import RouterIndex


def stream_router(
    registry: SharedRegistry, group: str = "routers", consumer: str = "r1"
) -> tuple[RouterIndex, StreamSubscriber]:
    """A fresh ``RouterIndex`` and the subscriber (one consumer of ``group``) that feeds it:
    events, purge notices and baselines."""
    index = RouterIndex()
    subscriber = StreamSubscriber(
        registry,
        group,
        consumer,
        on_event=index.apply,
        on_purge=index.remove_worker,
        on_baseline=index.apply_baseline,
    )
    return index, subscriber
