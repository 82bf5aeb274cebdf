"""When kvledger's vLLM offloading manager's events reach its durable log (runs in the vLLM
test venv): in batches while the scheduler is busy, and within the buffer's hold of the step
that made them when it goes quiet, with no further call."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from vllm.v1.kv_offload.base import OffloadKey, ReqContext, make_offload_key

from kvledger import replay
from kvledger.config import SettingsError
from kvledger.events.log import EventLog
from kvledger.events.types import Removed, Stored
from kvledger.integrations.vllm.manager import KvledgerOffloadingManager


def key(i: int) -> OffloadKey:
    return make_offload_key(i.to_bytes(8, "big"), 0)


def step(m: KvledgerOffloadingManager, name: str, keys: list[OffloadKey]) -> None:
    """One request stored and finished, then the scheduler's per-step take_events."""
    ctx = ReqContext(req_id=name)
    for i, k in enumerate(keys):
        ctx.set_offload_key_position(k, (i + 1) * 16)
    m.on_new_request(ctx)
    out = m.prepare_store(keys, ctx)
    assert out is not None
    m.complete_store(out.keys_to_store, ctx)
    m.on_request_finished(ctx)
    list(m.take_events())


def committed(log_url: str) -> list[type]:
    with EventLog(log_url, read_only=True) as log:
        return [type(e) for e in log.read()]


def test_a_quiet_schedulers_last_events_become_durable_without_another_call(
    tmp_path: Path,
) -> None:
    log_url = f"sqlite:///{tmp_path / 'quiet.db'}"
    m = KvledgerOffloadingManager(4, log_url=log_url)
    step(m, "a", [key(0), key(1), key(2)])
    step(m, "b", [key(3), key(4)])  # evicts one of a's blocks
    deadline = time.monotonic() + 20  # generous; the hold is 12.5 ms
    while committed(log_url) != [Stored, Removed, Stored]:
        assert time.monotonic() < deadline, f"the log holds {committed(log_url)}"
        time.sleep(0.01)
    assert replay(log_url) == m.state()
    m.shutdown()


def test_a_busy_schedulers_events_go_in_batches_and_replay(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a hold of 5 s (a quarter of the log's max_delay): the hand-overs below are the
    # buffer's batches, not the clock's, however slow a loaded machine runs the steps
    monkeypatch.setenv("KVLEDGER_EVENT_LOG_MAX_DELAY_S", "20")
    log_url = f"sqlite:///{tmp_path / 'busy.db'}"
    m = KvledgerOffloadingManager(64, log_url=log_url)
    log = m.event_log
    assert log is not None
    hand_overs = set()
    for r in range(400):
        step(m, str(r), [key(3 * r + i) for i in range(3)])
        hand_overs.add(log.appended)
    # 400 steps of one Stored (and from the 22nd on one Removed) each: the log was handed the
    # events a batch at a time, never one step's at a time
    assert len(hand_overs) < 400 // 50
    m.flush_log()
    assert replay(log_url) == m.state()
    m.shutdown()
    assert committed(log_url).count(Stored) == 400


def test_the_managers_own_log_takes_the_event_log_settings(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVLEDGER_EVENT_LOG_DURABILITY", "fsync")
    monkeypatch.setenv("KVLEDGER_EVENT_LOG_MAX_DELAY_S", "0.2")
    m = KvledgerOffloadingManager(4, log_url=f"sqlite:///{tmp_path / 'settings.db'}")
    log = m.event_log
    assert log is not None and log.max_delay == 0.2
    buffer = m._worker.buffer  # the builder's buffer in front of the log
    assert buffer is not None and buffer.max_hold == 0.05  # a quarter of it
    with log._db.connect() as conn:  # fsync: SQLite's synchronous=FULL
        assert conn.exec_driver_sql("PRAGMA synchronous").scalar() == 2
    m.shutdown()
    monkeypatch.setenv("KVLEDGER_EVENT_LOG_DURABILITY", "sometimes")
    with pytest.raises(SettingsError, match="KVLEDGER_EVENT_LOG_DURABILITY"):
        KvledgerOffloadingManager(4, log_url=f"sqlite:///{tmp_path / 'bad.db'}")
