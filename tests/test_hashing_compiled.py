"""The compiled chain hashes (``registry/_chain.c``) against xxhash itself.

``_chain`` computes XXH3-64 of 16 packed bytes by the algorithm's 9-16 byte path; the
reference is the xxhash package hashing ``struct.pack("<QQ", ...)``, which is what the Python
path does and what Dynamo's hashes were checked against (``tests/test_hashing_vs_dynamo.py``).
Values and seeds are drawn over the whole u64 range, edges included; a chain is compared with
and without a parent; a value that is not a u64 gets the Python path's message.
"""

from __future__ import annotations

import struct
from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from switches import python_with
from xxhash import xxh3_64_intdigest

from kvledger.registry import hashing

pytestmark = pytest.mark.skipif(
    not hashing.COMPILED_CHAIN, reason="kvledger.registry._chain is not built or switched off"
)
_chain = pytest.importorskip("kvledger.registry._chain")

U64 = st.one_of(
    st.integers(0, 2**64 - 1), st.sampled_from([0, 1, 1337, 2**63, 2**64 - 1, 2**32 - 1])
)


def reference_chain(locals_: list[int], parent: int | None, seed: int) -> list[int]:
    out: list[int] = []
    prev = parent
    for local in locals_:
        prev = local if prev is None else xxh3_64_intdigest(struct.pack("<QQ", prev, local), seed)
        out.append(prev)
    return out


@settings(max_examples=500, deadline=None)
@given(low=U64, high=U64, seed=U64)
def test_a_pair_hashes_as_xxhash_does(low: int, high: int, seed: int) -> None:
    assert _chain.pair(low, high, seed) == xxh3_64_intdigest(struct.pack("<QQ", low, high), seed)
    assert hashing.pair_hash(low, high, seed) == _chain.pair(low, high, seed)


@settings(max_examples=300, deadline=None)
@given(
    locals_=st.lists(U64, max_size=40),
    parent=st.one_of(st.none(), U64),
    seed=U64,
    as_tuple=st.booleans(),
)
def test_a_chain_hashes_as_xxhash_does(
    locals_: list[int], parent: int | None, seed: int, as_tuple: bool
) -> None:
    given_ = tuple(locals_) if as_tuple else locals_
    expected = reference_chain(locals_, parent, seed)
    assert hashing.chain_sequence_hashes(given_, parent=parent, seed=seed) == expected


@pytest.mark.parametrize(
    "locals_, parent, message",
    [
        ([1, -1], None, "local hash 1 is -1"),
        ([1, 2**64], None, "local hash 1 is 18446744073709551616"),
        ([1, "2"], None, "local hash 1 is '2'"),
        ([1, 2], -5, "parent is -5"),
    ],
)
def test_a_bad_value_gets_the_python_message(
    locals_: list[object], parent: int | None, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        hashing.chain_sequence_hashes(locals_, parent=parent)  # type: ignore[arg-type]


def outcome(hash_: Callable[[], int]) -> int | tuple[type[BaseException], str]:
    """What a hash call gives: its value, or its exception's type and message."""
    try:
        return hash_()
    except Exception as exc:
        return type(exc), str(exc)


@pytest.mark.parametrize(
    "low, high, seed", [(-1, 2, 0), (1, 2**64, 0), (1, 2, -1), ("1", 2, 0), (1, 2.0, 0)]
)
def test_a_pair_that_is_not_u64s_goes_as_the_python_path_goes(
    low: int, high: int, seed: int
) -> None:
    """The same exception and message with the compiled hashes or without them, or the same
    value where xxhash takes what the compiled pair does not (a negative seed)."""
    python = outcome(lambda: xxh3_64_intdigest(struct.pack("<QQ", low, high), seed))
    assert outcome(lambda: hashing.pair_hash(low, high, seed)) == python
    assert outcome(lambda: hashing.sequence_hash(low, high, seed=seed)) == python


@pytest.mark.parametrize("value, compiled", [("1", False), ("0", True), ("", True)])
def test_the_switch_turns_the_compiled_hashes_off(value: str, compiled: bool) -> None:
    """``KVLEDGER_PYTHON_CHAIN=1``: xxhash through struct."""
    code = "from kvledger.registry import hashing as h; print(h.COMPILED_CHAIN)"
    out = python_with("KVLEDGER_PYTHON_CHAIN", value, code)
    assert out.stdout.split() == [str(compiled)]
