"""Three ``kvledger worker`` processes sharing one Redis namespace."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import pytest
from services import redis_or_skip, wait_until

from kvledger.events.log import EventLog
from kvledger.events.shared.registry import SharedRegistry
from kvledger.events.shared.subscribe import decode_stream_entry
from kvledger.events.types import AnyEvent
from kvledger.registry.index import holders_from_state
from kvledger.registry.state import RegistryState

pytestmark = [pytest.mark.redis, pytest.mark.slow]
WORKERS = (1, 2, 3)
FLUSH_DB = 13  # owned by the flush test: it empties this whole database


def _registry(db: int, namespace: str, lease: float) -> SharedRegistry:
    client = redis_or_skip(f"redis://127.0.0.1:6379/{db}")
    return SharedRegistry(client, namespace, lease_ttl_s=lease)


def _spawn(
    reg: SharedRegistry, db: int, worker: int, log: Path, *extra: str
) -> subprocess.Popen[str]:
    cmd = [
        sys.executable, "-m", "kvledger.cli", "worker",
        "--worker-id", str(worker),
        "--redis-url", f"redis://127.0.0.1:6379/{db}",
        "--namespace", reg.namespace,
        "--log", str(log),
        "--lease-ttl", str(reg.lease_ttl_ms / 1000),
        "--blocks", "256", "--block-size", "16", "--seed", "7",
        "--linger", *extra,
    ]  # fmt: skip
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)


def _done_line(proc: subprocess.Popen[str]) -> dict[str, Any]:
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line, f"worker exited early with {proc.wait()}"
    report: dict[str, Any] = json.loads(line)
    assert report["done"] and report["drained"]
    return report


def _replayed(logs: dict[int, Path]) -> RegistryState:
    events: list[AnyEvent] = []
    for path in logs.values():
        with EventLog(str(path), read_only=True) as log:
            events.extend(log.read())
    return RegistryState.from_events(sorted(events, key=lambda e: (e.worker_id, e.event_id)))


@pytest.fixture
def procs() -> Iterator[dict[int, subprocess.Popen[str]]]:
    running: dict[int, subprocess.Popen[str]] = {}
    yield running
    for proc in running.values():
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def test_three_workers_equal_their_logs_even_across_a_flush(
    tmp_path: Path, procs: dict[int, subprocess.Popen[str]]
) -> None:
    reg = _registry(FLUSH_DB, "workers-flush", lease=10)
    reg.client.flushdb()
    logs = {w: tmp_path / f"w{w}.db" for w in WORKERS}
    for w in WORKERS:
        procs[w] = _spawn(reg, FLUSH_DB, w, logs[w], "--requests", "500", "--interval", "0.004")
    wait_until(lambda: all(reg.applied_event_id(w) >= 40 for w in WORKERS), "first events", 30)
    reg.client.flushdb()  # Redis loses everything mid-run
    reports = {w: _done_line(procs[w]) for w in WORKERS}
    assert all(r["caught_up"] > 0 for r in reports.values()), reports  # re-sent from their logs
    for w, report in reports.items():
        assert reg.applied_event_id(w) == report["last_event_id"]
        assert reg.applied_count(w) == int(report["last_event_id"]) + 1  # none applied twice
    assert reg.snapshot() == holders_from_state(_replayed(logs))
    seen: dict[int, list[int]] = {}
    entries = cast(list[tuple[bytes, dict[bytes, bytes]]], reg.client.xrange(reg.stream_key))
    for _id, fields in entries:
        for event in decode_stream_entry(fields[b"e"]):
            seen.setdefault(event.worker_id, []).append(event.event_id)
    for w, report in reports.items():  # the stream after the flush: each event exactly once
        assert seen[w] == list(range(int(report["last_event_id"]) + 1))
    for proc in procs.values():
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
    reg.client.flushdb()


def test_kill_9_worker_vanishes_after_its_lease(
    tmp_path: Path, procs: dict[int, subprocess.Popen[str]]
) -> None:
    reg = _registry(0, f"workers-kill-{uuid.uuid4().hex[:8]}", lease=1.0)
    try:
        logs = {w: tmp_path / f"w{w}.db" for w in WORKERS}
        for w in WORKERS:
            procs[w] = _spawn(reg, 0, w, logs[w], "--requests", "200", "--release-on-exit")
        for w in WORKERS:
            _done_line(procs[w])
        assert reg.snapshot() == holders_from_state(_replayed(logs))
        os.kill(procs[2].pid, signal.SIGKILL)
        procs[2].wait()
        # the survivors' heartbeats sweep expired leases
        wait_until(lambda: 2 not in reg.workers(), "worker 2's lease to lapse", 10)
        survivors = {w: logs[w] for w in (1, 3)}
        assert reg.snapshot() == holders_from_state(_replayed(survivors))
        assert all(2 not in holders for holders in reg.snapshot().values())
        for w in (1, 3):  # a clean exit drops the worker's entries at once
            procs[w].send_signal(signal.SIGTERM)
            assert procs[w].wait(timeout=20) == 0
        assert reg.snapshot() == {} and reg.workers() == set()
    finally:
        reg.delete_namespace()


def test_worker_takes_redis_url_and_namespace_from_the_settings(tmp_path: Path) -> None:
    """Without --redis-url/--namespace the worker publishes where KVLEDGER_REDIS_URL and
    KVLEDGER_REDIS_NAMESPACE say, as BlockManager does; a bad value is refused by name."""
    reg = _registry(0, f"workers-env-{uuid.uuid4().hex[:8]}", lease=10)
    log = tmp_path / "w.db"
    cmd = [
        sys.executable, "-m", "kvledger.cli", "worker", "--worker-id", "4", "--log", str(log),
        "--requests", "50", "--blocks", "128", "--seed", "3",
    ]  # fmt: skip
    env = {
        **os.environ,
        "KVLEDGER_REDIS_URL": "redis://127.0.0.1:6379/0",
        "KVLEDGER_REDIS_NAMESPACE": reg.namespace,
    }
    try:
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        assert reg.applied_event_id(4) == json.loads(done.stdout)["last_event_id"] >= 0
        assert reg.snapshot() == holders_from_state(_replayed({4: log}))
    finally:
        reg.delete_namespace()
    bad = {**env, "KVLEDGER_REDIS_NAMESPACE": ""}
    refused = subprocess.run(cmd, env=bad, capture_output=True, text=True, timeout=60)
    assert refused.returncode != 0
    assert "redis_namespace" in refused.stderr and "Traceback" not in refused.stderr
