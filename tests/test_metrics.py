"""kvbm_* metrics scraped from the real HTTP endpoint after a simulated run."""

from __future__ import annotations

import sqlite3
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvledger.events.log import EventLog
from kvledger.events.types import Tier
from kvledger.metrics import Metrics
from kvledger.mocker.engine_off import replay_cache
from kvledger.mocker.metered import MeteredCache
from kvledger.mocker.stats import EventCounter, SimStats
from kvledger.mocker.traces import synthetic
from kvledger.registry.emitter import EventEmitter
from kvledger.registry.tiered import TieredPools

BYTES_PER_BLOCK = 4096
Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(port: int) -> Samples:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


@pytest.fixture
def served() -> Iterator[tuple[Metrics, int]]:
    metrics = Metrics(bytes_per_block=BYTES_PER_BLOCK)
    server, thread = metrics.serve(0)  # a free port
    yield metrics, server.server_port
    server.shutdown()
    thread.join(timeout=5)


def run_simulation(metrics: Metrics) -> tuple[EventCounter, SimStats, TieredPools]:
    counter = EventCounter(metrics.observe_event)
    tiered = TieredPools(
        96, 48, 256, policy="lru", offload_filter="always", emitter=EventEmitter(counter)
    )
    cache = MeteredCache(tiered, metrics)
    stats = replay_cache(synthetic(200, sessions=20, seed=1), cache, 16)
    metrics.refresh(tiered.pools)
    return counter, stats, tiered


def test_scraped_counters_agree_with_the_event_stream(served: tuple[Metrics, int]) -> None:
    metrics, port = served
    counter, stats, _ = run_simulation(metrics)
    s = scrape(port)
    assert value(s, "kvbm_events_appended_total") == counter.events
    for tier in (Tier.G1, Tier.G2, Tier.G3):
        t = tier.name
        assert value(s, "kvbm_evicted_blocks_total", tier=t) == counter.removed_blocks[tier]
        assert value(s, "kvbm_prefix_hit_blocks_total", tier=t) == stats.hits_by_tier[tier]
    assert value(s, "kvbm_stored_blocks_total", tier="G1") == counter.stored_blocks[Tier.G1]
    assert counter.removed_blocks[Tier.G1] > 0 and stats.hits_by_tier[Tier.G3] > 0
    missed = stats.blocks_requested - stats.blocks_hit
    assert value(s, "kvbm_prefix_miss_blocks_total") == missed
    to_g2 = value(s, "kvbm_offload_blocks_total", src="G1", dst="G2")
    assert to_g2 == counter.offloaded_blocks[Tier.G2] > 0
    assert value(s, "kvbm_offload_bytes_total", src="G1", dst="G2") == to_g2 * BYTES_PER_BLOCK
    onboarded = sum(
        value(s, "kvbm_onboard_blocks_total", src=src, dst="G1") for src in ("G2", "G3")
    )
    assert onboarded == sum(counter.onboarded_blocks.values()) > 0
    placed_on_g2 = value(s, "kvbm_allocated_blocks_total", tier="G2")
    assert placed_on_g2 == counter.offloaded_blocks[Tier.G2]
    assert value(s, "kvbm_alloc_latency_seconds_count") == 200  # one admission per request


def test_block_gauges_follow_the_pools(served: tuple[Metrics, int]) -> None:
    metrics, port = served
    _, _, tiered = run_simulation(metrics)
    s = scrape(port)
    for tier, pool in tiered.pools.items():
        t = tier.name
        total = value(s, "kvbm_blocks", tier=t, state="total")
        assert total == pool.capacity
        parts = [value(s, "kvbm_blocks", tier=t, state=st) for st in ("active", "inactive", "free")]
        assert sum(parts) == total
        assert parts[0] == 0  # every request released its blocks
        assert parts[1] == pool.num_registered  # what stays cached is inactive
    held = tiered.g1.match(list(tiered.g1.resident_blocks())[:5])
    metrics.refresh(tiered.pools)
    assert value(scrape(port), "kvbm_blocks", tier="G1", state="active") == len(held) > 0


