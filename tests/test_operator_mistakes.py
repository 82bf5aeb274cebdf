"""More operator mistakes, each met with one line naming the key, file or value, a non-zero
exit, no traceback and nothing lost: a database whose driver is missing, traces that are not
text or not rows, a full disk under the library, two processes as one worker; and the words
and displays the commands share (counts, an empty bound, progress)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from services import PG_SERVER_URL, skip_without_postgres, tiny_tmpfs

from kvledger.cli import main
from kvledger.config import Settings, SettingsError
from kvledger.events.log import EventLog
from kvledger.events.types import RunInfo, lookup_stream

pytestmark = pytest.mark.usefixtures("clean_env")


def run_cli(
    *args: str, cwd: Path, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("KVLEDGER_", "DYN_KVBM_"))}
    return subprocess.run(
        [sys.executable, "-m", "kvledger.cli", *args],
        cwd=cwd,
        env={**base, **(env or {})},
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )


def one_line(proc: subprocess.CompletedProcess[str], command: str) -> str:
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = [ln for ln in proc.stderr.strip().splitlines() if not ln.startswith("usage:")]
    lines = [ln for ln in lines if not ln.startswith(" ")]  # argparse's usage continues
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith(f"kvledger {command}: error: "), proc.stderr
    return lines[0]


# -- databases ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "argv",
    [
        ["db", "current", "--url"],
        ["replay"],
        ["simulate", "--requests", "5", "--log"],
    ],
)
def test_a_database_whose_driver_is_missing_is_one_line(tmp_path: Path, argv: list[str]) -> None:
    command = " ".join(argv[:2]) if argv[0] == "db" else argv[0]
    line = one_line(run_cli(*argv, "mysql://u:secret@127.0.0.1/x", cwd=tmp_path), command)
    assert "mysql://u:***@127.0.0.1/x: the mysql driver is not installed" in line
    assert "secret" not in line
    assert list(tmp_path.iterdir()) == []


def test_a_log_url_setting_whose_driver_is_missing_names_the_setting(tmp_path: Path) -> None:
    proc = run_cli(
        "simulate", "--requests", "5", cwd=tmp_path,
        env={"KVLEDGER_EVENT_LOG_URL": "mysql://u:secret@127.0.0.1/x"},
    )  # fmt: skip
    line = one_line(proc, "simulate")
    assert "event_log_url (KVLEDGER_EVENT_LOG_URL)" in line and "mysql driver" in line
    assert "secret" not in line


def test_several_bad_settings_get_one_line_each(tmp_path: Path) -> None:
    proc = run_cli(
        "simulate", "--requests", "5", cwd=tmp_path,
        env={"KVLEDGER_G2_GB": "lots", "KVLEDGER_TOKEN_IDS": "some"},
    )  # fmt: skip
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 2, proc.stderr
    assert all(ln.startswith("kvledger simulate: error: invalid kvledger setting ") for ln in lines)
    assert "g2_gb (KVLEDGER_G2_GB" in lines[0] and "token_ids (KVLEDGER_TOKEN_IDS)" in lines[1]


def test_a_printed_command_with_a_hidden_password_says_so(pg_database: str) -> None:
    skip_without_postgres()
    url = f"{PG_SERVER_URL}/{pg_database}".replace("://postgres@", "://postgres:secret@")
    assert ":secret@" in url, "the test server's user is not postgres"
    line = one_line(run_cli("inspect", url, cwd=Path.cwd()), "inspect")
    assert "holds no event log" in line and "kvledger db upgrade --url" in line
    assert ":***@" in line and "secret" not in line
    assert "the password is shown as ***: put yours back before running it" in line


# -- traces ------------------------------------------------------------------------------

GOOD_ROW = '{"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [1, 2]}'


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (GOOD_ROW.replace("600", "1024.5"), ":1: not a Mooncake trace row (input_length must be "),
        (
            GOOD_ROW.replace('"output_length": 5', '"output_length": true'),
            ":1: not a Mooncake trace row (output_length must be a whole number, got True)",
        ),
        ("[1,2,3]", ":1: not a Mooncake trace row (a JSON object with timestamp"),
        (GOOD_ROW.encode("utf-16"), ": not a Mooncake trace: byte 0 is not UTF-8 text"),
        (bytes(range(256)) * 8, ": not a Mooncake trace: byte 128 is not UTF-8 text"),
    ],
)
def test_a_bad_trace_is_one_line_naming_the_file(
    tmp_path: Path, content: str | bytes, message: str
) -> None:
    trace = tmp_path / "trace.jsonl"
    if isinstance(content, str):
        trace.write_text(content + "\n")
    else:
        trace.write_bytes(content)
    line = one_line(
        run_cli("simulate", "--trace", str(trace), "--no-log", cwd=tmp_path), "simulate"
    )
    assert f"{trace}{message}" in line, line


# -- the library on a full disk; two processes as one worker ------------------------------

FULL_DISK = """
import json, random, resource, signal, sys
from kvledger import BlockManager, Settings
from kvledger.events.log import EventLogError

signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG from write(), as a full disk gives
settings = Settings.load(
    block_size=16, num_layers=2, inner_dim=64, g1_blocks=16, g2_blocks=16, g3_blocks=8,
    offload_filter="always", data_dir=sys.argv[1], event_log_durability="none",
)
manager = BlockManager(settings)  # G3 reserved before the limit: the log is what fills up
resource.setrlimit(resource.RLIMIT_FSIZE, (400_000, 400_000))
rng = random.Random(0)
error = None
for _ in range(5000):
    try:
        seq = manager.sequence([rng.randrange(30000) for _ in range(64)])
        held = manager.onboard(seq)
        held += manager.register(manager.allocate(len(seq) - len(held)), seq, start=len(held))
        manager.release(held)
    except EventLogError as exc:
        error = str(exc)
        break
manager.wait_idle(30)
print("@" + json.dumps({"error": error}), flush=True)
try:
    manager.close()
except EventLogError:
    pass
"""


def test_a_full_disk_under_the_library_is_one_error_not_a_traceback_per_copy(
    tmp_path: Path,
) -> None:
    proc = subprocess.run(
        [sys.executable, "-c", FULL_DISK, str(tmp_path / "data")],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    out = json.loads(next(ln for ln in proc.stdout.splitlines() if ln.startswith("@"))[1:])
    assert out["error"] is not None and "the event log writer failed" in out["error"]
    assert "Traceback" not in proc.stderr, proc.stderr
    assert "exception calling callback" not in proc.stderr, proc.stderr
    # what was committed is whole: it replays
    assert main(["replay", str(tmp_path / "data" / "events.db")]) == 0


def test_g3_writes_never_run_out_of_room_once_it_opened(tmp_path: Path) -> None:
    """Its index is reserved as its data file is: a disk filled after start-up (here by
    another file) cannot fail a G3 write."""
    import torch

    from kvledger.events.types import BlockInfo
    from kvledger.tiers import BlockShape, DiskTier, HostTier

    g3: DiskTier | None = None
    with tiny_tmpfs(tmp_path / "tiny", "2m") as mount:
        try:
            shape = BlockShape(1, 1, 4, 32, torch.uint8)  # 128-byte blocks: 4 KiB slots
            slots = 256  # a 16 KiB index: four pages, which a sparse index gets only when written
            g3 = DiskTier(mount, shape, slots, io_threads=1)
            fd = os.open(mount / "filler", os.O_WRONLY | os.O_CREAT, 0o600)
            try:
                while True:  # until the file system is full
                    os.write(fd, b"\0" * 4096)
            except OSError:
                pass
            finally:
                os.close(fd)
            host = HostTier(shape, 1, pin=False)
            row = host.layout.tensor.view(torch.uint8).reshape(1, -1)[0].numpy()
            for slot in range(slots):
                g3.write_slots([slot], [row], [BlockInfo(slot + 1, slot + 1, None)])
            assert all(g3.is_valid(slot) for slot in range(slots))
        finally:
            if g3 is not None:
                g3.close()


def test_two_processes_as_one_worker_are_named_as_that_worker(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'shared.db'}"
    first, second = EventLog(url), EventLog(url)
    run = RunInfo(
        event_id=0, worker_id=0, dp_rank=0, tier=1, ts=time.time(),  # type: ignore[arg-type]
        g1_blocks=8, g2_blocks=0, g3_blocks=0, block_size=16, policy="lru",
        offload_filter="never",
    )  # fmt: skip
    first.append(run)
    first.flush()
    with pytest.raises(ValueError) as caught:
        second.append(run)
    message = str(caught.value)
    assert message.startswith("worker 0: lookup record 0 repeats"), message
    assert "is another process logging as worker 0?" in message
    assert f"worker {lookup_stream(0)}" not in message
    first.close()
    second.close()


# -- the same words everywhere; a bound that selects nothing; progress -------------------


def test_simulate_replay_and_inspect_count_in_the_same_words(tmp_path: Path) -> None:
    sim = run_cli("simulate", "--requests", "60", cwd=tmp_path)
    assert sim.returncode == 0, sim.stderr
    written = re.search(r"written\s+(\d+) events and (\d+) lookup records to", sim.stdout)
    assert written, sim.stdout
    events, lookups = map(int, written.groups())
    assert lookups > 0
    replay = run_cli("replay", "kvledger-data/events.db", cwd=tmp_path)
    assert (
        f"replayed {events} events and {lookups} lookup records ({events + lookups} rows)"
        in replay.stdout
    ), replay.stdout
    bounded = run_cli("replay", "kvledger-data/events.db", "--until", "10", cwd=tmp_path)
    assert bounded.stdout.startswith("replayed 11 events and "), bounded.stdout  # ids 0..10
    inspect = run_cli("inspect", "kvledger-data/events.db", cwd=tmp_path)
    assert f": {events} events, {lookups} lookup records" in inspect.stdout, inspect.stdout
    as_json = json.loads(
        run_cli("inspect", "--json", "kvledger-data/events.db", cwd=tmp_path).stdout
    )
    assert (as_json["events"], as_json["lookup_records"]) == (events, lookups)


def test_a_replay_bound_that_selects_nothing_warns_with_the_logs_span(tmp_path: Path) -> None:
    assert run_cli("simulate", "--requests", "20", cwd=tmp_path).returncode == 0
    for bound in (["--until-ts", "2026-11-25T03:46:35.324"], ["--until-position", "0"]):
        proc = run_cli("replay", "kvledger-data/events.db", *bound, cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr
        warned = [ln for ln in proc.stderr.splitlines() if "selects none" in ln]
        assert len(warned) == 1, proc.stderr
        assert warned[0].startswith(f"kvledger replay: warning: {bound[0]} ")
        assert "positions 1.." in warned[0] and "+00:00 .. " in warned[0]
    proc = run_cli("replay", "kvledger-data/events.db", "--until-position", "5", cwd=tmp_path)
    assert proc.returncode == 0 and "selects none" not in proc.stderr


@pytest.mark.parametrize(
    ("argv", "drawn"),
    [
        (["whatif", "LOG", "--g1-blocks", "64,128"], ["\rwhatif: read [", "\rwhatif ["]),
        (["report", "LOG", "--windows", "4"], ["\rreport ["]),
    ],
)
def test_whatif_and_report_draw_replays_progress_on_a_terminal(
    tmp_path: Path,
    argv: list[str],
    drawn: list[str],
    terminal: object,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert run_cli("simulate", "--requests", "40", cwd=tmp_path).returncode == 0
    log = str(tmp_path / "kvledger-data" / "events.db")
    monkeypatch.setattr("sys.stderr", terminal)
    assert main([log if a == "LOG" else a for a in argv]) == 0
    text = terminal.getvalue()  # type: ignore[attr-defined]
    for start in drawn:
        assert start in text, text
    assert "/" in text and text.endswith("\n")
    capsys.readouterr()


def test_settings_errors_are_settings_errors_one_line_each() -> None:
    with pytest.raises(SettingsError) as caught:
        Settings.load(g2_gb=-1, token_ids="none")
    lines = str(caught.value).splitlines()
    assert len(lines) == 2 and all(ln.startswith("invalid kvledger setting ") for ln in lines)
    assert textwrap.dedent(lines[1]).startswith("invalid kvledger setting token_ids")
