"""Prometheus metrics of a worker's block manager, all named ``kvbm_*``.

Every ``Metrics`` has its own ``CollectorRegistry`` (never the process-wide default), so a
process may hold several (one per run, one per test) without name clashes, and ``serve``
exposes exactly one of them.

Most figures come from the event stream: pass ``observe_event`` as an event sink (after the
log in a fan-out) and stores, evictions, offloads and onboards are counted per tier. What
events do not carry is fed directly: prefix lookups (``observe_match``), pool occupancy
(``refresh``, from the pools themselves), latencies (``alloc_latency``,
``transfer_latency``), bytes really moved (``transfer_bytes``) and the event log's backlog,
commit lag and back-pressure (``watch_log``).
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Protocol
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from kvledger.events.types import AnyEvent, Offloaded, Onboarded, Removed, Stored, Tier

#: latency buckets from 10 microseconds (a bookkeeping call) to 10 seconds (a slow disk copy)
LATENCY_BUCKETS = (1e-5, 5e-5, 1e-4, 5e-4, 1e-3, 5e-3, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0)


class PoolView(Protocol):
    """What ``refresh`` reads of a pool (``kvledger.registry.pool.BlockPool`` has it)."""

    capacity: int

    @property
    def num_free(self) -> int: ...

    @property
    def num_active(self) -> int: ...

    @property
    def num_inactive(self) -> int: ...


class ViewProgress(Protocol):
    """What ``watch_view`` reads of a view's publisher (``RedisPublisher``, the ZMQ ones)."""

    @property
    def behind(self) -> int: ...


class LogView(Protocol):
    """What ``watch_log`` reads of an event log (``EventLog`` and ``AsyncEventLog`` have it)."""

    @property
    def queue_depth(self) -> int: ...

    @property
    def commit_lag(self) -> float: ...

    @property
    def backpressure_waits(self) -> int: ...

    @property
    def backpressure_seconds(self) -> float: ...


