"""Scheduler-side offload bookkeeping: kvledger's OffloadingManager (event log on) against
vLLM 0.33's CPUOffloadingManager, on the same key stream, in the same run.

Each request does what vLLM's OffloadingConnector scheduler asks of a manager: ``lookup`` per
block until the first miss, ``prepare_load`` + ``touch`` + ``complete_load`` of the hits,
``prepare_store`` + ``complete_store`` of the rest, ``on_request_finished``. Requests share
prefixes (a Zipf-ish pick among a few hundred documents), so there are hits, evictions and
reuse. Prints operations/s of each and the ratio kvledger / vLLM. kvledger's log keeps its
default durability ("batch"), and each of its runs is timed until its last event is committed
(``flush_log``). The two managers take turns, run by run.

Run in the vLLM test venv (tests/integrations/setup_vllm_test_venv.sh):
    .vllm-test-venv/bin/python bench/offload_bench.py [--requests N] [--repeat R]

``--tiering`` compares secondary tiers under vLLM's tiering layer instead: vLLM's CPU tier
(``CPUPrimaryTierOffloadingManager``, ``--chunks`` rows of ``--row-kib`` KiB each, real memory)
with kvledger's G3 tier (``KvledgerDiskTier``, its event log on) against the same CPU tier with
vLLM's own ``fs`` tier, both under vLLM's ``TieringOffloadingManager``, on the same key stream
and in the same folder (``--dir``, default a temporary one). Every store cascades to the tier
(real bytes written), and a block found on the tier only is promoted back (read) before it is
loaded; each run is timed until its last write is on disk and, for kvledger, its last event is
committed. ``--tier-blocks`` sizes kvledger's G3 (fs has no bound).

``--kills N`` then runs kvledger's manager on the same stream at full rate in a child process
N times, SIGKILLs it at a random moment each time, and prints what its log holds against the
events the manager had made (reported every 5 ms by the child), and whether the log replays.
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from unittest.mock import MagicMock

import numpy as np
from vllm.v1.kv_offload.base import (
    LookupResult,
    OffloadingKVEventsConfig,
    OffloadingManager,
    ReqContext,
    ScheduleEndContext,
    make_offload_key,
)
from vllm.v1.kv_offload.config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)
from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager
from vllm.v1.kv_offload.tiering.fs.manager import FileSystemTierManager
from vllm.v1.kv_offload.tiering.manager import (
    CPUPrimaryTierOffloadingManager,
    TieringOffloadingManager,
)

from kvledger.integrations.vllm.disk_tier import KvledgerDiskTier
from kvledger.integrations.vllm.manager import KvledgerOffloadingManager


def key_stream(requests: int, seed: int = 7) -> list[list[bytes]]:
    """Per request, the keys of its blocks: a shared document prefix plus a private tail."""
    rng = random.Random(seed)
    docs = [[f"d{d}b{b}".encode() for b in range(rng.randint(4, 32))] for d in range(300)]
    out = []
    for r in range(requests):
        doc = docs[min(int(rng.paretovariate(1.2)) - 1, len(docs) - 1)]
        tail = [f"r{r}t{t}".encode() for t in range(rng.randint(1, 8))]
        out.append([make_offload_key(k, 0) for k in doc + tail])
    return out


def drive(manager: OffloadingManager, stream: list[list[bytes]]) -> int:
    """Run the whole stream through ``manager``; the number of manager calls made."""
    calls = 0
    for i, keys in enumerate(stream):
        ctx = ReqContext(req_id=str(i))
        for pos, key in enumerate(keys):
            ctx.set_offload_key_position(key, (pos + 1) * 16)
        manager.on_new_request(ctx)
        hits = 0
        for key in keys:
            calls += 1
            if manager.lookup(key, ctx) is not LookupResult.HIT:
                break
            hits += 1
        loaded = keys[:hits]
        if loaded:
            manager.prepare_load(loaded, ctx)
            manager.touch(loaded, ctx)
            manager.complete_load(loaded, ctx)
            calls += 3
        out = manager.prepare_store(keys[hits:], ctx)
        calls += 1
        if out is not None and out.keys_to_store:
            manager.complete_store(out.keys_to_store, ctx)
            calls += 1
        manager.on_request_finished(ctx)
        calls += 1
        for _ in manager.take_events():
            pass
    return calls


def drive_tiering(manager: OffloadingManager, stream: list[list[bytes]]) -> int:
    """``drive`` for vLLM's tiering manager: a lookup may answer HIT_PENDING (a promotion from
    the tier was started) or RETRY (the tier is still looking); the scheduler then ends the
    step and asks again, as vLLM's scheduler does with a request whose lookup is not done."""
    end_step = ScheduleEndContext(new_req_ids=[], preempted_req_ids=())
    calls = 0
    for i, keys in enumerate(stream):
        ctx = ReqContext(req_id=str(i))
        for pos, key in enumerate(keys):
            ctx.set_offload_key_position(key, (pos + 1) * 16)
        manager.on_new_request(ctx)
        while True:
            hits, asked, waiting = 0, 0, False
            for key in keys:
                asked += 1
                found = manager.lookup(key, ctx)
                if found is LookupResult.HIT:
                    hits += 1
                    continue
                waiting = found in (LookupResult.HIT_PENDING, LookupResult.RETRY)
                break
            if not waiting:
                break
            manager.on_schedule_end(end_step)
            time.sleep(0)  # let the tier's I/O threads run, as a model step would
        # the calls of the pass that settled: the same work on both sides, however many
        # times a tier made the scheduler ask again (that shows as time, not as calls)
        calls += asked
        loaded = keys[:hits]
        if loaded:
            manager.prepare_load(loaded, ctx)
            manager.touch(loaded, ctx)
            manager.complete_load(loaded, ctx)
            calls += 3
        out = manager.prepare_store(keys[hits:], ctx)
        calls += 1
        if out is not None and out.keys_to_store:
            manager.complete_store(out.keys_to_store, ctx)
            calls += 1
        manager.on_request_finished(ctx)
        manager.on_schedule_end(end_step)
        calls += 2
        for _ in manager.take_events():
            pass
    while manager.has_pending_work():  # every write on the tier's storage
        manager.on_schedule_end(end_step)
        time.sleep(0.001)
    return calls


