"""Scheduler-side offload bookkeeping: kvledger's OffloadingManager (event log on) against
vLLM 0.33's CPUOffloadingManager, on the same key stream, in the same run.

Each request does what vLLM's OffloadingConnector scheduler asks of a manager: ``lookup`` per
block until the first miss, ``prepare_load`` + ``touch`` + ``complete_load`` of the hits,
``prepare_store`` + ``complete_store`` of the rest, ``on_request_finished``. Requests share
prefixes (a Zipf-ish pick among a few hundred documents), so there are hits, evictions and
reuse. Prints operations/s of each and the ratio kvledger / vLLM.

Run in the vLLM test venv (tests/integrations/setup_vllm_test_venv.sh):
    .vllm-test-venv/bin/python bench/offload_bench.py [--requests N] [--repeat R]

``--g3-blocks N`` gives kvledger's manager a G3 below G2 (vLLM's has none): G2's evictions
are then demoted and G3 hits promoted, which is the bookkeeping a G3 costs per operation.
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from vllm.v1.kv_offload.base import LookupResult, OffloadingManager, ReqContext, make_offload_key
from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager

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


def drive(manager: OffloadingManager, stream: list[list[bytes]]) -> tuple[float, int]:
    """Seconds for the whole stream, and the number of manager calls made."""
    calls = 0
    start = time.perf_counter()
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
    return time.perf_counter() - start, calls


def measure(
    make: Callable[[], OffloadingManager], stream: list[list[bytes]], repeat: int
) -> list[float]:
    rates = []
    for _ in range(repeat):
        manager = make()
        seconds, calls = drive(manager, stream)
        if isinstance(manager, KvledgerOffloadingManager):
            manager.flush_log()
            manager.shutdown()
        rates.append(calls / seconds)
    return rates


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=20_000)
    parser.add_argument("--chunks", type=int, default=2_000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument(
        "--g3-blocks", type=int, default=0, help="kvledger only: a G3 of this many blocks below G2"
    )
    parser.add_argument("--offload-filter", default="always", help="with --g3-blocks")
    args = parser.parse_args()
    stream = key_stream(args.requests)
    tmp = Path(tempfile.mkdtemp())
    runs = iter(range(1_000_000))

    def ours() -> OffloadingManager:
        url = f"sqlite:///{tmp / f'offload-{next(runs)}.db'}"
        return KvledgerOffloadingManager(
            args.chunks,
            enable_events=True,
            log_url=url,
            g3_blocks=args.g3_blocks,
            offload_filter=args.offload_filter,
        )

    def vllms() -> OffloadingManager:
        return CPUOffloadingManager(args.chunks, enable_events=True)

    ref = measure(vllms, stream, args.repeat)
    got = measure(ours, stream, args.repeat)
    med_ref, med_got = statistics.median(ref), statistics.median(got)
    print(
        f"requests={args.requests} chunks={args.chunks} repeat={args.repeat}"
        f" g3_blocks={args.g3_blocks} offload_filter={args.offload_filter}"
    )
    print(f"vLLM CPUOffloadingManager : {med_ref:12,.0f} ops/s  (runs {[round(r) for r in ref]})")
    print(f"kvledger (log on)         : {med_got:12,.0f} ops/s  (runs {[round(r) for r in got]})")
    print(f"ratio kvledger / vLLM     : {med_got / med_ref:.2f}x")


if __name__ == "__main__":
    main()
