"""An operator's mistakes end a command with one clear line and a non-zero exit, never a
traceback: damaged files, wrong paths, databases and Redis that are missing or down, a full
disk, bad flags, settings and trace rows. Real files, real processes, real servers."""

from __future__ import annotations

import datetime as dt
import json
import os
import random
import resource
import sqlite3
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from services import PG_SERVER_URL, skip_without_postgres

from kvledger.cli import main
from kvledger.config import Settings, SettingsError, unknown_variables
from kvledger.events.log import EventLog
from kvledger.events.types import Tier
from kvledger.migrations import VERSION_TABLE
from kvledger.registry.emitter import EventEmitter
from kvledger.registry.hashing import TokenBlockSequence

LOG_COMMANDS = (["replay"], ["inspect"], ["tail", "--no-follow"])


pytestmark = pytest.mark.usefixtures("clean_env")


def kvledger(
    *args: str, cwd: Path, env: dict[str, str] | None = None, **kwargs: Any
) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("KVLEDGER_", "DYN_KVBM_"))}
    return subprocess.run(
        [sys.executable, "-m", "kvledger.cli", *args],
        cwd=cwd,
        env={**base, **(env or {})},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        **kwargs,
    )


def one_error_line(err: str, command: str) -> str:
    """The whole of stderr is one ``kvledger COMMAND: error: ...`` line; returns it."""
    assert "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(f"kvledger {command}: error: "), err
    return lines[0]