def tiering_rate(
    make: Callable[[Path], OffloadingManager], where: Path, stream: list[list[bytes]]
) -> tuple[float, float]:
    """``rate`` for a tiering manager with its tier in ``where``: built outside the timing,
    shut down after it."""
    manager = make(where)
    gc.collect()
    start, start_cpu = time.perf_counter(), time.process_time()
    calls = drive_tiering(manager, stream)
    tiers = getattr(manager, "secondary_tiers", [])
    for tier in tiers:
        flush = getattr(tier, "flush_log", None)
        if flush is not None:
            flush()
    seconds, cpu = time.perf_counter() - start, time.process_time() - start_cpu
    manager.shutdown()
    return calls / seconds, calls / cpu


def tiering_managers(
    chunks: int, row_bytes: int, tier_blocks: int
) -> tuple[Callable[[Path], OffloadingManager], Callable[[Path], OffloadingManager]]:
    """Builders of (vLLM CPU + kvledger G3, vLLM CPU + vLLM fs) keeping the tier in a
    given folder."""
    # what vLLM's spec hands a tier (the fs tier names its files from it), as vLLM's own
    # fs tier tests build it
    spec = MagicMock()
    spec.config = OffloadingConfig(
        groups=(),
        worker_kv_bytes_per_block=0,
        enable_kv_cache_events=True,
        extra_config={},
        engine_id="bench",
        model=OffloadingModelConfig(name="bench-model", dtype="bfloat16"),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=1),
        parallel=OffloadingParallelConfig(
            rank=0,
            world_size=1,
            tp_size=1,
            pp_size=1,
            pcp_size=1,
            dcp_size=1,
            data_parallel_index=0,
            data_parallel_size=1,
            data_parallel_rank_local=None,
            is_parallelism_agnostic=False,
        ),
        replicated_layout=False,
    )
    spec.blocks_per_chunk = 1
    spec.kv_events_config = OffloadingKVEventsConfig(
        enable_kv_cache_events=True, self_describing_kv_events=False
    )

    def primary() -> CPUPrimaryTierOffloadingManager:
        # page-aligned rows in real memory, as vLLM's shared region gives
        raw = np.zeros(chunks * row_bytes + 4096, dtype=np.uint8)
        start = -raw.ctypes.data % 4096
        rows = raw[start : start + chunks * row_bytes].reshape(chunks, row_bytes)
        rows[:] = 1
        region = MagicMock()
        region.create_kv_memoryview.return_value = memoryview(rows)
        return CPUPrimaryTierOffloadingManager(chunks, mmap_region=region, enable_events=True)

    def kvledger(where: Path) -> OffloadingManager:
        cpu = primary()
        tier = KvledgerDiskTier(
            spec,
            cpu.get_kv_memoryview(),
            "KvledgerDiskTier",
            num_blocks=tier_blocks,
            data_dir=str(where),
            log_url=f"sqlite:///{where / 'g3.db'}",
            enable_kv_events=True,
        )
        return TieringOffloadingManager(cpu, [tier])

    def fs(where: Path) -> OffloadingManager:
        cpu = primary()
        tier = FileSystemTierManager(
            spec,
            cpu.get_kv_memoryview(),
            "fs",
            root_dir=str(where),
            enable_kv_events=True,
        )
        return TieringOffloadingManager(cpu, [tier])

    return kvledger, fs


