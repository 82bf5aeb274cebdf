"""Dynamo's mocker replay and `kvledger simulate` on a Mooncake trace, each a fresh process.

The one place the benches that compare kvledger's mock engine with Dynamo's mocker
(``mocker_agreement_bench.py``, ``whatif_bench.py``) start either side, so both time the
same thing:

- Dynamo: ``run_mocker_trace_replay`` from ``ai-dynamo-runtime`` (offline replay, vLLM
  scheduler, its default polynomial timing), one worker, ``block_size`` 512, and with
  ``explicit`` every engine argument that matters (``max_num_seqs`` 256,
  ``max_num_batched_tokens`` 8192, ``speedup_ratio`` 1, prefix caching and chunked prefill
  on: Dynamo's defaults, which a run without them shows);
- kvledger: ``kvledger simulate --trace T --g1-blocks N --dynamo --no-log --json`` (the same
  model: dynamo timing, whole-prompt admission, partial blocks not cached, LRU; the scheduler
  limits above are kvledger's defaults too).

Each process is timed whole (start, imports, trace load, replay, report): wall time and CPU
time (user + system, what it cost rather than how long it waited for a core on a shared
machine). Children run without ``PYTHONDONTWRITEBYTECODE`` (``BENCH_ONLY_VARIABLES``), after
one untimed kvledger run (``warm_up``), so kvledger's modules load from cached bytecode as an
installed package's do (Dynamo's Python modules, in site-packages, have theirs from
installation).

Run alone, this module is the Dynamo child: ``python bench/dynamo_replay.py TRACE BLOCKS
[--defaults] [--requests N]`` prints the replay's figures as one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

BLOCK = 512


def database_args(g1_blocks: int, *, explicit: bool = True) -> dict[str, Any]:
    engine: dict[str, Any] = {"num_gpu_blocks": g1_blocks, "block_size": BLOCK}
    if explicit:
        engine.update(
            max_num_seqs=256,
            max_num_batched_tokens=8192,
            speedup_ratio=1.0,
            enable_prefix_caching=True,
            enable_chunked_prefill=True,
        )
    return {"engine": engine}


@dataclass(frozen=True)
class Cluster:
    """A multi-worker replay: Dynamo's ``num_workers``, ``router_mode`` (``round_robin`` or
    ``kv_router``) and ``arrival_speedup_ratio``; kvledger's ``--workers``, ``--router``
    (``round_robin`` or ``kv``), ``--arrival-speedup`` and ``--seed`` (its tie-breaks)."""

    workers: int
    router: str  # kvledger's name
    arrival_speedup: float = 1.0
    seed: int = 0

    @property
    def router_mode(self) -> str:
        return "kv_router" if self.router == "kv" else self.router


def dynamo_child(
    trace: str,
    g1_blocks: int,
    explicit: bool,
    requests: int | None,
    cluster: Cluster | None = None,
) -> None:
    """Run Dynamo's replay in this process and print its figures as one JSON line."""
    from dynamo._core import run_mocker_trace_replay

    path = trace
    if requests is not None:
        path = _head(trace, requests)
    extra: dict[str, Any] = {}
    if cluster is not None:
        extra = {
            "num_workers": cluster.workers,
            "router_mode": cluster.router_mode,
            "arrival_speedup_ratio": cluster.arrival_speedup,
        }
    start = time.perf_counter()
    result = run_mocker_trace_replay(
        [path],
        extra_engine_args=database_args(g1_blocks, explicit=explicit),
        capture_telemetry=True,
        telemetry_sample_interval_ms=1e12,  # a baseline and a final sample: the totals
        **extra,
    )
    call_s = time.perf_counter() - start
    s = result.summary
    telemetry = result.telemetry
    assert telemetry is not None
    preemptions = sum(
        sample["decode_interval_metrics"]["preemptions"]
        + sample["prefill_interval_metrics"]["preemptions"]
        for sample in telemetry["samples"]
    )
    out = {
        "ttft_p50": s["median_ttft_ms"],
        "ttft_p99": s["p99_ttft_ms"],
        "tpot_mean": s["mean_tpot_ms"],
        "preemptions": preemptions,
        "hits_all": s["prefix_cache_reused_ratio"],
        "hits_first": s["first_admission_prefix_cache_reused_ratio"],
        "requests": s["completed_requests"],
        "call_s": call_s,
    }
    print(json.dumps(out))


def _head(trace: str, requests: int) -> str:
    """The first ``requests`` lines of a trace, in a temporary file (deleted at exit)."""
    import atexit
    import tempfile

    fd, name = tempfile.mkstemp(suffix=".jsonl")
    with open(trace) as src, os.fdopen(fd, "w") as dst:
        for i, line in enumerate(src):
            if i >= requests:
                break
            dst.write(line)
    atexit.register(os.unlink, name)
    return name


