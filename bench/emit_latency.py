"""Emit-to-view latency: how long after an engine hands an event to its log a view outside the
process has it (the shared registry applied it, a router received it over ZMQ).

Views take only committed events, so this is the log's commit lag (the writer starts a commit
``max_delay/4`` after the first queued event) plus the publisher's own path. The producer
appends at a fixed rate, spinning between appends as a busy engine thread does (never
sleeping, so the writer and the publishers compete with it for the interpreter);
``time.monotonic`` is system-wide on Linux, so times taken in another process compare.

Used by bench/redis_bench.py and bench/zmq_bench.py; the target is p99 <= the log's
``max_delay`` + 20 ms.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable, Sequence
from typing import TypeVar

T = TypeVar("T")

TARGET_EXTRA_S = 0.020
"""p99 target: the log's ``max_delay`` plus this."""


def paced(append: Callable[[T], object], items: Sequence[T], rate: float) -> list[float]:
    """Call ``append`` with each item at ``rate`` per second, spinning between calls; returns
    each call's start (``time.monotonic()``), the moment the event was emitted."""
    clock = time.monotonic
    emitted: list[float] = []
    start = clock()
    for i, item in enumerate(items):
        due = start + i / rate
        while clock() < due:
            pass
        emitted.append(clock())
        append(item)
    return emitted


def delays(emitted: Sequence[float], seen: Sequence[tuple[int, float]]) -> list[float]:
    """Per event ``i`` (ids 0..), the time from its emission to the first moment ``seen`` says
    a view had it: ``seen`` holds (the newest event id the view had, when), in time order."""
    newest = [event_id for event_id, _ in seen]
    out = []
    for event_id, at in enumerate(emitted):
        k = bisect.bisect_left(newest, event_id)
        if k == len(seen):
            raise ValueError(f"event {event_id} never reached the view")
        out.append(seen[k][1] - at)
    return sorted(out)


def summary(name: str, values: list[float], rate: float, max_delay: float) -> str:
    """One line: p50, p99, max in ms, against the target."""

    def ms(q: float) -> float:
        return values[min(len(values) - 1, int(q * len(values)))] * 1000

    target = (max_delay + TARGET_EXTRA_S) * 1000
    met = "met" if ms(0.99) <= target else "NOT met"
    return (
        f"{name} at {rate:,.0f} events/s ({len(values):,} events): p50 {ms(0.5):.1f} ms, "
        f"p99 {ms(0.99):.1f} ms, max {values[-1] * 1000:.1f} ms (target p99 <= max_delay + "
        f"20 = {target:.0f} ms: {met})"
    )
