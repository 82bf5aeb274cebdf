"""``kvledger whatif`` against ``kvledger simulate --engine off`` on the same requests.

whatif answers "what would this traffic have hit" by re-running the lookup records of a
recorded run; simulate answers it by running the trace. Both drive the same simulated cache,
so whatif should cost no more per lookup than simulate does per request.

Sides, on the Mooncake conversation trace (12031 requests, block size 512, G1 4096 blocks,
G2 8192, G3 16384, lineage, seen_twice):
- simulate: ``kvledger simulate --engine off --trace T --log L`` in-process, whole command
  (hashing the trace, every event and lookup record to a fresh SQLite log, the closing replay
  check): its requests/s;
- whatif: ``kvledger whatif L`` in-process, whole command (reading and decoding the lookup
  records, the baseline re-run with its per-lookup comparison): prompt lookups/s;
- whatif re-run alone: one ``rerun`` of the loaded records (no log reading): lookups/s.
Ratio: whatif lookups/s over simulate requests/s (>= 0.8 is the bar). Each repetition runs
every side once, in turn; the median and the spread of ``--repeat`` are printed.

What the records cost: the lookup records' bytes per request (their payloads), and the log
file's growth per request against the same simulate run with ``KVLEDGER_LOG_LOOKUPS=0``
(payloads, the other columns, the index entries and page slack).

Engine on against Dynamo: Dynamo's ``run_mocker_trace_replay`` and ``kvledger simulate
--engine on --dynamo --no-log`` on the same trace, G1 4096 blocks of 512 tokens, each a fresh
process started by ``dynamo_replay.py`` (beside this file; ``mocker_agreement_bench.py``
checks that their figures agree): the best wall and CPU times of ``--repeat`` and the ratio
Dynamo / kvledger (1 or more: kvledger is at least as fast).

Run: .venv/bin/python bench/whatif_bench.py [--requests N] [--repeat 3]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import sqlite3
import statistics
import tempfile
import time
from pathlib import Path

from dynamo_replay import run_dynamo, run_kvledger, warm_up

from kvledger.cli import main
from kvledger.events.log import EventLog
from kvledger.mocker.rerun import load_run, rerun

SHARED_DATA = Path(
    os.environ.get("KVLEDGER_SHARED_DATA", Path(__file__).resolve().parents[2] / "shared/data")
)
TRACE = SHARED_DATA / "mooncake/conversation_trace.jsonl"
CACHE = ["--g1-blocks", "4096", "--g2-blocks", "8192", "--g3-blocks", "16384"]
DYNAMO_G1 = 4096


def _quiet(argv: list[str]) -> dict[str, object]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        status = main(argv)
    if status != 0:
        raise SystemExit(f"kvledger {' '.join(argv)} exited {status}")
    result: dict[str, object] = json.loads(out.getvalue())
    return result


def one_round(folder: Path, requests: int | None, index: int) -> dict[str, float]:
    log = folder / f"run-{index}.db"
    limit = ["--requests", str(requests)] if requests else []
    start = time.perf_counter()
    sim = _quiet(["simulate", "--engine", "off", "--trace", str(TRACE), "--log", str(log),
                  *CACHE, *limit, "--json"])  # fmt: skip
    simulate_s = time.perf_counter() - start
    start = time.perf_counter()
    whatif = _quiet(["whatif", str(log), "--json"])
    whatif_s = time.perf_counter() - start
    if not whatif["baseline_reproduces"]:
        raise SystemExit("the whatif baseline does not reproduce the recorded hits")
    with EventLog(f"sqlite:///{log}", read_only=True) as opened:
        run = load_run(opened)
    start = time.perf_counter()
    rerun(run, run.settings)
    rerun_s = time.perf_counter() - start
    n = int(sim["requests"])  # type: ignore[call-overload]
    plain = folder / f"plain-{index}.db"
    os.environ["KVLEDGER_LOG_LOOKUPS"] = "0"
    try:
        _quiet(["simulate", "--engine", "off", "--trace", str(TRACE), "--log", str(plain),
                *CACHE, *limit, "--json"])  # fmt: skip
    finally:
        del os.environ["KVLEDGER_LOG_LOOKUPS"]
    db = sqlite3.connect(log)
    (payload_bytes,) = db.execute(
        "SELECT sum(length(payload)) FROM events WHERE worker < 0"
    ).fetchone()
    db.close()
    return {
        "record_bytes_per_request": payload_bytes / n,
        "file_bytes_per_request": (log.stat().st_size - plain.stat().st_size) / n,
        "requests": n,
        "simulate_per_s": n / simulate_s,
        "whatif_per_s": n / whatif_s,
        "rerun_per_s": n / rerun_s,
    }


def main_bench() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, help="only the first N requests")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    if not TRACE.is_file():
        raise SystemExit(f"{TRACE}: the Mooncake trace is missing (set KVLEDGER_SHARED_DATA)")
    rounds = []
    with tempfile.TemporaryDirectory() as folder:
        for i in range(args.repeat):
            rounds.append(one_round(Path(folder), args.requests, i))
    print(f"load average: {os.getloadavg()[0]:.2f}; {rounds[0]['requests']:.0f} requests")
    for key, name in (
        ("simulate_per_s", "simulate --engine off, requests/s"),
        ("whatif_per_s", "whatif (whole command), lookups/s"),
        ("rerun_per_s", "whatif re-run alone, lookups/s"),
    ):
        values = [r[key] for r in rounds]
        print(
            f"{name:<40} median {statistics.median(values):>9.0f}  "
            f"(min {min(values):.0f}, max {max(values):.0f})"
        )
    print(
        f"lookup records: {rounds[0]['record_bytes_per_request']:.0f} bytes of records per "
        f"request, {rounds[0]['file_bytes_per_request']:.0f} bytes of SQLite file per request"
    )
    ratios = [r["whatif_per_s"] / r["simulate_per_s"] for r in rounds]
    print(
        f"ratio whatif / simulate: median {statistics.median(ratios):.2f} "
        f"(min {min(ratios):.2f}, max {max(ratios):.2f}); the bar is 0.8"
    )
    engine_on_vs_dynamo(args.requests, args.repeat)


def engine_on_vs_dynamo(requests: int | None, repeat: int) -> None:
    """Dynamo's trace replay against ``simulate --engine on`` (Dynamo's model), whole processes."""
    warm_up(TRACE)
    sides: dict[str, list[tuple[float, float]]] = {"Dynamo": [], "kvledger": []}
    for _ in range(repeat):
        wall, out = run_dynamo(TRACE, DYNAMO_G1, requests)
        sides["Dynamo"].append((wall, out["cpu_s"]))
        wall, out = run_kvledger(TRACE, DYNAMO_G1, requests)
        sides["kvledger"].append((wall, out["cpu_s"]))
    print(f"engine on, G1 {DYNAMO_G1} blocks, whole process, best of {repeat} (wall / cpu s):")
    for name, runs in sides.items():
        label = (
            "Dynamo run_mocker_trace_replay"
            if name == "Dynamo"
            else "kvledger simulate --engine on --dynamo --no-log"
        )
        walls = [w for w, _ in runs]
        print(
            f"  {label:<48} {min(walls):.2f} / {min(c for _, c in runs):.2f} "
            f"(median wall {statistics.median(walls):.2f})"
        )
    dyn, ours = sides["Dynamo"], sides["kvledger"]
    print(
        f"ratio Dynamo / kvledger simulate --engine on: wall "
        f"{min(w for w, _ in dyn) / min(w for w, _ in ours):.2f}, cpu "
        f"{min(c for _, c in dyn) / min(c for _, c in ours):.2f} (1 or more: kvledger as fast)"
    )


if __name__ == "__main__":
    main_bench()
