"""One worker id, one owner; a restart brings the shared registry back in step with the log.

A worker claims its id with a fencing token under its lease: a second live claimant is refused
with one line naming the holder, and a process that lost its claim (stopped past its lease,
replaced, resumed) has its writes refused and stops publishing. At start the publisher compares
what every shard applied with its log: a registry ahead of the log (a log restored from a
backup, or deleted) or holding an event the log does not is replaced by the log's fold, which
routers reading the stream take as a baseline.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from event_streams import prompt_pool, worker_events
from services import REDIS_URL, manager_settings, redis_or_skip
from stream_router import stream_router
from worker_kills import holders_of, log_holders, wait_for, worker_command

from kvledger.events.log import EventLog
from kvledger.events.shared import SharedRegistry
from kvledger.events.shared.claims import ClaimLost, Holder, WorkerIdTaken
from kvledger.events.shared.publish import RedisPublisher
from kvledger.events.types import AnyEvent
from kvledger.registry.index import holders_from_state
from kvledger.registry.state import RegistryState

pytestmark = [pytest.mark.redis]


@pytest.fixture
def registry() -> Iterator[SharedRegistry]:
    reg = SharedRegistry(redis_or_skip(), f"claims-{uuid.uuid4().hex[:10]}", lease_ttl_s=10)
    yield reg
    reg.delete_namespace()


def _fold(events: list[AnyEvent], worker: int) -> dict[int, dict[int, int]]:
    return holders_of(holders_from_state(RegistryState.from_events(events)), worker)


def _publish(reg: SharedRegistry, log: EventLog, worker: int, events: list[AnyEvent]) -> None:
    """Run a publisher over ``log`` while ``events`` are appended, and stop it drained."""
    publisher = RedisPublisher(reg, worker, log=log).start()
    log.append_many(events)
    assert publisher.stop(drain_timeout=20), publisher.error


# -- claims -----------------------------------------------------------------------------


def test_a_second_live_claimant_is_refused_naming_the_holder(registry: SharedRegistry) -> None:
    other_host = Holder("another-host", 4242, time.time(), dp_rank=1)
    token = registry.claim(5, other_host)
    assert token > 0
    with pytest.raises(WorkerIdTaken) as refused:
        registry.claim(5)
    message = str(refused.value)
    assert "worker id 5" in message and "pid 4242 on another-host" in message
    assert "dp rank 1" in message and registry.namespace in message
    assert registry.claim(6) > 0  # another id is free
    registry.unclaim(5, token)
    assert registry.claim(5) > token  # given up: free again, with a newer token


def test_a_claim_left_by_a_dead_process_on_this_host_is_taken_over(
    registry: SharedRegistry,
) -> None:
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], text=True,
                          capture_output=True, check=True)  # fmt: skip
    dead = Holder.this_process()
    dead = Holder(dead.host, int(gone.stdout), time.time(), 0, None)
    old = registry.claim(7, dead)
    assert registry.claim(7) > old


def test_writes_of_a_fenced_token_are_refused_and_change_nothing(
    registry: SharedRegistry,
) -> None:
    events = worker_events(3, 8, 30, prompt_pool(3))
    old = registry.claim(8, Holder("elsewhere", 1, time.time()))
    registry.apply(8, events[:10], token=old)
    registry.client.delete(registry.keys.claim(8))  # the old holder's lease lapsed
    newer = registry.claim(8)
    before = registry.snapshot()
    with pytest.raises(ClaimLost):
        registry.apply(8, events[10:20], token=old)
    with pytest.raises(ClaimLost):
        registry.release(8, old)
    assert not registry.heartbeat(8, old)
    assert registry.snapshot() == before and registry.applied_event_id(8) == 9
    registry.apply(8, events[10:], token=newer)
    assert registry.heartbeat(8, newer)
    assert registry.snapshot() == _fold(events, 8)
    with pytest.raises(ClaimLost):  # unclaimed writers too, once the id has been claimed
        registry.apply(8, events[:1])


def test_redis_url_without_worker_id_warns_naming_the_setting(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, clean_env: None
) -> None:
    from kvledger import BlockManager

    namespace = f"warn-{uuid.uuid4().hex[:8]}"
    settings = manager_settings(tmp_path, redis_url=REDIS_URL, redis_namespace=namespace)
    try:
        with caplog.at_level(logging.WARNING, logger="kvledger.manager"), BlockManager(settings):
            pass
        assert any("worker_id" in r.getMessage() for r in caplog.records)
        caplog.clear()
        (tmp_path / "b").mkdir()
        named = manager_settings(
            tmp_path / "b", redis_url=REDIS_URL, redis_namespace=namespace, worker_id=1
        )
        with caplog.at_level(logging.WARNING, logger="kvledger.manager"), BlockManager(named):
            pass
        assert not any("worker_id" in r.getMessage() for r in caplog.records)
    finally:
        SharedRegistry(redis_or_skip(), namespace).delete_namespace()


# -- a restart reconciles ------------------------------------------------------------------


def test_a_log_restored_from_a_backup_replaces_the_registry_entries(
    registry: SharedRegistry, tmp_path: Path
) -> None:
    """The registry applied events the restored log no longer has: at start the publisher
    replaces the worker's entries with the log's fold, and routers reading the stream follow."""
    stream = worker_events(4, 3, 150, prompt_pool(4))
    events = stream[:100]
    path, backup = tmp_path / "w.db", tmp_path / "backup.db"
    with EventLog(str(path)) as log:
        _publish(registry, log, 3, events[:60])
    shutil.copy(path, backup)
    with EventLog(str(path)) as log:
        _publish(registry, log, 3, events[60:])
    index, sub = stream_router(registry, f"r-{uuid.uuid4().hex[:6]}", "r")
    sub.poll()
    assert index.holders() == _fold(events, 3)
    shutil.copy(backup, path)  # the log goes back to event 59; Redis is at the last one
    with EventLog(str(path)) as log:
        publisher = RedisPublisher(registry, 3, log=log).start()
        found = publisher.reconciled
        assert found is not None and found.action == "reset", found
        assert found.log_last == 59 and found.applied == len(events) - 1
        assert "beyond the log's last (59)" in found.line(3)
        assert registry.applied_event_id(3) == 59
        assert registry.snapshot() == _fold(events[:60], 3)
        sub.poll()
        assert index.holders() == _fold(events[:60], 3)
        more = stream[60:]  # the run goes on from 60, as the restored log says
        log.append_many(more)
        assert publisher.stop(drain_timeout=20)
    sub.poll()
    expected = _fold(events[:60] + more, 3)
    assert registry.snapshot() == expected and index.holders() == expected
    assert registry.applied_count(3) == 60 + len(more)  # as if every event was applied once


def test_a_deleted_log_empties_the_registry_entries(
    registry: SharedRegistry, tmp_path: Path
) -> None:
    events = worker_events(5, 4, 80, prompt_pool(5))
    path = tmp_path / "w.db"
    with EventLog(str(path)) as log:
        _publish(registry, log, 4, events)
    path.unlink()  # the registry holds events of a log that is gone
    with EventLog(str(path)) as log:
        publisher = RedisPublisher(registry, 4, log=log).start()
        assert publisher.reconciled is not None and publisher.reconciled.action == "reset"
        assert registry.snapshot() == {} and registry.applied_event_id(4) == -1
        other = worker_events(6, 4, 40, prompt_pool(6))  # a new history from event 0
        log.append_many(other)
        assert publisher.stop(drain_timeout=20)
    assert registry.snapshot() == _fold(other, 4)


def test_a_registry_holding_another_history_is_replaced(
    registry: SharedRegistry, tmp_path: Path
) -> None:
    """Same last event id in Redis and in the log, but not the same event (Redis restored
    from another run's backup, say): the checksum of the last applied record tells."""
    first = worker_events(5, 4, 80, prompt_pool(5))
    with EventLog(str(tmp_path / "first.db")) as log:
        _publish(registry, log, 4, first)
    other = worker_events(6, 4, 400, prompt_pool(6))[: len(first)]
    with EventLog(str(tmp_path / "other.db")) as log:
        log.append_many(other)
        log.flush()
        publisher = RedisPublisher(registry, 4, log=log).start()
        found = publisher.reconciled
        assert found is not None and found.action == "reset", found
        assert found.log_last == found.applied == len(first) - 1
        assert "differs from the log's" in found.reason
        assert publisher.stop(drain_timeout=20)
    assert registry.snapshot() == _fold(other, 4)
    with EventLog(str(tmp_path / "other.db")) as log:  # in step now: nothing to do
        publisher = RedisPublisher(registry, 4, log=log).start()
        assert publisher.reconciled is not None and publisher.reconciled.action == "in step"
        publisher.stop()


def test_a_long_log_is_sent_as_its_fold(registry: SharedRegistry, tmp_path: Path) -> None:
    """A registry that knows nothing of a worker whose log is long gets the fold in one call
    per shard, not every event again."""
    events = worker_events(7, 9, 200, prompt_pool(7))
    with EventLog(str(tmp_path / "w.db")) as log:
        log.append_many(events)
        log.flush()
        publisher = RedisPublisher(registry, 9, log=log, baseline_after=50).start()
        assert publisher.reconciled is not None and publisher.reconciled.action == "reset"
        assert publisher.stop(drain_timeout=20)
    assert publisher.caught_up == 0
    assert registry.snapshot() == _fold(events, 9)
    assert registry.applied_event_id(9) == len(events) - 1


# -- processes -----------------------------------------------------------------------------


def _worker(namespace: str, worker: int, log: Path, *extra: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        worker_command(REDIS_URL, namespace, worker, log, *extra),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


@pytest.mark.slow
def test_two_workers_with_one_id_the_second_is_refused(
    registry: SharedRegistry, tmp_path: Path
) -> None:
    first = _worker(registry.namespace, 5, tmp_path / "a.db", "--requests", "20", "--linger")
    try:
        assert first.stdout is not None
        assert json.loads(first.stdout.readline())["done"]
        second = subprocess.run(
            worker_command(REDIS_URL, registry.namespace, 5, tmp_path / "b.db"),
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert second.returncode != 0
        lines = second.stderr.strip().splitlines()
        assert len(lines) == 1 and "Traceback" not in second.stderr, second.stderr
        assert f"pid {first.pid}" in lines[0] and "worker id 5 is already taken" in lines[0]
    finally:
        first.send_signal(signal.SIGTERM)
        assert first.wait(timeout=30) == 0
    with EventLog(str(tmp_path / "a.db"), read_only=True) as log:
        assert registry.snapshot() == _fold(list(log.read()), 5)


@pytest.mark.slow
def test_a_worker_stopped_past_its_lease_is_fenced_off_when_it_resumes(
    tmp_path: Path,
) -> None:
    """SIGSTOP past the lease, a new worker takes the id, SIGCONT: the old one's writes are
    refused, it says so and stops; the registry holds the new worker's log only."""
    reg = SharedRegistry(redis_or_skip(), f"stop-{uuid.uuid4().hex[:8]}", lease_ttl_s=1)
    old_log, new_log = tmp_path / "old.db", tmp_path / "new.db"
    base = worker_command(REDIS_URL, reg.namespace, 6, old_log)
    lease = ["--lease-ttl", "1"]
    old = subprocess.Popen(
        [*base, *lease, "--requests", "1000000", "--interval", "0.002"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    new: subprocess.Popen[str] | None = None
    try:
        wait_for(lambda: reg.applied_event_id(6) > 50, 30, "the old worker to publish")
        os.kill(old.pid, signal.SIGSTOP)
        wait_for(lambda: reg.holder(6) is None, 10, "the old worker's claim to lapse")
        new = subprocess.Popen(
            [*worker_command(REDIS_URL, reg.namespace, 6, new_log), *lease,
             "--requests", "30", "--linger"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        assert new.stdout is not None
        report = json.loads(new.stdout.readline())
        assert report["done"] and report["drained"]
        os.kill(old.pid, signal.SIGCONT)
        assert old.wait(timeout=30) == 1
        assert old.stderr is not None
        said = old.stderr.read()
        assert "another process claimed this worker id" in said and "Traceback" not in said
        expected, last = log_holders(new_log, 6)
        assert reg.applied_event_id(6) == last
        assert holders_of(reg.snapshot(), 6) == expected
    finally:
        for proc in (old, new):
            if proc is not None and proc.poll() is None:
                os.kill(proc.pid, signal.SIGCONT)
                proc.send_signal(signal.SIGTERM)
                proc.wait(timeout=30)
        reg.delete_namespace()
