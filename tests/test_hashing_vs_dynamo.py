"""Our hashes against Dynamo's own (ai-dynamo-runtime 1.6.1), so routers agree with us.

Local hashes are compared directly with ``compute_block_hash_for_seq``. The package exposes no
function that returns sequence hashes, so those are checked through Dynamo's ``RadixTree``: it
files each stored block under the sequence hash it is given and looks a continuation's parent
up by that hash, so a suffix stored with our parent hash only attaches if our chain names the
prefix the way the tree recorded it, and a removal by our sequence hash must cut the match
exactly there. The chain formula itself is pinned by DESIGN.md's vector, taken from live
events of this runtime and its mocker (seed 1337).
"""

from __future__ import annotations

import json
import random

import pytest

from kvledger.registry.hashing import (
    TokenBlock,
    TokenBlockSequence,
    block_seed,
    chain_sequence_hashes,
    local_hashes,
)

dynamo_llm = pytest.importorskip("dynamo.llm", reason="ai-dynamo-runtime is not installed")

LORA_NAMES = [None, "", "sql-adapter", "lora/üñí", "x" * 200]


@pytest.mark.parametrize("trial", range(40))
def test_local_hashes_match_compute_block_hash_for_seq(trial: int) -> None:
    rng = random.Random(trial)
    block_size = rng.choice([1, 2, 3, 4, 7, 16, 32, 64, 128])
    tokens = [rng.randrange(2**32) for _ in range(rng.randrange(0, 600))]
    lora_name = rng.choice(LORA_NAMES)
    salt = rng.choice([None, "", "tenant-a"])
    theirs = dynamo_llm.compute_block_hash_for_seq(
        tokens, block_size, lora_name=lora_name, cache_namespace=salt
    )
    seed = block_seed(lora_name=lora_name, salt=salt)
    assert local_hashes(tokens, block_size, seed=seed) == theirs
    seq = TokenBlockSequence(tokens, block_size, lora_name=lora_name, salt=salt)
    assert seq.local_hashes == theirs


def _stored(event_id: int, parent: int | None, blocks: list[TokenBlock]) -> bytes:
    data = [{"block_hash": b.sequence_hash, "tokens_hash": b.local_hash} for b in blocks]
    event = {"event_id": event_id, "data": {"stored": {"parent_hash": parent, "blocks": data}}}
    return json.dumps(event).encode()


def _removed(event_id: int, hashes: list[int]) -> bytes:
    event = {"event_id": event_id, "data": {"removed": {"block_hashes": hashes}}}
    return json.dumps(event).encode()


@pytest.mark.parametrize("trial", range(8))
def test_radix_tree_follows_our_sequence_hash_chain(trial: int) -> None:
    rng = random.Random(1000 + trial)
    block_size = rng.choice([4, 16, 64])
    lora_name = rng.choice(LORA_NAMES)
    prefix = [rng.randrange(2**32) for _ in range(block_size * rng.randrange(2, 6))]
    tree = dynamo_llm.RadixTree()

    # Worker 1 caches request A whole; request B shares A's prefix and stores only its suffix,
    # anchored to the sequence hash of the last shared block.
    a = TokenBlockSequence(prefix + [1] * (3 * block_size), block_size, lora_name=lora_name)
    b = TokenBlockSequence(prefix + [2] * (4 * block_size), block_size, lora_name=lora_name)
    shared = len(prefix) // block_size
    assert a.sequence_hashes[:shared] == b.sequence_hashes[:shared]
    assert a.sequence_hashes[shared] != b.sequence_hashes[shared]
    tree.apply_event(1, _stored(0, None, a.blocks))
    tree.apply_event(1, _stored(1, b.sequence_hashes[shared - 1], b.blocks[shared:]))
    assert tree.find_matches(a.local_hashes).scores == {(1, 0): len(a)}
    assert tree.find_matches(b.local_hashes).scores == {(1, 0): len(b)}

    # A parent hash the tree never saw is refused: the check above can fail.
    with pytest.raises(RuntimeError, match="parent"):
        tree.apply_event(2, _stored(0, b.sequence_hashes[shared - 1] ^ 1, b.blocks[shared:]))

    # Removing by our sequence hash cuts B's match at exactly that block.
    cut = shared + 1
    tree.apply_event(1, _removed(2, [b.sequence_hashes[cut]]))
    assert tree.find_matches(b.local_hashes).scores == {(1, 0): cut}
    assert tree.find_matches(a.local_hashes).scores == {(1, 0): len(a)}


def test_design_vector_against_dynamo() -> None:
    theirs = dynamo_llm.compute_block_hash_for_seq(list(range(8)), 4)
    assert theirs == [9143094415614847814, 12124091508212882195]
    assert chain_sequence_hashes(theirs) == [9143094415614847814, 9510318385840434533]