def refused(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """argv fails with exit status 2 and one error line, which is returned."""
    try:
        status = main(argv)
    except SystemExit as exc:  # argparse's refusal of a flag
        status = exc.code  # type: ignore[assignment]
    err = capsys.readouterr().err
    assert status == 2, err
    return one_error_line(err.splitlines()[-1] if "usage:" in err else err, argv[0])


def write_log(path: Path, events: int = 400, *, ts0: float | None = None) -> None:
    """A well-formed log of ``events`` Stored events of worker 0 (1 ms apart from ``ts0``)."""
    rng = random.Random(0)
    times = iter([ts0 + i * 0.001 for i in range(events)]) if ts0 is not None else None
    log = EventLog(str(path))
    emitter = EventEmitter(
        log.append, worker_id=0, clock=(lambda: next(times)) if times else time.time
    )
    for _ in range(events):
        seq = TokenBlockSequence([rng.randrange(32000) for _ in range(64)], 16)
        blocks = list(zip(seq.sequence_hashes, seq.local_hashes, strict=True))
        emitter.stored(Tier.G1, None, blocks)
    log.close()


# -- damaged files, wrong paths, databases that are missing or down ----------------------


@pytest.mark.parametrize("damage", ["random bytes", "cut in half"])
def test_a_damaged_sqlite_file_is_one_line_for_every_command(
    tmp_path: Path, damage: str, capsys: pytest.CaptureFixture[str]
) -> None:
    log = tmp_path / "events.db"
    if damage == "random bytes":
        log.write_bytes(random.Random(1).randbytes(20_000))
    else:
        write_log(log)
        data = log.read_bytes()
        log.write_bytes(data[: len(data) // 2])
    log.chmod(0o600)  # as kvledger makes its logs: the damage is the only mistake here
    for command in LOG_COMMANDS:
        line = refused([*command, str(log)], capsys)
        assert "damaged or is not a SQLite database" in line and "events.db" in line
    line = refused(["simulate", "--engine", "off", "--requests", "5", "--log", str(log)], capsys)
    assert "damaged or is not a SQLite database" in line


def test_a_folder_given_as_the_log_is_refused_before_anything_opens(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = tmp_path / "logs"
    folder.mkdir()
    for command in (*LOG_COMMANDS, ["simulate", "--requests", "5", "--log"]):
        line = refused([*command, str(folder)], capsys)
        assert f"{folder} is a folder; give the log file, e.g. {folder}/events.db" in line
    assert list(folder.iterdir()) == []


def test_postgresql_down_or_missing_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    down = "postgresql+psycopg://postgres@127.0.0.1:1/test"
    line = refused(["replay", down], capsys)
    assert "127.0.0.1" in line and "Connection refused" in line
    line = refused(["simulate", "--requests", "5", "--log", down], capsys)
    assert "Connection refused" in line

    skip_without_postgres()
    missing = f"{PG_SERVER_URL}/kvledger_no_such_database"
    line = refused(["inspect", missing], capsys)
    assert 'database "kvledger_no_such_database" does not exist' in line
    assert "create the database or fix the URL" in line


def test_db_current_on_a_missing_file_creates_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    line = refused(["db", "current", "--url", "missing_dir/x.db"], capsys)
    assert "missing_dir/x.db: no such event log" in line
    assert not (tmp_path / "missing_dir").exists()
    (tmp_path / "there").mkdir()
    refused(["db", "current", "--url", "there/x.db"], capsys)
    refused(["db", "downgrade", "base", "--url", "there/x.db"], capsys)
    assert list((tmp_path / "there").iterdir()) == []


def test_db_upgrade_refuses_a_revision_newer_than_it_knows(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    log = tmp_path / "events.db"
    write_log(log, 3)
    with sqlite3.connect(log) as conn:
        conn.execute(f"UPDATE {VERSION_TABLE} SET version_num = '9999'")
    for argv in (["db", "upgrade"], ["db", "downgrade", "0001"]):
        line = refused([*argv, "--url", str(log)], capsys)
        assert "revision '9999', which this kvledger does not know" in line
        assert "a newer kvledger wrote it" in line
    with sqlite3.connect(log) as conn:
        assert conn.execute(f"SELECT version_num FROM {VERSION_TABLE}").fetchall() == [("9999",)]


# -- flags, settings, environment ----------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["replay", "LOG", "--until", "-1"], "argument --until: must be 0 or more, got -1"),
        (["tail", "LOG", "-n", "-3"], "argument -n/--lines: must be 0 or more, got -3"),
        (["simulate", "--requests", "-3"], "argument --requests: must be 1 or more, got -3"),
        (["worker", "--worker-id", "-1", "--log", "LOG"], "argument --worker-id: must be 0 or"),
        (["worker", "--worker-id", "1", "--log", "LOG", "--shards", "0"], "--shards: must be 1"),
        (
            ["worker", "--worker-id", "1", "--log", "LOG", "--publish-linger", "nan"],
            "argument --publish-linger: must be 0 or more and under 60, got nan",
        ),
        (["simulate", "--metrics-port", "70000"], "a TCP port is 0..65535, got 70000"),
        (["replay", "LOG", "--until-ts", "nan"], "argument --until-ts: must be a finite number"),
        (["replay", "LOG", "--until-ts", "yesterday"], "or an ISO time such as"),
        (["replay", "LOG", "--verify", "nope.state"], "argument --verify: nope.state: no such"),
    ],
)
def test_bad_flags_are_refused_while_parsing(
    tmp_path: Path, argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    log = tmp_path / "events.db"
    argv = [str(log) if a == "LOG" else a for a in argv]
    assert message in refused(argv, capsys)
    assert not log.exists()


def test_dump_state_to_a_missing_folder_fails_before_the_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    log = tmp_path / "events.db"
    argv = ["simulate", "--log", str(log), "--dump-state", str(tmp_path / "nodir" / "x.state")]
    line = refused(argv, capsys)
    assert f"folder {tmp_path / 'nodir'} does not exist" in line
    assert not log.exists()  # nothing ran


@pytest.mark.parametrize("value", ["inf", "nan", "-1", "1e400"])
def test_a_size_that_is_not_a_finite_non_negative_number_is_refused(
    value: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("KVLEDGER_G2_GB", value)
    with pytest.raises(SettingsError, match=r"g2_gb \(KVLEDGER_G2_GB"):
        Settings.load()
    assert main(["simulate", "--requests", "5", "--log", "unused.db"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "g2_gb (KVLEDGER_G2_GB" in err
    assert ("finite" if value != "-1" else "greater than or equal to 0") in err


def test_a_misspelt_variable_gets_one_warning_naming_the_setting(tmp_path: Path) -> None:
    assert unknown_variables({"KVLEDGER_G2_BLOKS": "1", "KVLEDGER_G2_BLOCKS": "1"}) == [
        "KVLEDGER_G2_BLOKS is not a kvledger setting and is ignored; "
        "did you mean KVLEDGER_G2_BLOCKS?"
    ]
    others = {"KVLEDGER_SHARED_DATA": "x", "KVLEDGER_TEST_PG_HOST": "y"}
    switches = {"KVLEDGER_PYTHON_ENCODERS": "1", "KVLEDGER_PYTHON_SQLITE": "1"}
    assert unknown_variables({**others, **switches}) == []
    proc = kvledger(
        "simulate",
        "--engine",
        "off",
        "--requests",
        "5",
        "--log",
        "e.db",
        cwd=tmp_path,
        env={"KVLEDGER_G2_BLOKS": "64"},
    )
    assert proc.returncode == 0, proc.stderr
    warnings = [line for line in proc.stderr.splitlines() if "KVLEDGER_G2_BLOKS" in line]
    assert warnings == [
        "kvledger simulate: warning: KVLEDGER_G2_BLOKS is not a kvledger setting and is "
        "ignored; did you mean KVLEDGER_G2_BLOCKS?"
    ]


def test_until_ts_takes_the_times_inspect_prints(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    log = tmp_path / "events.db"
    write_log(log, 20, ts0=1_795_578_395.0004)  # rows 1 ms apart, none on a millisecond
    assert main(["inspect", str(log)]) == 0
    printed = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("time"))
    first, last = printed.split()[1], printed.split()[3]  # "time: FIRST .. LAST (span)"

    def folded(until_ts: str) -> int:
        assert main(["replay", str(log), "--json", "--until-ts", until_ts]) == 0
        return int(json.loads(capsys.readouterr().out)["rows_folded"])

    assert folded(last) == 20  # the last time printed includes the last event
    assert folded(first) == 1
    assert folded(str(1_795_578_395.0004 + 0.0095)) == 10  # seconds still work
    assert folded(last.replace("+00:00", "")) == 20  # no zone: UTC, as printed


@pytest.mark.parametrize(
    ("text", "start", "length"),
    [
        ("2026-11-25T03:46:35.324+00:00", "2026-11-25T03:46:35.324+00:00", 0.001),
        ("2026-11-25T03:46:35.3", "2026-11-25T03:46:35.3+00:00", 0.1),
        ("2026-11-25 03:46:35", "2026-11-25T03:46:35+00:00", 1),
        ("2026-11-25T04:46+01:00", "2026-11-25T03:46+00:00", 60),
        ("2026-11-25", "2026-11-25T00:00+00:00", 86400),
    ],
)
def test_an_iso_time_covers_its_last_digit(text: str, start: str, length: float) -> None:
    from kvledger.commands.args import timestamp

    begin = dt.datetime.fromisoformat(start).timestamp()
    assert timestamp(text) == pytest.approx(begin + length, abs=1e-6)
    assert begin + length * 0.999 < timestamp(text) < begin + length


# -- writer failures ---------------------------------------------------------------------


def test_a_duplicate_event_id_from_another_writer_is_one_line(tmp_path: Path) -> None:
    log = tmp_path / "events.db"
    EventLog(str(log)).close()
    with sqlite3.connect(log) as conn:  # another writer takes event 100 of worker 0 first
        conn.execute(
            "CREATE TRIGGER other_writer BEFORE INSERT ON events WHEN NEW.event_id = 100 BEGIN "
            "INSERT INTO events (worker, event_id, kind, tier, ts, payload) VALUES "
            "(NEW.worker, NEW.event_id, NEW.kind, NEW.tier, NEW.ts, NEW.payload); END"
        )
    proc = kvledger(
        "simulate", "--engine", "off", "--requests", "300", "--log", "events.db", cwd=tmp_path
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    line = one_error_line(proc.stderr, "simulate")
    assert "the event log writer failed" in line and "UNIQUE constraint failed" in line


def test_a_full_disk_is_one_line(tmp_path: Path) -> None:
    def small_disk() -> None:  # files may not grow past 100 KiB: what a full disk does
        resource.setrlimit(resource.RLIMIT_FSIZE, (100 * 1024, 100 * 1024))

    proc = kvledger(
        "simulate",
        "--engine",
        "off",
        "--requests",
        "2000",
        "--log",
        "events.db",
        cwd=tmp_path,
        preexec_fn=small_disk,
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    line = one_error_line(proc.stderr, "simulate")
    assert "the event log writer failed" in line and "appended events were not stored" in line


# -- traces ------------------------------------------------------------------------------

GOOD_ROW = '{"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [1, 2]}'


@pytest.mark.parametrize(
    ("row", "message"),
    [
        (GOOD_ROW.replace('"timestamp": 0', '"timestamp": NaN'), "finite number of ms"),
        (GOOD_ROW.replace('"timestamp": 0', '"timestamp": Infinity'), "finite number of ms"),
        (GOOD_ROW.replace('"timestamp": 0', '"timestamp": 1e400'), "finite number of ms"),
        (GOOD_ROW.replace("[1, 2]", "[1, 2.5]"), "hash_ids must be whole numbers"),
        (GOOD_ROW.replace("[1, 2]", "[1, true]"), "hash_ids must be whole numbers"),
        (GOOD_ROW.replace("[1, 2]", "[1, -2]"), "hash_ids must be whole numbers"),
        (GOOD_ROW.replace("[1, 2]", f"[1, {1 << 64}]"), "hash_ids must be whole numbers"),
        # two rows on one line: the whole-file read would take them as two, the line refuses
        (f"{GOOD_ROW}, {GOOD_ROW}", "Extra data"),
    ],
)
def test_a_bad_trace_row_names_file_and_line(
    tmp_path: Path, row: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text(f"{GOOD_ROW}\n{row}\n")
    line = refused(["simulate", "--trace", str(trace), "--log", str(tmp_path / "e.db")], capsys)
    assert f"{trace}:2: not a Mooncake trace row" in line
    assert message.replace(" of ms", " of milliseconds") in line


# -- pipes, Redis, bugs -----------------------------------------------------------------------


def test_a_closed_pipe_ends_quietly(tmp_path: Path) -> None:
    log = tmp_path / "events.db"
    write_log(log, 2000)
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVLEDGER_")}
    for command in (f"inspect {log}", f"tail -n 2000 --no-follow {log}"):
        proc = subprocess.run(
            f"{sys.executable} -m kvledger.cli {command} | head -1",
            shell=True,
            capture_output=True,
            text=True,
            env=env,
            timeout=60,
            check=False,
        )
        assert proc.stdout.count("\n") == 1
        assert proc.stderr == "", proc.stderr
    # The reader gone before anything is written: the exit flush meets the closed pipe.
    reader = subprocess.Popen(
        [sys.executable, "-m", "kvledger.cli", "inspect", str(log)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
    )
    assert reader.stdout is not None and reader.stderr is not None
    reader.stdout.close()
    err = reader.stderr.read().decode()
    assert reader.wait(60) == 1
    assert err == "", err


def test_a_worker_with_redis_down_says_so_once(tmp_path: Path) -> None:
    proc = kvledger(
        "worker",
        "--worker-id",
        "3",
        "--log",
        "w.db",
        "--requests",
        "20",
        "--redis-url",
        "redis://127.0.0.1:1/0",
        "--publish-timeout",
        "1",
        cwd=tmp_path,
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    down = [line for line in lines if "unreachable" in line]
    assert len(down) == 1, proc.stderr
    assert "127.0.0.1:1" in down[0] and "retrying every 0.2 s" in down[0]
    assert len(lines) == 2 and "after waiting 1 s (--publish-timeout)" in lines[1]
    assert "w.db only" in lines[1]
    assert json.loads(proc.stdout)["last_event_id"] == 19
    with EventLog(str(tmp_path / "w.db"), read_only=True) as log:
        assert log.last_event_id(3) == 19  # the log has every event Redis missed


def test_an_unknown_exception_keeps_its_traceback(monkeypatch: pytest.MonkeyPatch) -> None:
    import kvledger.commands.demo as demo

    def bug(_args: object) -> int:
        raise KeyError("a bug, not a mistake")

    monkeypatch.setattr(demo, "run", bug)
    with pytest.raises(KeyError, match="a bug"):
        main(["demo"])
