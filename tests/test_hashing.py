"""Block hashes: the published test vector, seeds, validation, and incremental == whole."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from xxhash import xxh3_64_intdigest

from kvledger.registry.hashing import (
    BLOCK_HASH_SEED,
    TokenBlock,
    TokenBlockSequence,
    block_seed,
    chain_sequence_hashes,
    local_hashes,
    sequence_hash,
    token_bytes,
)

# DESIGN.md's vector: tokens 0..7, block size 4.
VECTOR_LOCAL = [9143094415614847814, 12124091508212882195]
VECTOR_SEQ = [9143094415614847814, 9510318385840434533]


def test_design_vector() -> None:
    assert local_hashes(list(range(8)), 4) == VECTOR_LOCAL
    assert chain_sequence_hashes(VECTOR_LOCAL) == VECTOR_SEQ
    seq = TokenBlockSequence(list(range(8)), 4)
    assert seq.local_hashes == VECTOR_LOCAL
    assert seq.sequence_hashes == VECTOR_SEQ
    assert seq.blocks == [TokenBlock(VECTOR_LOCAL[0], VECTOR_SEQ[0], 0),
                          TokenBlock(VECTOR_LOCAL[1], VECTOR_SEQ[1], 1)]  # fmt: skip


def test_local_hash_is_xxh3_of_le_u32_tokens() -> None:
    tokens = [1, 70000, 2**32 - 1, 5]
    raw = b"".join(t.to_bytes(4, "little") for t in tokens)
    assert local_hashes(tokens, 4) == [xxh3_64_intdigest(raw, BLOCK_HASH_SEED)]


def test_partial_tail_has_no_hash() -> None:
    assert local_hashes(list(range(7)), 4) == VECTOR_LOCAL[:1]
    assert local_hashes([1, 2, 3], 4) == []
    assert local_hashes([], 4) == []
    seq = TokenBlockSequence(list(range(7)), 4)
    assert len(seq) == 1
    assert seq.tail == [4, 5, 6]
    assert seq.num_tokens == 7


def test_sequence_hash_chains_parent_and_local_as_le_u64() -> None:
    raw = VECTOR_SEQ[0].to_bytes(8, "little") + VECTOR_LOCAL[1].to_bytes(8, "little")
    assert sequence_hash(VECTOR_SEQ[0], VECTOR_LOCAL[1]) == xxh3_64_intdigest(raw, 1337)
    assert sequence_hash(VECTOR_SEQ[0], VECTOR_LOCAL[1]) == VECTOR_SEQ[1]


def test_chain_continues_from_a_parent() -> None:
    # The suffix chained from the prefix's last hash equals the whole chain's suffix.
    locals_ = local_hashes(list(range(40)), 4)
    whole = chain_sequence_hashes(locals_)
    assert chain_sequence_hashes(locals_[6:], parent=whole[5]) == whole[6:]


def test_chain_seed_changes_every_hash_but_the_first() -> None:
    seed0 = chain_sequence_hashes(VECTOR_LOCAL, seed=0)
    assert seed0[0] == VECTOR_SEQ[0]
    assert seed0[1] != VECTOR_SEQ[1]
    seq = TokenBlockSequence(list(range(8)), 4, chain_seed=0)
    assert seq.sequence_hashes == seed0
    assert seq.local_hashes == VECTOR_LOCAL


def test_lora_and_salt_move_the_seed() -> None:
    base = block_seed()
    assert base == BLOCK_HASH_SEED
    assert block_seed(lora_name="") == base  # empty means absent, as in Dynamo
    assert block_seed(salt="") == base
    seeds = {base, block_seed(lora_name="a"), block_seed(lora_name="b"), block_seed(salt="a")}
    seeds.add(block_seed(lora_name="a", salt="a"))
    assert len(seeds) == 5  # the name and the salt mix differently
    assert block_seed(lora_name="a") == (1337 + xxh3_64_intdigest(b"a", 0)) % 2**64
    lora = TokenBlockSequence(list(range(8)), 4, lora_name="a")
    assert lora.seed == block_seed(lora_name="a")
    assert lora.local_hashes == local_hashes(list(range(8)), 4, seed=lora.seed)
    assert lora.local_hashes != VECTOR_LOCAL


def test_numpy_input_hashes_like_a_list() -> None:
    tokens = list(range(1000, 1100))
    expected = local_hashes(tokens, 16)
    for dtype in (np.int64, np.int32, np.uint32, np.uint16):
        assert local_hashes(np.array(tokens, dtype=dtype), 16) == expected
    seq = TokenBlockSequence(np.array(tokens[:50]), 16)
    seq.extend(np.array(tokens[50:]))
    assert seq.local_hashes == expected


@pytest.mark.parametrize(
    ("tokens", "fragment"),
    [
        ([1, -1, 2], "token 1 is -1"),
        ([1, 2, 2**32], "token 2 is 4294967296"),
        ([1.5], "token 0 is 1.5 (float)"),
        (["7"], "token 0 is '7' (str)"),
        (np.array([3, -4]), "token 1 is -4"),
        (np.array([1.0, 2.0]), "1-D integer array"),
        (np.zeros((2, 2), dtype=np.int64), "1-D integer array"),
    ],
)
def test_bad_tokens_are_named(tokens: object, fragment: str) -> None:
    with pytest.raises(ValueError, match="token") as err:
        token_bytes(tokens)  # type: ignore[arg-type]
    assert fragment in str(err.value)


@pytest.mark.parametrize("block_size", [0, -4, 2.5, True, "16"])
def test_bad_block_size_is_named(block_size: object) -> None:
    with pytest.raises(ValueError, match="block_size must be a positive integer"):
        local_hashes([1, 2, 3], block_size)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="block_size"):
        TokenBlockSequence([1, 2, 3], block_size)  # type: ignore[arg-type]


def test_bad_chain_input_is_named() -> None:
    with pytest.raises(ValueError, match="local hash 1 is -5"):
        chain_sequence_hashes([1, -5])
    with pytest.raises(ValueError, match="parent is -1"):
        chain_sequence_hashes([1], parent=-1)


def test_failed_extend_changes_nothing() -> None:
    seq = TokenBlockSequence(list(range(6)), 4)
    with pytest.raises(ValueError):
        seq.extend([6, 7, -8, 9])
    assert seq.tail == [4, 5]
    assert len(seq) == 1


def test_extend_returns_only_newly_completed_blocks() -> None:
    seq = TokenBlockSequence([], 4)
    assert seq.extend([0, 1, 2]) == []
    assert seq.append(3) == TokenBlock(VECTOR_LOCAL[0], VECTOR_SEQ[0], 0)
    assert seq.append(4) is None
    done = seq.extend([5, 6, 7, 8, 9, 10, 11, 12])
    assert [b.position for b in done] == [1, 2]
    assert done[0] == TokenBlock(VECTOR_LOCAL[1], VECTOR_SEQ[1], 1)
    assert seq.tail == [12]


def test_returned_lists_are_copies() -> None:
    seq = TokenBlockSequence(list(range(8)), 4)
    seq.sequence_hashes.clear()
    seq.blocks.clear()
    seq.local_hashes.append(1)
    assert seq.sequence_hashes == VECTOR_SEQ
    assert len(seq.blocks) == 2
    assert seq.local_hashes == VECTOR_LOCAL


@settings(max_examples=150, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 2**32 - 1), max_size=200),
    block_size=st.integers(1, 33),
    cuts=st.lists(st.integers(0, 200), max_size=8),
    lora_name=st.none() | st.text(max_size=8),
    chain_seed=st.sampled_from([0, 1337]),
)
def test_extend_in_pieces_equals_hashing_whole(
    tokens: list[int], block_size: int, cuts: list[int], lora_name: str | None, chain_seed: int
) -> None:
    whole = TokenBlockSequence(tokens, block_size, lora_name=lora_name, chain_seed=chain_seed)
    pieces = TokenBlockSequence([], block_size, lora_name=lora_name, chain_seed=chain_seed)
    completed: list[TokenBlock] = []
    bounds = [0, *sorted(c for c in cuts if c <= len(tokens)), len(tokens)]
    for start, end in itertools.pairwise(bounds):
        completed += pieces.extend(tokens[start:end])
    assert pieces.blocks == whole.blocks == completed
    assert pieces.tail == whole.tail == tokens[len(whole) * block_size :]
    seed = block_seed(lora_name=lora_name)
    expected_local = local_hashes(tokens, block_size, seed=seed)
    assert whole.local_hashes == expected_local
    assert whole.sequence_hashes == chain_sequence_hashes(expected_local, seed=chain_seed)
    assert [b.position for b in whole.blocks] == list(range(len(whole)))