class Metrics:
    """The ``kvbm_*`` metrics of one worker, on a collector (prometheus' ``CollectorRegistry``)
    of their own.

    ``bytes_per_block`` turns block counts from events into bytes for the offload/onboard
    byte counters (0 leaves them at zero).
    """

    def __init__(self, *, bytes_per_block: int = 0, collector: CollectorRegistry | None = None):
        self.collector = collector if collector is not None else CollectorRegistry()
        self.bytes_per_block = bytes_per_block
        r = self.collector
        self.blocks = Gauge(
            "kvbm_blocks",
            "Blocks per tier by state: total (capacity), active, inactive (cached), free",
            ["tier", "state"],
            registry=r,
        )
        self.allocations = Counter(
            "kvbm_allocated_blocks",
            "Blocks newly placed on a tier (computed and stored, or copied there)",
            ["tier"],
            registry=r,
        )
        self.stored = Counter(
            "kvbm_stored_blocks", "Computed blocks registered on a tier", ["tier"], registry=r
        )
        self.evictions = Counter(
            "kvbm_evicted_blocks", "Blocks removed from a tier", ["tier"], registry=r
        )
        self.hits = Counter(
            "kvbm_prefix_hit_blocks",
            "Prompt blocks found cached, by the tier that held them",
            ["tier"],
            registry=r,
        )
        self.misses = Counter(
            "kvbm_prefix_miss_blocks", "Prompt blocks found on no tier", registry=r
        )
        self.offload_blocks = Counter(
            "kvbm_offload_blocks", "Blocks copied down a tier", ["src", "dst"], registry=r
        )
        self.offload_bytes = Counter(
            "kvbm_offload_bytes", "Bytes copied down a tier", ["src", "dst"], registry=r
        )
        self.onboard_blocks = Counter(
            "kvbm_onboard_blocks", "Blocks copied up a tier", ["src", "dst"], registry=r
        )
        self.onboard_bytes = Counter(
            "kvbm_onboard_bytes", "Bytes copied up a tier", ["src", "dst"], registry=r
        )
        self.transfer_bytes = Counter(
            "kvbm_transfer_bytes",
            "Bytes moved by the copier (measured, not derived from block counts)",
            ["src", "dst"],
            registry=r,
        )
        self.events = Counter(
            "kvbm_events_appended", "Events handed to the event log and publishers", registry=r
        )
        self.log_queue_depth = Gauge(
            "kvbm_event_log_queue_depth",
            "Events appended to the log and not yet committed",
            registry=r,
        )
        self.log_commit_lag = Gauge(
            "kvbm_event_log_commit_lag_seconds",
            "Age of the oldest event appended to the log and not yet committed (0 when none)",
            registry=r,
        )
        self.log_backpressure_waits = Gauge(
            "kvbm_event_log_backpressure_waits",
            "Times append waited for the log's writer (its backlog at its age or size bound)",
            registry=r,
        )
        self.log_backpressure_seconds = Gauge(
            "kvbm_event_log_backpressure_seconds",
            "Seconds append spent waiting for the log's writer",
            registry=r,
        )
        self.view_behind = Gauge(
            "kvbm_view_behind_events",
            "Events committed to the log that a view of it has not taken yet: the shared "
            "registry (view=redis) or the ZMQ stream (view=zmq)",
            ["view"],
            registry=r,
        )
        self.alloc_latency = Histogram(
            "kvbm_alloc_latency_seconds",
            "Time to place a request's blocks on G1 (match, onboard, allocate, register)",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.transfer_latency = Histogram(
            "kvbm_transfer_latency_seconds",
            "Time of one batched copy between tiers",
            ["src", "dst"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )

    # -- feeding --------------------------------------------------------------------------

    def observe_event(self, event: AnyEvent) -> None:
        """An event sink: counts the event and the blocks it moved, by tier."""
        self.events.inc()
        tier = event.tier.name
        if isinstance(event, Stored):
            n = len(event.blocks)
            self.stored.labels(tier).inc(n)
            self.allocations.labels(tier).inc(n)
        elif isinstance(event, Removed):
            self.evictions.labels(tier).inc(len(event.sequence_hashes))
        elif isinstance(event, Offloaded | Onboarded):
            n = len(event.blocks)
            src = event.src_tier.name
            self.allocations.labels(tier).inc(n)
            if isinstance(event, Offloaded):
                blocks, nbytes = self.offload_blocks, self.offload_bytes
            else:
                blocks, nbytes = self.onboard_blocks, self.onboard_bytes
            blocks.labels(src, tier).inc(n)
            nbytes.labels(src, tier).inc(n * self.bytes_per_block)

    __call__ = observe_event

    def observe_match(self, by_tier: Mapping[Tier, int], requested: int) -> None:
        """One prompt lookup: cached blocks per tier out of ``requested``."""
        found = 0
        for tier, n in by_tier.items():
            if n:
                self.hits.labels(tier.name).inc(n)
                found += n
        if requested > found:
            self.misses.inc(requested - found)

    def refresh(self, pools: Mapping[Tier, PoolView]) -> None:
        """Set the per-tier block gauges from the pools as they are now."""
        for tier, pool in pools.items():
            name = tier.name
            self.blocks.labels(name, "total").set(pool.capacity)
            self.blocks.labels(name, "active").set(pool.num_active)
            self.blocks.labels(name, "inactive").set(pool.num_inactive)
            self.blocks.labels(name, "free").set(pool.num_free)

    def watch_log(self, log: LogView) -> None:
        """Read the log's backlog, commit lag and back-pressure at every scrape.

        Back-pressure counters are gauges read from the log (which owns the counts), so a
        scrape shows exactly what the log counted, even for waits before ``watch_log``.
        """
        self.log_queue_depth.set_function(lambda: log.queue_depth)
        self.log_commit_lag.set_function(lambda: log.commit_lag)
        self.log_backpressure_waits.set_function(lambda: log.backpressure_waits)
        self.log_backpressure_seconds.set_function(lambda: log.backpressure_seconds)

    def watch_view(self, name: str, view: ViewProgress) -> None:
        """Read how far ``view`` (a publisher fed by the log's commits) is behind the log at
        every scrape: 0 while it keeps up, growing while Redis is down or a publisher lags."""
        self.view_behind.labels(name).set_function(lambda: view.behind)

    # -- exposing -------------------------------------------------------------------------

    def serve(self, port: int, addr: str = "127.0.0.1") -> tuple[WSGIServer, threading.Thread]:
        """Serve ``/metrics`` on ``addr:port`` from a daemon thread. Port 0 picks a free one
        (``server.server_port`` says which); ``server.shutdown()`` stops it."""
        if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
            raise ValueError(f"metrics port must be a TCP port 0..65535, got {port!r}")
        try:
            return start_http_server(port, addr=addr, registry=self.collector)
        except OSError as exc:  # in use, or not ours to bind: say which address
            raise OSError(
                exc.errno, f"cannot serve metrics on {addr}:{port}: {exc.strerror or exc}"
            ) from None