BENCH_ONLY_VARIABLES = ("PYTHONDONTWRITEBYTECODE", "KVLEDGER_REDIS_URL")
"""Left out of the children's environment: they cache their bytecode (an installed package has
it), and the Redis URL is the bench's own (``cluster_bench.py`` passes ``--redis-url`` to the
runs that use Redis). A kvledger process that finds a setting's variable reads the environment
through pydantic-settings, which costs it about 90 ms of start-up; a run configured by its
flags, as these are, does not."""


def child_env() -> dict[str, str]:
    """This process's environment, less ``BENCH_ONLY_VARIABLES``."""
    return {k: v for k, v in os.environ.items() if k not in BENCH_ONLY_VARIABLES}


def timed(cmd: list[str], env: dict[str, str] | None = None) -> tuple[float, dict[str, Any]]:
    """Run ``cmd``; its wall time, and its last output line as JSON with ``cpu_s`` added."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    proc = subprocess.run(
        cmd, capture_output=True, text=True, check=False, env={**child_env(), **(env or {})}
    )
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stderr}")
    out: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    out["cpu_s"] = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, out


def run_dynamo(
    trace: Path,
    g1: int,
    requests: int | None,
    *,
    explicit: bool = True,
    cluster: Cluster | None = None,
) -> tuple[float, dict[str, Any]]:
    """Dynamo's replay as a fresh process: its wall time and figures (``call_s``: the replay
    call alone, after the import). A cluster replay runs with ``DYN_LOG=warn``: its KV router
    logs every routing decision at INFO, and writing those is not what is being timed."""
    cmd = [sys.executable, __file__, str(trace), str(g1)]
    if not explicit:
        cmd.append("--defaults")
    if requests is not None:
        cmd += ["--requests", str(requests)]
    env = None
    if cluster is not None:
        cmd += ["--workers", str(cluster.workers), "--router", cluster.router]
        cmd += ["--arrival-speedup", repr(cluster.arrival_speedup)]
        env = {"DYN_LOG": "warn"}
    return timed(cmd, env)


def kvledger_command(
    trace: Path, g1: int, requests: int | None, cluster: Cluster | None = None
) -> list[str]:
    cmd = [sys.executable, "-m", "kvledger.cli", "simulate", "--trace", str(trace)]
    cmd += ["--g1-blocks", str(g1), "--dynamo", "--no-log", "--json"]
    if requests is not None:
        cmd += ["--requests", str(requests)]
    if cluster is not None:
        cmd += ["--workers", str(cluster.workers), "--router", cluster.router]
        cmd += ["--arrival-speedup", repr(cluster.arrival_speedup), "--seed", str(cluster.seed)]
    return cmd


def warm_up(trace: Path) -> None:
    """One short, untimed kvledger run: writes its modules' bytecode (and reads the trace)."""
    timed(kvledger_command(trace, 4096, 1))


def run_kvledger(
    trace: Path, g1: int, requests: int | None, cluster: Cluster | None = None
) -> tuple[float, dict[str, Any]]:
    """``kvledger simulate --dynamo --no-log`` as a fresh process: its wall time and figures,
    under the names ``dynamo_child`` gives Dynamo's (``loop_s``: its engine loop alone)."""
    wall, out = timed(kvledger_command(trace, g1, requests, cluster))
    if cluster is not None:  # the cluster's figures, beside the process's CPU time
        s = {**out["cluster"], "cpu_s": out["cpu_s"]}
        s.setdefault("preemptions", 0)
    else:
        s = out
    return wall, {
        "ttft_p50": s["ttft_ms_p50"],
        "ttft_p99": s["ttft_ms_p99"],
        "tpot_mean": s["tpot_ms_mean"],
        "preemptions": s["preemptions"],
        "hits_all": s["token_hit_rate_all_admissions"],
        "hits_first": s["token_hit_rate"],
        "requests": s["requests"],
        "loop_s": s["wall_s"],
        "cpu_s": s["cpu_s"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description="Dynamo's mocker replay, one JSON line")
    parser.add_argument("trace")
    parser.add_argument("blocks", type=int)
    parser.add_argument("--defaults", action="store_true", help="only block size and count")
    parser.add_argument("--requests", type=int)
    parser.add_argument("--workers", type=int, help="a multi-worker replay of N workers")
    parser.add_argument("--router", default="round_robin", help="round_robin or kv")
    parser.add_argument("--arrival-speedup", type=float, default=1.0)
    args = parser.parse_args()
    cluster = None
    if args.workers is not None:
        cluster = Cluster(args.workers, args.router, args.arrival_speedup)
    dynamo_child(args.trace, args.blocks, not args.defaults, args.requests, cluster)


if __name__ == "__main__":
    main()