def rate(manager: OffloadingManager, stream: list[list[bytes]]) -> tuple[float, float]:
    """Calls per wall-clock second and per CPU second (every thread of the process: the log
    writer's work counts) of one run. kvledger's time includes committing the log's tail
    (``flush_log``): its run ends when its last event is durable, not when it is queued.

    Each run starts from a full garbage collection: a finished manager is cyclic garbage (its
    pool's emitter calls back into it), and left for the next run's collector it cost that
    run up to a fifth of its rate, whichever manager it was."""
    gc.collect()
    start, start_cpu = time.perf_counter(), time.process_time()
    calls = drive(manager, stream)
    if isinstance(manager, KvledgerOffloadingManager):
        manager.flush_log()
    seconds, cpu = time.perf_counter() - start, time.process_time() - start_cpu
    if isinstance(manager, KvledgerOffloadingManager):
        manager.shutdown()
    return calls / seconds, calls / cpu


KILLED_CHILD = """
import sys, time
sys.path.insert(0, sys.argv[2])
from offload_bench import key_stream, drive
from kvledger.integrations.vllm.manager import KvledgerOffloadingManager
stream = key_stream(int(sys.argv[3]))
manager = KvledgerOffloadingManager(int(sys.argv[4]), enable_events=True, log_url=sys.argv[1])
print("started", flush=True)
last = time.monotonic()
for i in range(0, len(stream), 50):
    drive(manager, stream[i : i + 50])
    now = time.monotonic()
    if now - last > 0.005:
        print(manager._emitter.next_event_id, now, flush=True)
        last = now
"""


def kills(count: int, chunks: int, tmp: Path) -> None:
    """SIGKILL a full-rate run ``count`` times; print how far its log was behind and that the
    log replays."""
    from kvledger.events.log import EventLog
    from kvledger.events.log.replay import replay

    rng = random.Random(11)
    script = tmp / "killed_child.py"
    script.write_text(KILLED_CHILD)
    for n in range(count):
        url = f"sqlite:///{tmp / f'killed-{n}.db'}"
        args = [sys.executable, str(script), url, str(Path(__file__).parent), "400000", str(chunks)]
        child = subprocess.Popen(args, stdout=subprocess.PIPE, text=True)
        assert child.stdout is not None and child.stdout.readline().strip() == "started"
        started = time.monotonic()
        time.sleep(rng.uniform(0.5, 3.0))
        killed_at = time.monotonic()
        os.kill(child.pid, signal.SIGKILL)
        child.wait()
        made, made_at = 0, killed_at
        for line in child.stdout.read().splitlines():
            fields = line.split()
            if len(fields) == 2:  # the last line may be cut short by the kill
                made, made_at = int(fields[0]), float(fields[1])
        with EventLog(url, read_only=True) as log:
            ids = [event.event_id for event in log.read()]
            blocks = sum(len(tier) for tier in replay(log).snapshot().values())
        in_order = ids == list(range(len(ids)))
        rate = made / max(made_at - started, 1e-9)
        behind = made - len(ids)
        print(
            f"kill {n + 1}: the manager had made >= {made:,} events ({rate:,.0f}/s; counted"
            f" {1000 * (killed_at - made_at):.0f} ms before the kill), the log holds {len(ids):,}"
            f" (ids 0.. in order: {in_order}), behind by <= {behind:,} events"
            f" (~{1000 * behind / rate:.0f} ms); replayed to {blocks:,} blocks"
        )


