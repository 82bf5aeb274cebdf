"""What kvledger's CLI switch interval costs a whole run: the same ``kvledger simulate`` with
the CLI's 0.5 ms (``kvledger.cli.CLI_SWITCH_INTERVAL_S``) and with Python's 5 ms
(``KVLEDGER_SWITCH_INTERVAL_S=0.005``).

The CLI shortens the interval so that the log's writer and the publishers' threads get the
interpreter back from a busy engine thread within half a millisecond (what keeps the views
within their latency target, bench/RESULTS.md "Emit to view met"). A shorter interval means
more hand-overs of the interpreter between threads; this measures what that costs a run that
has those threads: the mock engine on the Mooncake conversation trace with G2 and G3, an
event log, and a ZMQ publisher (in a child process, as the CLI runs it) with nobody
subscribed. Each run is a fresh process; runs alternate between the two settings (which goes
first alternates too), so background load hits both alike. Printed: the median wall and CPU
time (the process and its children) of each side and the ratio 5 ms / 0.5 ms (above 1: the
CLI's interval is the faster).

    .venv/bin/python bench/switch_interval_bench.py [--requests 4000] [--runs 5]
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from kvledger.cli import CLI_SWITCH_INTERVAL_S

# The shared data folder sits beside the checkout; KVLEDGER_SHARED_DATA points elsewhere
SHARED_DATA = Path(
    os.environ.get("KVLEDGER_SHARED_DATA", Path(__file__).resolve().parents[2] / "shared/data")
)
TRACE = SHARED_DATA / "mooncake/conversation_trace.jsonl"
PYTHON_DEFAULT_S = 0.005


def run_once(requests: int, interval: float | None, folder: Path) -> tuple[float, float]:
    """One ``kvledger simulate`` process: its wall and CPU seconds (children included)."""
    log = folder / f"events-{time.monotonic_ns()}.db"
    cmd = [sys.executable, "-m", "kvledger.cli", "simulate", "--trace", str(TRACE)]
    cmd += ["--engine", "on", "--requests", str(requests), "--g2-blocks", "1024"]
    cmd += ["--g3-blocks", "4096"]
    cmd += ["--log", str(log), "--zmq-endpoint", "tcp://127.0.0.1:0", "--json"]
    env = dict(os.environ)
    env.pop("KVLEDGER_SWITCH_INTERVAL_S", None)
    if interval is not None:
        env["KVLEDGER_SWITCH_INTERVAL_S"] = repr(interval)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0:
        raise SystemExit(f"kvledger simulate failed ({done.returncode}):\n{done.stderr}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=4000)
    ap.add_argument("--runs", type=int, default=5, help="runs of each setting")
    args = ap.parse_args()
    if not TRACE.exists():
        raise SystemExit(f"no trace at {TRACE} (set KVLEDGER_SHARED_DATA)")
    sides: dict[str, tuple[float | None, list[float], list[float]]] = {
        f"{CLI_SWITCH_INTERVAL_S * 1e3:g} ms (the CLI's)": (None, [], []),
        f"{PYTHON_DEFAULT_S * 1e3:g} ms (Python's)": (PYTHON_DEFAULT_S, [], []),
    }
    print(f"load average {os.getloadavg()[0]:.2f}; {args.requests} requests, {args.runs} runs each")
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.runs):
            order = list(sides.items()) if i % 2 == 0 else list(reversed(sides.items()))
            for _name, (interval, walls, cpus) in order:
                wall, cpu = run_once(args.requests, interval, Path(tmp))
                walls.append(wall)
                cpus.append(cpu)
    medians = {}
    for name, (_interval, walls, cpus) in sides.items():
        medians[name] = statistics.median(walls), statistics.median(cpus)
        print(
            f"{name:20s} wall median {medians[name][0]:6.2f} s "
            f"({min(walls):.2f}-{max(walls):.2f}), cpu median {medians[name][1]:6.2f} s"
        )
    (cli_wall, cli_cpu), (py_wall, py_cpu) = medians.values()
    print(f"ratio 5 ms / 0.5 ms: wall {py_wall / cli_wall:.2f}, cpu {py_cpu / cli_cpu:.2f}")
    print(f"load average after {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
