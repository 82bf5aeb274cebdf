"""Prefix-sharing workload through kvledger's BlockPool and through vLLM 0.33's BlockPool.

Workload (same seed, same hashes for both): 1000 requests of 2048 tokens, block size 16
(128 blocks each); every request is one of N shared 1024-token prefixes followed by 1024
tokens of its own. Variants: 8 prefixes, and 200 prefixes, whose working set (200 x 64
prefix blocks plus each request's 64 unique blocks) does not fit the 20000-block pool, so
prefixes are evicted and re-filled too. Requests run one after another. Per request, both
pools do what an engine's KV manager does:
  look up the longest cached prefix and take those blocks, allocate the rest, register
  (cache) the new full blocks, then free all of the request's blocks (tail first).
block-ops = blocks looked up (hits) + blocks allocated + blocks registered + blocks freed,
counted from what each pool actually did; block-ops/s uses only the timed request loop.

How the two sides are run (honest comparison, two interpreters):
- vLLM needs its own environment (.bench-venv, built by bench/setup_bench_venv.sh: torch CPU,
  vLLM 0.33.0 with --no-deps, and the modules its import chain needs). Mixing that
  environment's site-packages into the project's interpreter would load two numpy builds into
  one process, so the vLLM side runs this same file under .bench-venv/bin/python in a
  subprocess (``--vllm-side``).
- The sequence hashes are computed once here with kvledger's hashing and handed to the
  subprocess in a .npy file, so both pools see bit-identical hashes (vLLM gets each one as
  its 8 little-endian bytes: a BlockHash, as vLLM's xxhash-based hashing produces; shorter
  than its default 32-byte sha256 keys, which only favours vLLM). Converting hashes to each
  API's input form happens before timing on both sides.
- vLLM is driven through its real BlockPool API (get_cached_block per hash until the first
  miss, touch, get_new_blocks, cache_full_blocks, free_blocks of the reversed block list: what
  its KVCacheManager does for a full-attention model), with events off and prefix caching
  on. cache_full_blocks reads only ``request.block_hashes`` when events are off, so a small
  stand-in object carries them instead of a full vllm Request (which needs sampling params).
- kvledger runs match/allocate/register/release with an EventEmitter whose sink is a list's
  append: every Stored and Removed event is built and kept.
- Each run builds a fresh pool. The vLLM process stays up and the two sides alternate run by
  run (who goes first alternates too), so background load on a shared machine hits both
  alike; the best of ``--repeat`` runs is reported for each.

Run: bash bench/setup_bench_venv.sh   (once)
     .venv/bin/python bench/registry_bench.py
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
BENCH_PYTHON = REPO / ".bench-venv" / "bin" / "python"

N_REQUESTS = 1000
PROMPT_TOKENS = 2048
PREFIX_TOKENS = 1024
BLOCK_SIZE = 16
POOL_BLOCKS = 20000
VARIANTS = {"8 prefixes": 8, "200 prefixes": 200}
VOCAB = 150_000


# -- the vLLM side: runs under .bench-venv/bin/python, imports nothing of kvledger -----------


def run_vllm(hashes: Any) -> dict[str, float]:
    """One pass of the workload through a fresh vLLM BlockPool (the shared reference driver)."""
    from vllm_reference import drive_block_pool

    return drive_block_pool(hashes.tolist(), POOL_BLOCKS, BLOCK_SIZE)


def vllm_side(workload_dir: str) -> None:
    """Serve runs on request: each line on stdin names a variant; answer with one JSON line.

    Staying up between runs lets the parent alternate the two sides run by run, so a burst of
    load from other processes on the machine lands on both alike.
    """
    import numpy as np

    hashes = {name: np.load(Path(workload_dir) / f"{n}.npy") for name, n in VARIANTS.items()}
    print("ready", flush=True)
    for line in sys.stdin:
        print(json.dumps(run_vllm(hashes[line.strip()])), flush=True)


# -- the kvledger side ------------------------------------------------------------------------


def make_workload(n_prefixes: int, seed: int) -> list[tuple[list[int], list[tuple[int, int]]]]:
    """Per request: its sequence hashes and its (sequence_hash, local_hash) pairs."""
    from kvledger.registry.hashing import TokenBlockSequence

    rng = random.Random(seed * 1000 + n_prefixes)
    prefixes = [[rng.randrange(VOCAB) for _ in range(PREFIX_TOKENS)] for _ in range(n_prefixes)]
    out = []
    for _ in range(N_REQUESTS):
        own = [rng.randrange(VOCAB) for _ in range(PROMPT_TOKENS - PREFIX_TOKENS)]
        seq = TokenBlockSequence(rng.choice(prefixes) + own, BLOCK_SIZE)
        out.append(
            (seq.sequence_hashes, list(zip(seq.sequence_hashes, seq.local_hashes, strict=True)))
        )
    return out


def run_kvledger(workload: list[tuple[list[int], list[tuple[int, int]]]]) -> dict[str, float]:
    from kvledger.events.types import Tier
    from kvledger.registry.emitter import EventEmitter
    from kvledger.registry.pool import BlockPool

    events: list[object] = []
    pool = BlockPool(POOL_BLOCKS, tier=Tier.G1, policy="lru", emitter=EventEmitter(events.append))
    match, allocate, register, release = pool.match, pool.allocate, pool.register, pool.release
    hits = 0
    start = time.perf_counter()
    for seqs, pairs in workload:
        hit = match(seqs)
        n_hit = len(hit)
        new = allocate(len(seqs) - n_hit)
        slots = register(new, pairs[n_hit:], seqs[n_hit - 1] if n_hit else None)
        release((hit + slots)[::-1])
        hits += n_hit
    elapsed = time.perf_counter() - start
    return {"seconds": elapsed, "hits": hits, "events": len(events)}


def block_ops(hits: float) -> float:
    n_blocks = PROMPT_TOKENS // BLOCK_SIZE
    allocated = N_REQUESTS * n_blocks - hits
    return hits + allocated + allocated + N_REQUESTS * n_blocks  # looked up, alloc, reg, freed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--vllm-side", metavar="DIR", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.vllm_side:
        vllm_side(args.vllm_side)
        return 0
    if not BENCH_PYTHON.exists():
        print(f"{BENCH_PYTHON} is missing: run bash bench/setup_bench_venv.sh first")
        return 1

    import numpy as np

    workloads = {name: make_workload(n, args.seed) for name, n in VARIANTS.items()}
    best_ours: dict[str, dict[str, float]] = {}
    best_vllm: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, n in VARIANTS.items():
            rows = [seqs for seqs, _ in workloads[name]]
            np.save(Path(tmp) / f"{n}.npy", np.array(rows, dtype=np.uint64))
        env = {**os.environ, "VLLM_LOGGING_LEVEL": "ERROR", "PYTHONWARNINGS": "ignore"}
        vllm = subprocess.Popen(
            [str(BENCH_PYTHON), __file__, "--vllm-side", tmp],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
        )  # fmt: skip
        assert vllm.stdin is not None and vllm.stdout is not None
        if vllm.stdout.readline().strip() != "ready":
            print("the vLLM side failed to start (its error is above)")
            return 1
        for rep in range(args.repeat):
            for name in VARIANTS:
                # alternate which side goes first, so neither always runs on a warmer machine
                for side in ("ours", "vllm") if rep % 2 == 0 else ("vllm", "ours"):
                    if side == "ours":
                        res, best = run_kvledger(workloads[name]), best_ours
                    else:
                        vllm.stdin.write(name + "\n")
                        vllm.stdin.flush()
                        res, best = json.loads(vllm.stdout.readline()), best_vllm
                    if name not in best or res["seconds"] < best[name]["seconds"]:
                        best[name] = res
        vllm.stdin.close()
        vllm.wait()

    n_blocks = PROMPT_TOKENS // BLOCK_SIZE
    print(
        f"{N_REQUESTS} requests x {PROMPT_TOKENS} tokens, block size {BLOCK_SIZE}, pool "
        f"{POOL_BLOCKS} blocks, {PREFIX_TOKENS}-token shared prefixes; best of {args.repeat}"
    )
    print(
        f"{'variant':<13} {'side':<26} {'hit rate':>8} {'M block-ops/s':>14} {'ms':>8} "
        f"{'events':>7}"
    )
    for name in VARIANTS:
        rates = {}
        for side, res in (
            ("kvledger (events to list)", best_ours[name]),
            ("vLLM 0.33 (events off)", best_vllm[name]),
        ):
            rate = block_ops(res["hits"]) / res["seconds"]
            rates[side] = rate
            hit_rate = res["hits"] / (N_REQUESTS * n_blocks)
            events = str(int(res["events"])) if "events" in res else "-"
            print(
                f"{name:<13} {side:<26} {hit_rate:>8.1%} {rate / 1e6:>14.2f} "
                f"{res['seconds'] * 1e3:>8.1f} {events:>7}"
            )
        ours_rate, theirs_rate = rates.values()
        print(f"{name:<13} ratio kvledger / vLLM: {ours_rate / theirs_rate:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