def test_latencies_and_measured_bytes(served: tuple[Metrics, int]) -> None:
    metrics, port = served
    metrics.transfer_latency.labels("G2", "G1").observe(0.003)
    metrics.transfer_latency.labels("G2", "G1").observe(0.2)
    metrics.transfer_bytes.labels("G2", "G1").inc(3 * BYTES_PER_BLOCK)
    metrics.alloc_latency.observe(2e-5)
    s = scrape(port)
    labels = {"src": "G2", "dst": "G1"}
    assert value(s, "kvbm_transfer_latency_seconds_count", **labels) == 2
    assert value(s, "kvbm_transfer_latency_seconds_bucket", **labels, le="0.005") == 1
    assert value(s, "kvbm_transfer_latency_seconds_sum", **labels) == pytest.approx(0.203)
    assert value(s, "kvbm_transfer_bytes_total", **labels) == 3 * BYTES_PER_BLOCK
    assert value(s, "kvbm_alloc_latency_seconds_bucket", le="5e-05") == 1


def test_a_stalled_log_writer_shows_as_backlog_lag_and_back_pressure(
    served: tuple[Metrics, int], tmp_path: Path
) -> None:
    """A real log whose writer cannot commit (another connection holds SQLite's write lock):
    the scrape shows the uncommitted backlog and its age while it lasts, then the producer's
    back-pressure waits, and a backlog of zero once the lock is gone."""
    metrics, port = served
    url = f"sqlite:///{tmp_path / 'events.db'}"
    with EventLog(url, max_delay=0.01) as log:
        metrics.watch_log(log)
        emitter = EventEmitter(log.append)
        emitter.stored(Tier.G1, None, [(0, 0)])
        log.flush()
        blocker = sqlite3.connect(tmp_path / "events.db", isolation_level=None)
        blocker.execute("BEGIN IMMEDIATE")

        stop = threading.Event()

        def produce() -> None:
            # until told to stop: a fixed count can all be appended within max_delay on a
            # quiet machine, and then no append ever has to wait
            i = 1
            while not stop.is_set():
                emitter.stored(Tier.G1, None, [(i, i)])
                i += 1

        producer = threading.Thread(target=produce)
        producer.start()
        try:
            deadline = time.monotonic() + 10
            while log.backpressure_waits == 0 and time.monotonic() < deadline:
                time.sleep(0.01)
            s = scrape(port)
            assert value(s, "kvbm_event_log_queue_depth") >= 1
            assert value(s, "kvbm_event_log_commit_lag_seconds") > 0
            assert value(s, "kvbm_event_log_backpressure_waits") >= 1
        finally:
            stop.set()
            blocker.rollback()
            blocker.close()
        producer.join(30)
        assert not producer.is_alive()
        log.flush()
        s = scrape(port)
        assert value(s, "kvbm_event_log_queue_depth") == 0
        assert value(s, "kvbm_event_log_commit_lag_seconds") == 0
        assert value(s, "kvbm_event_log_backpressure_seconds") > 0


def test_each_metrics_object_has_its_own_registry() -> None:
    a, b = Metrics(), Metrics()  # the same names twice: no clash, no shared counts
    a.events.inc(5)
    assert b.collector.get_sample_value("kvbm_events_appended_total") == 0
    assert a.collector.get_sample_value("kvbm_events_appended_total") == 5
    names = {m.name for m in a.collector.collect()}
    assert names and all(n.startswith("kvbm_") for n in names)


@pytest.mark.parametrize("port", [70000, -1, True])
def test_a_port_out_of_range_is_refused_by_name(port: int) -> None:
    with pytest.raises(ValueError, match=r"metrics port must be a TCP port 0\.\.65535"):
        Metrics().serve(port)


def test_a_port_in_use_names_the_address(served: tuple[Metrics, int]) -> None:
    _, port = served
    with pytest.raises(OSError, match=rf"cannot serve metrics on 127\.0\.0\.1:{port}: "):
        Metrics().serve(port)
