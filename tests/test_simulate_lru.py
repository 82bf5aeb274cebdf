"""Engine-off replay of the Mooncake conversation trace against an independent LRU model.

The model knows nothing of our pools, hashes or events: it names each block by the tuple of
trace block ids up to it (the prefix it represents) and keeps an OrderedDict in LRU order.
Rules it shares with the documented behaviour: the request's own cached prefix cannot be
evicted to make room for its new blocks, and a finished request's blocks are released last
block first (so its first block is the most recently used).
"""

from __future__ import annotations

import json
import os
from collections import OrderedDict
from itertools import islice
from pathlib import Path

import pytest

from kvledger.mocker.cache import SimulatedCache
from kvledger.mocker.engine_off import replay_cache
from kvledger.mocker.traces import load_mooncake

# The shared data folder sits beside the checkout; KVLEDGER_SHARED_DATA points elsewhere
# (a clone in another folder).
SHARED_DATA = Path(
    os.environ.get("KVLEDGER_SHARED_DATA", Path(__file__).resolve().parents[2] / "shared/data")
)
TRACE = SHARED_DATA / "mooncake/conversation_trace.jsonl"
BLOCK = 512

pytestmark = pytest.mark.skipif(
    not TRACE.exists(), reason=f"trace not found at {TRACE} (set KVLEDGER_SHARED_DATA)"
)


def lru_prefix_hits(path: Path, capacity: int) -> tuple[int, int, int, int]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    rows.sort(key=lambda r: r["timestamp"])  # stable: ties keep file order
    cache: OrderedDict[tuple[int, ...], None] = OrderedDict()
    blocks = hit_blocks = tokens = hit_tokens = 0
    for row in rows:
        ids = row["hash_ids"]
        keys = [tuple(ids[: i + 1]) for i in range(len(ids))]
        hit = 0
        while hit < len(keys) and keys[hit] in cache:
            hit += 1
        protected = set(keys[:hit])
        new = keys[hit:]
        room = capacity - len(cache)
        if len(new) > room:
            unprotected = (k for k in cache if k not in protected)
            victims = list(islice(unprotected, len(new) - room))
            for k in victims:
                del cache[k]
            room += len(victims)
        placed = keys[: hit + min(len(new), room)]
        for k in placed[hit:]:
            cache[k] = None
        for k in reversed(placed):
            cache.move_to_end(k)
        blocks += len(keys)
        hit_blocks += hit
        tokens += row["input_length"]
        hit_tokens += min(hit * BLOCK, row["input_length"])
    return blocks, hit_blocks, tokens, hit_tokens


@pytest.mark.parametrize("capacity", [64, 1000, 5000, 40000])
def test_engine_off_lru_matches_independent_model(capacity: int) -> None:
    blocks, hit_blocks, tokens, hit_tokens = lru_prefix_hits(TRACE, capacity)
    cache = SimulatedCache.build(capacity, policy="lru")
    stats = replay_cache(load_mooncake(TRACE), cache, BLOCK)
    assert stats.blocks_requested == blocks
    assert stats.blocks_hit == hit_blocks
    assert stats.tokens_requested == tokens
    assert stats.tokens_hit == hit_tokens
    assert stats.hit_rate == hit_blocks / blocks
    assert hit_blocks > 0 or capacity < 100
