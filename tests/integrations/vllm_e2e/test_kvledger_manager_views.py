"""kvledger's vLLM offloading manager gets what every kvledger entry point gets from the one
builder (runs in the vLLM test venv): its G2 blocks in the shared registry, fed by its log's
commits, and kvledger's Prometheus metrics; and vLLM's own KV event stream (vLLM publishes its
own ZMQ events) agrees with kvledger's log."""

from __future__ import annotations

import urllib.request
import uuid
from pathlib import Path

import pytest
import redis
from tests.kvledger.test_kvledger_manager_log import key, step
from vllm.v1.kv_offload.base import Medium, ReqContext

from kvledger import replay
from kvledger.events.shared import SharedRegistry
from kvledger.events.types import Tier
from kvledger.integrations.vllm.keys import key_hash
from kvledger.integrations.vllm.manager import KvledgerOffloadingManager
from kvledger.registry.index import holders_from_state

REDIS_URL = "redis://127.0.0.1:6379/0"


def _redis_or_skip() -> redis.Redis:
    client = redis.Redis.from_url(REDIS_URL)
    try:
        client.ping()
    except redis.ConnectionError:
        pytest.skip(f"no Redis at {REDIS_URL}")
    return client


def test_its_g2_blocks_reach_the_shared_registry_as_its_log_folds(tmp_path: Path) -> None:
    client = _redis_or_skip()
    namespace = f"vllm-{uuid.uuid4().hex[:8]}"
    log_url = f"sqlite:///{tmp_path / 'w.db'}"
    m = KvledgerOffloadingManager(
        8, log_url=log_url, worker_id=3, redis_url=REDIS_URL, redis_namespace=namespace
    )
    registry = SharedRegistry(client, namespace)
    try:
        for r in range(6):  # 12 blocks through 8 slots: stores and evictions
            step(m, str(r), [key(2 * r), key(2 * r + 1)])
        m.flush_log()
        publisher = m._worker.publisher
        assert publisher is not None and publisher.wait_applied(20), publisher
        assert publisher.token > 0  # the worker id was claimed
        assert registry.snapshot() == holders_from_state(replay(log_url))
        assert registry.applied_event_id(3) == m._emitter.next_event_id - 1
    finally:
        m.shutdown()
        registry.delete_namespace()


def test_it_serves_kvledgers_metrics(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVLEDGER_METRICS_PORT", "0")  # a free port, on loopback
    m = KvledgerOffloadingManager(4, log_url=f"sqlite:///{tmp_path / 'm.db'}")
    try:
        for r in range(3):
            step(m, str(r), [key(2 * r), key(2 * r + 1)])
        m.flush_log()
        server = m._worker._server
        assert server is not None and server.server_address[0] == "127.0.0.1"
        url = f"http://127.0.0.1:{server.server_port}/metrics"
        with urllib.request.urlopen(url, timeout=5) as response:
            text = response.read().decode()
        assert "kvbm_event_log_queue_depth 0.0" in text
        assert 'kvbm_allocated_blocks_total{tier="G2"} 6.0' in text  # six blocks stored
        assert 'kvbm_evicted_blocks_total{tier="G2"} 2.0' in text  # two pushed out of 4 slots
    finally:
        m.shutdown()


def test_vllms_own_event_stream_and_its_log_tell_the_same_story(tmp_path: Path) -> None:
    """vLLM publishes its own KV events (from ``take_events``): what they say the CPU tier
    holds is what kvledger's log replays to, block for block."""
    log_url = f"sqlite:///{tmp_path / 'e.db'}"
    m = KvledgerOffloadingManager(4, enable_events=True, log_url=log_url)
    held: set[bytes] = set()
    try:
        for r in range(5):  # 10 blocks through 4 slots
            keys = [key(2 * r), key(2 * r + 1)]
            ctx = ReqContext(req_id=str(r))
            for i, k in enumerate(keys):
                ctx.set_offload_key_position(k, (i + 1) * 16)
            m.on_new_request(ctx)
            out = m.prepare_store(keys, ctx)
            assert out is not None
            m.complete_store(out.keys_to_store, ctx)
            m.on_request_finished(ctx)
            for event in m.take_events():
                assert event.medium == Medium.CPU
                if event.removed:
                    held.difference_update(event.keys)
                else:
                    held.update(event.keys)
        m.flush_log()
        logged = set(replay(log_url).snapshot().get((0, Tier.G2), {}))
        assert logged == {key_hash(k) for k in held} and len(held) == 4
    finally:
        m.shutdown()
