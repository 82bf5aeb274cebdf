"""Hashing a 4096-token prompt: kvledger vs Dynamo's Rust ``compute_block_hash_for_seq``.

Both sides start from the same Python list of token ids, so both pay for turning it into u32s.
Two comparisons per block size:
- local hashes: ours vs ``compute_block_hash_for_seq`` (ratio > 1 means we are faster);
- local + sequence hashes: ours vs Dynamo's local hashes followed by a chain. ai-dynamo-runtime
  exposes no chaining function, so its chain is our ``chain_sequence_hashes`` too; this row
  shows what a Python caller of Dynamo would pay for the full set of hashes.

Run: .venv/bin/python bench/hash_bench.py
"""

from __future__ import annotations

import random
import sys
import timeit
from collections.abc import Callable
from functools import partial

from kvledger.registry.hashing import TokenBlockSequence, chain_sequence_hashes, local_hashes

PROMPT_TOKENS = 4096
BLOCK_SIZES = (16, 64)


def best_us_pair(
    ours: Callable[[], object], theirs: Callable[[], object], number: int = 2000, repeat: int = 9
) -> tuple[float, float]:
    """Best mean time per call (us) of each, timed in alternation so load from other
    processes on a shared machine hits both alike."""
    best = [float("inf"), float("inf")]
    for _ in range(repeat):
        for i, fn in enumerate((ours, theirs)):
            best[i] = min(best[i], timeit.timeit(fn, number=number) / number * 1e6)
    return best[0], best[1]


def dynamo_local_and_chain(
    compute: Callable[[list[int], int], list[int]], tokens: list[int], block_size: int
) -> list[int]:
    return chain_sequence_hashes(compute(tokens, block_size))


def main() -> int:
    try:
        from dynamo.llm import compute_block_hash_for_seq
    except ImportError:
        print("ai-dynamo-runtime is not installed: pip install ai-dynamo-runtime==1.6.1")
        return 1
    rng = random.Random(0)
    tokens = [rng.randrange(150_000) for _ in range(PROMPT_TOKENS)]
    print(
        f"hashing a {PROMPT_TOKENS}-token prompt (Python list of ints), "
        "best of 9 x 2000 calls, alternating"
    )
    print(f"{'block':>5} {'what':<22} {'kvledger us':>12} {'dynamo us':>10} {'ratio':>6}")
    for bs in BLOCK_SIZES:
        assert local_hashes(tokens, bs) == compute_block_hash_for_seq(tokens, bs)
        ours_local, theirs_local = best_us_pair(
            partial(local_hashes, tokens, bs), partial(compute_block_hash_for_seq, tokens, bs)
        )
        ours_full, theirs_full = best_us_pair(
            partial(TokenBlockSequence, tokens, bs),
            partial(dynamo_local_and_chain, compute_block_hash_for_seq, tokens, bs),
        )
        for what, ours, theirs in (
            ("local hashes", ours_local, theirs_local),
            ("local + sequence", ours_full, theirs_full),
        ):
            print(f"{bs:>5} {what:<22} {ours:>12.1f} {theirs:>10.1f} {theirs / ours:>6.2f}")
    print("ratio = dynamo time / kvledger time (>= 1: kvledger is no slower)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
