"""The event log's durability, commit delay and queue bound are settings, so an operator sets
them where every other knob is set (``KVLEDGER_EVENT_LOG_*``) and BlockManager's log and
``kvledger simulate``'s log both honour them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from services import manager_settings

from kvledger import BlockManager
from kvledger.builder import open_worker
from kvledger.cli import CLI_SWITCH_INTERVAL_S, main
from kvledger.config import Settings, SettingsError
from kvledger.events.log import EventLog


def test_block_manager_opens_its_log_with_the_log_settings(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVLEDGER_EVENT_LOG_MAX_DELAY_S", "0.2")
    monkeypatch.setenv("KVLEDGER_EVENT_LOG_QUEUE_SIZE", "20000")
    manager = BlockManager(manager_settings(tmp_path, g1_blocks=8))
    try:
        log = manager.event_log
        assert log is not None
        assert (log.max_delay, log.queue_size) == (0.2, 20_000)
        assert log.max_lag == pytest.approx(0.2)  # "batch": appends wait at max_delay
    finally:
        manager.close()
    monkeypatch.setenv("KVLEDGER_EVENT_LOG_DURABILITY", "none")
    (tmp_path / "none").mkdir()
    manager = BlockManager(manager_settings(tmp_path / "none", g1_blocks=8))
    try:
        assert manager.event_log is not None and manager.event_log.max_lag is None
    finally:
        manager.close()


@pytest.mark.parametrize(
    ("variable", "value"),
    [
        ("KVLEDGER_EVENT_LOG_DURABILITY", "sometimes"),
        ("KVLEDGER_EVENT_LOG_MAX_DELAY_S", "0"),
        ("KVLEDGER_EVENT_LOG_MAX_DELAY_S", "nan"),
        ("KVLEDGER_EVENT_LOG_QUEUE_SIZE", "500"),
        ("KVLEDGER_SWITCH_INTERVAL_S", "0"),
        ("KVLEDGER_SWITCH_INTERVAL_S", "2"),
    ],
)
def test_bad_log_settings_are_named(
    monkeypatch: pytest.MonkeyPatch, variable: str, value: str
) -> None:
    monkeypatch.setenv(variable, value)
    with pytest.raises(SettingsError, match=variable):
        Settings.load()


def test_simulate_writes_its_log_with_the_log_settings(tmp_path: Path) -> None:
    """A run with fsync durability and a small queue still commits every event."""
    db = tmp_path / "run.db"
    env = {
        "KVLEDGER_EVENT_LOG_DURABILITY": "fsync",
        "KVLEDGER_EVENT_LOG_QUEUE_SIZE": "10000",
        "KVLEDGER_EVENT_LOG_MAX_DELAY_S": "0.01",
        "PATH": "/usr/bin:/bin",
    }
    cmd = [sys.executable, "-m", "kvledger.cli", "simulate", "--requests", "200",
           "--log", f"sqlite:///{db}", "--json"]  # fmt: skip
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["replay_matches"] is True and report["events_written"] > 0
    with EventLog(str(db), read_only=True) as log:
        assert log.summary().rows >= report["events_written"]
    bad = {**env, "KVLEDGER_EVENT_LOG_DURABILITY": "sometimes"}
    refused = subprocess.run(cmd, env=bad, capture_output=True, text=True, timeout=120)
    assert refused.returncode != 0 and "KVLEDGER_EVENT_LOG_DURABILITY" in refused.stderr


@pytest.fixture
def python_default_interval() -> None:
    """The test starts at Python's 5 ms (conftest gives the process its own back after)."""
    sys.setswitchinterval(0.005)


@pytest.mark.usefixtures("python_default_interval")
def test_a_worker_changes_the_switch_interval_only_when_its_settings_ask() -> None:
    open_worker(Settings.load(), log_events=False).close()
    assert sys.getswitchinterval() == pytest.approx(0.005)  # a library user's process
    open_worker(Settings.load(switch_interval_s=0.002), log_events=False).close()
    assert sys.getswitchinterval() == pytest.approx(0.002)


@pytest.mark.usefixtures("python_default_interval")
def test_the_cli_runs_its_commands_with_the_short_switch_interval(tmp_path: Path) -> None:
    assert main(["replay", str(tmp_path / "absent.db")]) != 0  # any command, even a failing one
    assert sys.getswitchinterval() == pytest.approx(CLI_SWITCH_INTERVAL_S)
