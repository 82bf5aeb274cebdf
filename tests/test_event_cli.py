"""``kvledger db|replay|inspect|tail`` on real logs."""

from __future__ import annotations

import io
import json
import threading
import time
from pathlib import Path

import pytest
from event_streams import tee

from kvledger.cli import main
from kvledger.events.log import EventLog
from kvledger.events.log.replay import replay_report, save_state
from kvledger.events.types import AnyEvent, BlockInfo, Lookup, Tier
from kvledger.migrations import runner
from kvledger.registry.emitter import EventEmitter
from kvledger.registry.state import RegistryState


def write_log(url: str, n: int = 30, worker: int = 0) -> list[AnyEvent]:
    seen: list[AnyEvent] = []
    with EventLog(url) as log:
        emitter = EventEmitter(tee(log.append, seen.append), worker_id=worker)
        for i in range(n):
            emitter.stored(Tier.G1, None if i % 4 == 0 else i - 1, [(i, i * 3)])
            if i % 3 == 0:
                emitter.removed(Tier.G1, [i])
            if i % 5 == 0:
                emitter.copied(Tier.G1, Tier.G2, [BlockInfo(i, i * 3, None)])
    return seen


def test_replay_json_counts_and_digest(log_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    seen = write_log(log_url)
    assert main(["replay", log_url, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    want = RegistryState.from_events(seen)
    assert out["digest"] == want.digest()
    assert out["counts"] == {f"0:{t.name}": n for (_w, t), n in want.counts().items()}
    assert main(["replay", log_url, "--until", "7", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["digest"] == RegistryState.from_events(seen[:8]).digest()
    assert out["last_event_id"] == {"0": 7}


def test_replay_text_and_verify(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = str(tmp_path / "run.db")
    seen = write_log(f"sqlite:///{path}")
    live = RegistryState.from_events(seen)
    save_state(tmp_path / "live.state", live)
    assert main(["replay", path, "--verify", str(tmp_path / "live.state")]) == 0
    text = capsys.readouterr().out
    assert f"digest {live.digest()}" in text and "states agree" in text
    live.tiers[(0, Tier.G2)].clear()
    save_state(tmp_path / "other.state", live)
    assert main(["replay", path, "--verify", str(tmp_path / "other.state")]) == 1
    assert "STATES DIFFER" in capsys.readouterr().out


def test_inspect(log_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    seen = write_log(log_url, worker=4)
    assert main(["inspect", log_url, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["events"] == len(seen)
    assert out["workers"] == {"4": {"events": len(seen), "first_id": 0, "last_id": len(seen) - 1}}
    assert out["by_kind_tier"]["stored:G1"] == 30
    assert out["time_span"] == [seen[0].ts, seen[-1].ts]
    assert main(["inspect", log_url]) == 0
    assert "worker 4: " in capsys.readouterr().out


def test_tail_prints_then_follows(log_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    write_log(log_url, n=4)
    result: list[int] = []
    follower = threading.Thread(
        target=lambda: result.append(
            main(["tail", log_url, "-n", "2", "--interval", "0.02", "--max-events", "3"])
        )
    )
    follower.start()
    printed = ""
    for _ in range(500):  # the first lines are out: everything after them is new
        printed += capsys.readouterr().out
        if printed.count("\n") >= 2:
            break
        time.sleep(0.02)
    with EventLog(log_url) as log:
        emitter = EventEmitter(log.append, first_event_id=log.last_event_id(0) + 1)
        for i in range(3):
            emitter.removed(Tier.G1, [100 + i])
    follower.join(30)
    assert result == [0]
    lines = (printed + capsys.readouterr().out).splitlines()
    assert len(lines) == 5
    assert all("removed 1: " in line for line in lines[2:])
    assert lines[-1].split()[0] == str(int(lines[0].split()[0]) + 4)


def test_tail_counts_events_not_the_lookup_records_between_them(
    log_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    seen = write_log(log_url, n=4)
    with EventLog(log_url) as log:  # a run that logs lookups ends with lookup records
        for request in range(3):
            log.append(
                Lookup(
                    event_id=request,
                    worker_id=0,
                    dp_rank=0,
                    tier=Tier.G1,
                    ts=9.0,
                    request_id=request,
                    num_tokens=16,
                    start=0,
                    hits=(1, 0, 0),
                    sequence_hashes=(1,),
                )
            )
    assert main(["tail", log_url, "-n", "2", "--no-follow"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2
    assert [line.split()[1] for line in lines] == [f"w0#{e.event_id}" for e in seen[-2:]]
    assert main(["tail", log_url, "-n", "100", "--no-follow"]) == 0
    assert len(capsys.readouterr().out.splitlines()) == len(seen)
    assert main(["tail", log_url, "-n", "0", "--no-follow"]) == 0
    assert capsys.readouterr().out == ""


def test_db_commands(log_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["db", "upgrade", "--url", log_url, "--revision", "0001"]) == 0
    assert main(["db", "current", "--url", log_url]) == 1
    assert "0001 (this kvledger expects 0002)" in capsys.readouterr().out
    # A log one revision behind: replay says which command fixes it.
    assert main(["replay", log_url]) == 2
    assert "kvledger db upgrade --url" in capsys.readouterr().err
    assert main(["db", "upgrade", "--url", log_url]) == 0
    assert main(["db", "current", "--url", log_url]) == 0
    assert "0002 (up to date)" in capsys.readouterr().out
    assert main(["db", "downgrade", "base", "--url", log_url]) == 0
    assert runner.current(log_url) is None
    assert main(["db", "history"]) == 0
    assert "0001 -> 0002 (head)" in capsys.readouterr().out


def test_missing_log_is_a_clear_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for command in ("replay", "inspect", "tail"):
        assert main([command, str(tmp_path / "nope.db")]) == 2
        assert "no event log at" in capsys.readouterr().err


def test_replay_reports_progress_per_chunk_and_draws_it_on_a_terminal(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    terminal: io.StringIO,
) -> None:
    """A long replay calls back after every chunk with a growing position, and the command shows
    it as a bar on a terminal (and prints nothing extra when stderr is not one)."""
    path = str(tmp_path / "long.db")
    events: list[AnyEvent] = []
    emitter = EventEmitter(events.append, worker_id=0)
    for i in range(25_000):
        emitter.stored(Tier.G1, None, [(i, i)])
    with EventLog(path) as log:
        log.append_many(events)
    seen: list[int] = []
    report = replay_report(
        path, use_checkpoints=False, on_progress=lambda r: seen.append(r.rows_folded)
    )
    assert seen == [10_000, 20_000, 25_000] and report.rows_folded == 25_000

    monkeypatch.setattr("sys.stderr", terminal)
    assert main(["replay", path, "--no-checkpoints"]) == 0
    assert terminal.getvalue().startswith("\rreplay [")
    assert terminal.getvalue().endswith("] 25000/25000 rows\n")
    assert "replayed 25000 events" in capsys.readouterr().out
    monkeypatch.setattr("sys.stderr", io.StringIO())
    assert main(["replay", path, "--no-checkpoints"]) == 0
    assert capsys.readouterr().err == ""
