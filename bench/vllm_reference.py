"""vLLM 0.33's BlockPool as a benchmark reference, driven in its own interpreter.

vLLM lives in .bench-venv (built by bench/setup_bench_venv.sh), apart from the project's
environment: loading both into one process would mix two numpy builds. So a bench computes
its sequence hashes with kvledger, hands them to ``run_block_pool``, and this file runs
itself under .bench-venv/bin/python on them, printing what it measured as JSON. It imports
only the standard library at the top, so either interpreter can load it.

Per request, vLLM's real BlockPool API does what its KVCacheManager does for a
full-attention model: ``get_cached_block`` per hash until the first miss, ``touch`` the hits,
``get_new_blocks`` for the rest, ``cache_full_blocks``, then ``free_blocks`` of the reversed
list (tail first). Prefix caching on, events off. Hashes are passed as their 8 little-endian
bytes (shorter than vLLM's default 32-byte sha256 keys, which only favours vLLM); the
conversion happens before the clock starts.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
BENCH_PYTHON = REPO / ".bench-venv" / "bin" / "python"


class RequestHashes:
    """What vLLM's BlockPool.cache_full_blocks reads from a Request when events are off."""

    __slots__ = ("block_hashes",)

    def __init__(self, block_hashes: list[bytes]) -> None:
        self.block_hashes = block_hashes


def drive_block_pool(
    requests: Sequence[Sequence[int]], pool_blocks: int, block_size: int
) -> dict[str, float]:
    """Run every request through a fresh vLLM BlockPool of ``pool_blocks`` usable blocks.

    Runs under .bench-venv's interpreter. Returns seconds (the request loop only), hits and
    blocks requested.
    """
    from vllm.v1.core.block_pool import BlockPool

    reqs = [RequestHashes([h.to_bytes(8, "little") for h in row]) for row in requests]
    # vLLM keeps block 0 as its null block: one extra so both sides have pool_blocks usable.
    pool = BlockPool(pool_blocks + 1, enable_caching=True, hash_block_size=block_size)
    group_ids = [0]
    get_cached_block, touch = pool.get_cached_block, pool.touch
    get_new_blocks, cache_full_blocks, free_blocks = (
        pool.get_new_blocks,
        pool.cache_full_blocks,
        pool.free_blocks,
    )
    hits = blocks_requested = 0
    start = time.perf_counter()
    for req in reqs:
        hit = []
        for block_hash in req.block_hashes:
            cached = get_cached_block(block_hash, group_ids)
            if cached is None:
                break
            hit.append(cached[0])
        n_hit, n_blocks = len(hit), len(req.block_hashes)
        touch(hit)
        blocks = hit + get_new_blocks(n_blocks - n_hit)
        cache_full_blocks(req, blocks, n_hit, n_blocks, block_size, 0)
        free_blocks(reversed(blocks))
        hits += n_hit
        blocks_requested += n_blocks
    return {
        "seconds": time.perf_counter() - start,
        "hits": hits,
        "blocks_requested": blocks_requested,
    }


def run_block_pool(
    requests: Sequence[Sequence[int]], pool_blocks: int, block_size: int, *, repeat: int = 1
) -> list[dict[str, float]]:
    """``drive_block_pool`` in the bench venv, ``repeat`` times (fresh pool each); one dict
    per repetition. Raises RuntimeError with vLLM's stderr when the subprocess fails."""
    if not BENCH_PYTHON.exists():
        raise RuntimeError(f"{BENCH_PYTHON} is missing: run bash bench/setup_bench_venv.sh")
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "requests.json"
        path.write_text(json.dumps([list(map(int, row)) for row in requests]))
        env = {**os.environ, "VLLM_LOGGING_LEVEL": "ERROR", "PYTHONWARNINGS": "ignore"}
        cmd = [str(BENCH_PYTHON), __file__, str(path), str(pool_blocks), str(block_size)]
        proc = subprocess.run(
            [*cmd, str(repeat)], capture_output=True, text=True, env=env, check=False
        )
    if proc.returncode != 0:
        raise RuntimeError(f"vLLM side failed:\n{proc.stderr[-3000:]}")
    result: list[dict[str, Any]] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def _main(argv: list[str]) -> None:
    path, pool_blocks, block_size, repeat = argv
    requests = json.loads(Path(path).read_text())
    runs = [
        drive_block_pool(requests, int(pool_blocks), int(block_size)) for _ in range(int(repeat))
    ]
    print(json.dumps(runs))


if __name__ == "__main__":
    _main(sys.argv[1:])