def compare_tiers(args: argparse.Namespace, stream: list[list[bytes]], folder: Path) -> None:
    ours, theirs = tiering_managers(args.chunks, args.row_kib << 10, args.tier_blocks)
    ref: list[tuple[float, float]] = []
    got: list[tuple[float, float]] = []
    for run in range(args.repeat):  # interleaved, as below; each run's files removed after
        for make, results in ((theirs, ref), (ours, got)):
            where = folder / f"offload-bench-tiering-{os.getpid()}-{run}"
            results.append(tiering_rate(make, where, stream))
            shutil.rmtree(where)
    print(
        f"tiering: requests={args.requests} cpu chunks={args.chunks} row={args.row_kib} KiB"
        f" kvledger G3 blocks={args.tier_blocks} repeat={args.repeat} folder={folder}"
    )
    for i, unit in enumerate(("ops/s", "ops per CPU-s")):
        medians = []
        for name, runs in (("vLLM CPU + vLLM fs", ref), ("vLLM CPU + kvledger G3", got)):
            values = [round(r[i]) for r in runs]
            medians.append(statistics.median(values))
            print(f"{name:26}: {medians[-1]:12,.0f} {unit}  (runs {values})")
        print(f"ratio kvledger / vLLM fs  : {medians[1] / medians[0]:.2f}x ({unit})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=20_000)
    parser.add_argument("--chunks", type=int, default=2_000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--kills", type=int, default=0, help="SIGKILLed full-rate runs (0: none)")
    parser.add_argument(
        "--tiering", action="store_true", help="vLLM CPU + kvledger G3 vs vLLM CPU + vLLM fs"
    )
    parser.add_argument("--row-kib", type=int, default=64, help="with --tiering: chunk size")
    parser.add_argument("--tier-blocks", type=int, default=16_384, help="with --tiering")
    parser.add_argument("--dir", type=Path, default=None, help="with --tiering: the folder")
    args = parser.parse_args()
    stream = key_stream(args.requests)
    tmp = Path(tempfile.mkdtemp())
    if args.tiering:
        compare_tiers(args, stream, args.dir or tmp)
        return
    runs = iter(range(1_000_000))

    def ours() -> OffloadingManager:
        url = f"sqlite:///{tmp / f'offload-{next(runs)}.db'}"
        return KvledgerOffloadingManager(
            args.chunks,
            enable_events=True,
            log_url=url,
        )

    def vllms() -> OffloadingManager:
        return CPUOffloadingManager(args.chunks, enable_events=True)

    # interleaved, so that a change in the machine's load falls on both sides alike
    ref: list[tuple[float, float]] = []
    got: list[tuple[float, float]] = []
    for _ in range(args.repeat):
        ref.append(rate(vllms(), stream))
        got.append(rate(ours(), stream))
    print(f"requests={args.requests} chunks={args.chunks} repeat={args.repeat}")
    # per CPU second: what a busy machine disturbs least (a stalled process uses no CPU)
    for i, unit in enumerate(("ops/s", "ops per CPU-s")):
        medians = []
        for name, runs in (("vLLM CPUOffloadingManager", ref), ("kvledger (log on)", got)):
            values = [round(r[i]) for r in runs]
            medians.append(statistics.median(values))
            print(f"{name:26}: {medians[-1]:12,.0f} {unit}  (runs {values})")
        print(f"ratio kvledger / vLLM     : {medians[1] / medians[0]:.2f}x ({unit})")
    if args.kills:
        kills(args.kills, args.chunks, tmp)


if __name__ == "__main__":
    main()
