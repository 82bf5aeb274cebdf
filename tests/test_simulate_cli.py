"""``kvledger simulate`` and ``kvledger sweep`` as real processes, on real SQLite logs."""

from __future__ import annotations

import io
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from kvledger.events.log.replay import load_state, replay
from kvledger.events.types import Tier
from kvledger.progress import Progress

# The shared data folder sits beside the checkout; KVLEDGER_SHARED_DATA points elsewhere
# (a clone in another folder).
SHARED_DATA = Path(
    os.environ.get("KVLEDGER_SHARED_DATA", Path(__file__).resolve().parents[2] / "shared/data")
)
TRACE = SHARED_DATA / "mooncake/conversation_trace.jsonl"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
SUMMARY_KEYS = {
    "requests",
    "blocks_requested",
    "blocks_hit",
    "hit_rate",
    "hits_by_tier",
    "events_written",
    "evictions",
    "offloaded_blocks",
    "onboarded_blocks",
    "replay_matches",
    "log",
}


def kvledger(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVLEDGER_", "DYN_KVBM_"))}
    return subprocess.run(
        [sys.executable, "-m", "kvledger.cli", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def simulate_json(*args: str, cwd: Path) -> dict[str, Any]:
    proc = kvledger("simulate", "--json", *args, cwd=cwd)
    assert proc.returncode == 0, proc.stderr
    out: dict[str, Any] = json.loads(proc.stdout)
    return out


def test_engine_on_run_writes_a_log_that_replays_to_its_final_state(tmp_path: Path) -> None:
    log = tmp_path / "sim.db"
    dump = tmp_path / "live.state"
    s = simulate_json(
        "--requests", "300", "--g1-blocks", "512", "--g2-blocks", "256", "--g3-blocks", "1024",
        "--log", f"sqlite:///{log}", "--dump-state", str(dump), "--plot", str(tmp_path / "t.png"),
        cwd=tmp_path,
    )  # fmt: skip
    assert s.keys() >= SUMMARY_KEYS
    assert s["requests"] == 300 and s["replay_matches"] is True
    hits = s["hits_by_tier"]
    assert isinstance(hits, dict) and set(hits) == {"G1", "G2", "G3"}
    assert sum(hits.values()) == s["blocks_hit"]
    assert s["hit_rate"] == pytest.approx(s["blocks_hit"] / s["blocks_requested"], abs=1e-6)
    assert s["ttft_ms_p50"] <= s["ttft_ms_p99"]
    assert (tmp_path / "t.png").read_bytes()[:8] == PNG_MAGIC
    # the log, read back by a fresh process's code path, is the live state the run dumped
    replayed = replay(str(log))
    assert replayed == load_state(dump)
    assert replayed.counts()[(0, Tier.G1)] == 512
    proc = kvledger("replay", str(log), "--verify", str(dump), cwd=tmp_path)
    assert proc.returncode == 0 and "states agree" in proc.stdout


def test_a_second_run_on_the_same_log_restarts_the_worker(tmp_path: Path) -> None:
    log = str(tmp_path / "sim.db")  # a plain path is a SQLite log, as for `kvledger replay`
    first = simulate_json("--engine", "off", "--requests", "200", "--log", log, cwd=tmp_path)
    proc = kvledger(
        "simulate", "--json", "--requests", "100", "--g1-blocks", "300", "--log", log, cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stderr
    assert "already holds events of worker 0" in proc.stderr and "Cleared" in proc.stderr
    assert str(tmp_path / "sim.db") in proc.stderr
    second = json.loads(proc.stdout)
    assert second["replay_matches"] is True
    assert second["events_written"] > 3  # three Cleared, then the run's own
    assert replay(log).counts() == {(0, Tier.G1): 300}
    assert first["state_digest"] != second["state_digest"]


def test_table_output_and_default_log_under_the_working_folder(tmp_path: Path) -> None:
    proc = kvledger("simulate", "--engine", "off", "--requests", "50", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    for label in ("requests", "prefix hit rate", "evictions", "offloads", "onboards"):
        assert label in proc.stdout
    assert "kvledger replay sqlite:///kvledger-data/events.db" in proc.stdout
    assert (tmp_path / "kvledger-data" / "events.db").is_file()
    assert "TTFT" not in proc.stdout  # no timing with the engine off


@pytest.mark.skipif(
    not TRACE.exists(), reason=f"trace not found at {TRACE} (set KVLEDGER_SHARED_DATA)"
)
def test_mooncake_trace_implies_512_token_blocks(tmp_path: Path) -> None:
    s = simulate_json(
        "--trace", str(TRACE), "--requests", "400", "--engine", "off", "--policy", "lru",
        "--log", f"sqlite:///{tmp_path / 'm.db'}", cwd=tmp_path,
    )  # fmt: skip
    assert s["block_size"] == 512 and s["requests"] == 400
    assert s["replay_matches"] is True


@pytest.mark.skipif(
    not TRACE.exists(), reason=f"trace not found at {TRACE} (set KVLEDGER_SHARED_DATA)"
)
def test_dynamo_model_runs_with_and_without_a_log(tmp_path: Path) -> None:
    """``--dynamo`` selects Dynamo's timing, admission and caching of full blocks only; the
    logged run replays to its final state, and ``--no-log`` gives the same figures and
    writes nothing."""
    common = ("--trace", str(TRACE), "--requests", "300", "--g1-blocks", "512", "--dynamo")
    logged = simulate_json(*common, "--log", f"sqlite:///{tmp_path / 'd.db'}", cwd=tmp_path)
    assert logged["replay_matches"] is True and logged["policy"] == "lru"
    quick = simulate_json(*common, "--no-log", cwd=tmp_path)
    assert quick["log"] is None and quick["replay_matches"] is None
    assert not (tmp_path / "kvledger-data").exists()
    for key in ("ttft_ms_p50", "ttft_ms_p99", "tpot_ms_mean", "preemptions", "evictions"):
        assert quick[key] == logged[key], key
    assert quick["events_written"] == logged["events_written"] > 0
    assert 0 < quick["token_hit_rate"] <= quick["token_hit_rate_all_admissions"] < 1
    # each part of the model is its own flag: the linear timing gives other figures
    linear = simulate_json(*common, "--timing-model", "linear", "--no-log", cwd=tmp_path)
    assert linear["ttft_ms_p50"] != quick["ttft_ms_p50"]
    table = kvledger("simulate", *common, "--no-log", cwd=tmp_path)
    assert table.returncode == 0, table.stderr
    assert "counted, no log" in table.stdout and "kvledger replay" not in table.stdout
    assert "dynamo timing, whole_prompt admission, partial blocks not cached" in table.stdout
    assert "TPOT mean" in table.stdout


def test_sweep_reports_hit_rate_rising_with_capacity(tmp_path: Path) -> None:
    proc = kvledger(
        "sweep", "--json", "--requests", "300", "--capacities", "64,256,1024,4096",
        "--plot", str(tmp_path / "sweep.png"), cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    rates = [p["hit_rate"] for p in out["points"]]
    assert [p["g1_blocks"] for p in out["points"]] == [64, 256, 1024, 4096]
    assert rates == sorted(rates) and rates[-1] > rates[0]
    assert (tmp_path / "sweep.png").read_bytes()[:8] == PNG_MAGIC
    assert not (tmp_path / "kvledger-data").exists()  # a sweep keeps no log


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--trace", "no/such/trace.jsonl"], "cannot read trace"),
        (["--requests", "0"], "argument --requests: must be 1 or more, got 0"),
        (["--engine", "off", "--speedup", "2"], "--speedup needs --engine on"),
        (["--g1-blocks", "0"], "argument --g1-blocks: must be 1 or more"),
        (["--g1-blocks", "4"], "needs"),  # a request larger than G1
        (["--plot", "chart.jpg"], "give a file name ending in .png"),
        (["--log", "nosuchdriver://x/y"], "SQLAlchemy knows no database 'nosuchdriver'"),
        (["--no-log", "--log", "x.db"], "argument --log: not allowed with argument --no-log"),
        (["--speedup-ratio", "0"], "argument --speedup-ratio: must be a finite number above 0"),
        (["--timing-model", "cubic"], "argument --timing-model: invalid choice: 'cubic'"),
        (["--admission-rule", "any"], "argument --admission-rule: invalid choice: 'any'"),
        (["--partial-blocks", "keep"], "argument --partial-blocks: invalid choice: 'keep'"),
    ],
)
def test_bad_input_fails_with_a_message_that_names_it(
    tmp_path: Path, args: list[str], message: str
) -> None:
    proc = kvledger("simulate", "--requests", "20", *args, cwd=tmp_path)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert message in proc.stderr


def test_trace_block_size_must_divide_512(tmp_path: Path) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text(
        '{"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [1, 2]}\n'
    )
    proc = kvledger("simulate", "--trace", str(trace), "--block-size", "100", cwd=tmp_path)
    assert proc.returncode == 2
    assert "block size 100 must divide the trace's 512-token blocks" in proc.stderr


def test_simulate_without_log_loads_no_numpy_database_or_metrics(tmp_path: Path) -> None:
    """Start-up is most of a short run's cost: a run with no log must not import what only a
    log, a replay, a metrics port or a cluster (its router and the router's index) needs. The
    same run's figures are checked as well."""
    trace = tmp_path / "t.jsonl"
    trace.write_text(
        '{"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [1, 2]}\n'
        '{"timestamp": 10, "input_length": 1100, "output_length": 3, "hash_ids": [1, 2, 3]}\n'
    )
    heavy = (
        "numpy",
        "sqlalchemy",
        "alembic",
        "prometheus_client",
        "kvledger.events.log",
        "kvledger.mocker.router",
        "kvledger.registry.index",
    )
    code = (
        "import json, sys; from kvledger.cli import main;"
        f" status = main(['simulate', '--trace', {str(trace)!r}, '--no-log', '--json',"
        " '--dynamo']);"
        f" print(json.dumps([m for m in {heavy!r} if m in sys.modules]), file=sys.stderr);"
        " sys.exit(status)"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, check=False
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stderr.strip().splitlines()[-1]) == []
    summary = json.loads(proc.stdout)
    assert summary["requests"] == 2
    assert summary["log"] is None
    # the second request reuses the first one's full block; its partial one was never cached
    assert summary["blocks_hit"] == 1


def test_metrics_port_serves_kvbm_metrics_while_the_run_lasts(tmp_path: Path) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVLEDGER_", "DYN_KVBM_"))}
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvledger.cli", "simulate", "--requests", "150", "--speedup", "1",
         "--g1-blocks", "777", "--log", str(tmp_path / "m.db"), "--metrics-port", str(port)],
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    text = ""
    try:
        deadline = time.monotonic() + 60
        while proc.poll() is None and time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
                    text = r.read().decode()
            except OSError:
                time.sleep(0.05)
                continue
            if 'kvbm_blocks{state="total",tier="G1"} 777.0' in text:
                break
            time.sleep(0.05)
    finally:
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert 'kvbm_blocks{state="total",tier="G1"} 777.0' in text
    assert "kvbm_events_appended_total" in text and "kvbm_alloc_latency_seconds_count" in text


def test_progress_bar_draws_only_on_a_terminal(terminal: io.StringIO) -> None:
    term, pipe = terminal, io.StringIO()
    for stream in (term, pipe):
        bar = Progress(4, "simulate", stream=stream)
        for done in range(1, 5):
            bar(done)
        bar.close()
    assert pipe.getvalue() == ""
    assert term.getvalue().startswith("\rsimulate [")
    assert term.getvalue().endswith("] 4/4 requests\n")
