"""Block hashes: what names a block of tokens, and what names a whole prefix.

Routers, engines and every kvledger worker must agree on these numbers bit for bit, so they
follow Dynamo's definitions exactly (checked against ``ai-dynamo-runtime`` 1.6.1 in the tests):

- local hash: xxh3-64 of the block's token ids as little-endian u32, seed 1337. A LoRA adapter
  name or a cache salt moves the seed (:func:`block_seed`), so equal tokens under different
  adapters never share a block.
- sequence hash: the first block's local hash; every later block's is the xxh3-64 of the
  16 bytes ``(parent sequence hash, local hash)`` as two little-endian u64, seed ``chain_seed``.
  1337 is what ``ai-dynamo-runtime`` 1.6.1 and its mocker put on the wire; Dynamo's newest
  tokens crate chains with 0, so the chain seed is a parameter.

Speed: converting a Python list of token ids into bytes costs more than hashing them. The
stdlib ``array('I', ...)`` does that conversion about three times faster than ``numpy.array``,
so lists go through it; numpy arrays hand over their buffer directly. numpy is not imported
here: a caller that hands over numpy values has imported it already, and one that does not (the
simulator) is spared its start-up cost.
"""

from __future__ import annotations

import os
import struct
import sys
from array import array
from collections.abc import Iterable, Sequence
from itertools import repeat
from operator import itemgetter
from types import ModuleType
from typing import TYPE_CHECKING, NamedTuple, TypeAlias, cast

from xxhash import xxh3_64_intdigest

BLOCK_HASH_SEED = 1337
"""Dynamo's XXH3_SEED for local (per-block) hashes."""

DEFAULT_CHAIN_SEED = 1337
"""Seed chaining sequence hashes in ai-dynamo-runtime 1.6.1 (the newest tokens crate uses 0)."""

_U32_LIMIT = 1 << 32
_U64_MASK = (1 << 64) - 1
_PACK_PAIR = struct.Struct("<QQ").pack

try:
    from kvledger.registry import _chain
except ImportError:  # xxhash through struct serves
    COMPILED_CHAIN = False
else:
    COMPILED_CHAIN = os.environ.get("KVLEDGER_PYTHON_CHAIN", "") in ("", "0")
"""Whether a pair's hash and a chain's sequence hashes are computed by ``registry/_chain.c``
(XXH3-64 of the 16 packed bytes, about a dozen instructions where the pack and the xxhash call
cost some 650), with the same values (``tests/test_hashing_compiled.py``). False where the
module was not built (no C compiler at install) or ``KVLEDGER_PYTHON_CHAIN=1`` is in the
environment."""

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt

Tokens: TypeAlias = "Sequence[int] | npt.NDArray[np.integer]"

if array("I").itemsize != 4:  # pragma: no cover - every CPython platform kvledger targets
    raise ImportError("array('I') is not 32 bits wide on this platform; token hashing needs it")


class TokenBlock(NamedTuple):
    """One full block: its own tokens' hash, the hash of the prefix it ends, and its index."""

    local_hash: int
    sequence_hash: int
    position: int


def block_seed(*, lora_name: str | None = None, salt: str | None = None) -> int:
    """The local-hash seed for requests under ``lora_name`` and/or cache ``salt``.

    Matches Dynamo: 1337, plus xxh3-64(lora name, seed 0), plus xxh3-64(salt, seed 1), wrapping
    at 2**64. Empty strings count as absent, so ``lora_name=""`` shares the base model's cache.
    """
    seed = BLOCK_HASH_SEED
    if lora_name:
        seed += xxh3_64_intdigest(lora_name.encode(), 0)
    if salt:
        seed += xxh3_64_intdigest(salt.encode(), 1)
    return seed & _U64_MASK


def names_plain_block(tokens: bytes, local_hash: int) -> bool:
    """Whether ``tokens`` (little-endian u32 bytes) hash to ``local_hash`` with no LoRA name
    and no salt. The durable log keeps a block's tokens but not what seeded its hash: a block
    that fails this had one, and its tokens alone would name another block to a router."""
    return xxh3_64_intdigest(tokens, BLOCK_HASH_SEED) == local_hash


def _check_block_size(block_size: int) -> None:
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be a positive integer, got {block_size!r}")


def _numpy() -> ModuleType | None:
    """numpy if anyone has imported it; without it, no value can be a numpy one."""
    return sys.modules.get("numpy")


def _first_bad_token(tokens: Iterable[object]) -> tuple[int, object]:
    numpy = _numpy()
    integer = int if numpy is None else int | numpy.integer
    for i, tok in enumerate(tokens):
        if isinstance(tok, bool) or not isinstance(tok, integer):
            return i, tok
        if not 0 <= int(tok) < _U32_LIMIT:
            return i, tok
    raise AssertionError("no bad token found")  # pragma: no cover - only called on failure


def _bad_tokens_error(tokens: Iterable[object]) -> ValueError:
    i, tok = _first_bad_token(tokens)
    return ValueError(
        f"token ids must be integers in [0, 2**32); token {i} is {tok!r} ({type(tok).__name__})"
    )


def token_bytes(tokens: Tokens) -> bytes:
    """``tokens`` as little-endian u32 bytes, the form every block hash is computed over."""
    numpy = _numpy()
    if numpy is not None and isinstance(tokens, numpy.ndarray):
        ids = cast("npt.NDArray[np.integer]", tokens)
        if ids.ndim != 1 or not numpy.issubdtype(ids.dtype, numpy.integer):
            raise ValueError(
                f"token ids must be a 1-D integer array, got shape {ids.shape} of {ids.dtype}"
            )
        if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= _U32_LIMIT):
            raise _bad_tokens_error(ids.tolist())
        return ids.astype("<u4", copy=False).tobytes()
    try:
        packed = array("I", tokens)
    except (OverflowError, TypeError):
        raise _bad_tokens_error(tokens) from None
    if sys.byteorder == "big":  # pragma: no cover - kvledger runs on little-endian hosts
        packed.byteswap()
    return packed.tobytes()


def _tokens_of_bytes(data: bytes) -> list[int]:
    unpacked = array("I", data)
    if sys.byteorder == "big":  # pragma: no cover - kvledger runs on little-endian hosts
        unpacked.byteswap()
    return unpacked.tolist()


_block_slices: dict[int, tuple[slice, ...]] = {}


def _slices(n_blocks: int, step: int) -> tuple[slice, ...]:
    """The first ``n_blocks`` slices of ``step`` bytes, from a table grown once per block size."""
    table = _block_slices.get(step, ())
    if len(table) < n_blocks:
        size = max(n_blocks, 2 * len(table))
        table = tuple(slice(i * step, (i + 1) * step) for i in range(size))
        _block_slices[step] = table
    return table[:n_blocks]


def _local_hashes_of_bytes(data: bytes, block_size: int, seed: int) -> list[int]:
    """One xxh3 per full block. ``itemgetter`` cuts every block out in a single C call, which
    is what keeps this loop as fast as Dynamo's Rust for a whole prompt."""
    step = 4 * block_size
    n_blocks = len(data) // step
    if n_blocks < 2:
        return [xxh3_64_intdigest(data[:step], seed)] if n_blocks else []
    blocks = itemgetter(*_slices(n_blocks, step))(data)
    return list(map(xxh3_64_intdigest, blocks, repeat(seed, n_blocks)))


def local_hashes(tokens: Tokens, block_size: int, *, seed: int = BLOCK_HASH_SEED) -> list[int]:
    """Local hash of every full block of ``tokens``; a partial last block has none."""
    _check_block_size(block_size)
    return _local_hashes_of_bytes(token_bytes(tokens), block_size, seed)


def pair_hash(low: int, high: int, seed: int) -> int:
    """XXH3-64 of two u64s packed little-endian: how a sequence hash names a block after its
    parent, and how the simulator names a request's decode blocks."""
    if COMPILED_CHAIN:
        try:
            return _chain.pair(low, high, seed)
        except (OverflowError, TypeError):
            pass  # not u64s: struct and xxhash take or refuse them as they always did
    return xxh3_64_intdigest(_PACK_PAIR(low, high), seed)


def sequence_hash(parent: int, local_hash: int, *, seed: int = DEFAULT_CHAIN_SEED) -> int:
    """The sequence hash of a block whose prefix before it is named ``parent``."""
    return pair_hash(parent, local_hash, seed)


def chain_sequence_hashes(
    local_hashes: Sequence[int], *, parent: int | None = None, seed: int = DEFAULT_CHAIN_SEED
) -> list[int]:
    """Sequence hashes for consecutive blocks, continuing the prefix named ``parent``.

    With ``parent=None`` the first block starts a sequence and its sequence hash is its local
    hash.
    """
    if not local_hashes:
        return []
    if COMPILED_CHAIN:
        try:
            return _chain.chain(local_hashes, parent, seed)
        except (OverflowError, TypeError):
            pass  # a value that is not a u64: the loop below names it
    try:
        if parent is None:
            prev = local_hashes[0]
        else:
            prev = xxh3_64_intdigest(_PACK_PAIR(parent, local_hashes[0]), seed)
        out = [prev]
        append = out.append
        for local in local_hashes[1:]:
            prev = xxh3_64_intdigest(_PACK_PAIR(prev, local), seed)
            append(prev)
    except struct.error:
        raise _bad_chain_error(local_hashes, parent) from None
    return out


def _bad_chain_error(local_hashes: Sequence[int], parent: int | None) -> ValueError:
    for i, value in enumerate(local_hashes):
        if not isinstance(value, int) or not 0 <= value <= _U64_MASK:
            return ValueError(f"hashes must be integers in [0, 2**64); local hash {i} is {value!r}")
    return ValueError(f"hashes must be integers in [0, 2**64); parent is {parent!r}")


class TokenBlockSequence:
    """A request's tokens cut into hashed full blocks plus an unhashed partial tail.

    Built once from the prompt, then grown token by token (or chunk by chunk) during decode
    with :meth:`extend`, which hashes only the blocks that become full.
    """

    __slots__ = (
        "_chain_seed",
        "_full",
        "_local",
        "_seed",
        "_seq",
        "_tail",
        "block_size",
        "lora_name",
        "salt",
    )

    def __init__(
        self,
        tokens: Tokens = (),
        block_size: int = 16,
        *,
        lora_name: str | None = None,
        salt: str | None = None,
        chain_seed: int = DEFAULT_CHAIN_SEED,
    ) -> None:
        _check_block_size(block_size)
        self.block_size = block_size
        self._seed = block_seed(lora_name=lora_name, salt=salt)
        #: what seeded the hashes besides the tokens; registered blocks carry it to routers
        self.lora_name = lora_name or None
        self.salt = salt or None
        self._chain_seed = chain_seed
        self._full = bytearray()  # the full blocks' tokens, as little-endian u32 bytes
        self._local: list[int] = []
        self._seq: list[int] = []
        self._tail = b""  # the partial block's tokens, already as little-endian u32 bytes
        self._add(tokens)

    def _add(self, tokens: Tokens) -> int:
        """Hash the blocks ``tokens`` completes; return how many there were."""
        data = self._tail + token_bytes(tokens)  # validates before anything changes
        n_full = len(data) // (4 * self.block_size)
        if n_full:
            new_local = _local_hashes_of_bytes(data, self.block_size, self._seed)
            parent = self._seq[-1] if self._seq else None
            self._seq += chain_sequence_hashes(new_local, parent=parent, seed=self._chain_seed)
            self._local += new_local
            self._full += data[: 4 * n_full * self.block_size]
        self._tail = data[4 * n_full * self.block_size :]
        return n_full

    def extend(self, tokens: Tokens) -> list[TokenBlock]:
        """Append ``tokens``; return the blocks this completed (often none during decode)."""
        n_new = self._add(tokens)
        return self._blocks_from(len(self._seq) - n_new) if n_new else []

    def _blocks_from(self, first: int) -> list[TokenBlock]:
        return list(
            map(TokenBlock, self._local[first:], self._seq[first:], range(first, len(self._seq)))
        )

    def append(self, token: int) -> TokenBlock | None:
        """Append one decoded token; return the block it completed, if any."""
        completed = self.extend((token,))
        return completed[0] if completed else None

    @property
    def blocks(self) -> list[TokenBlock]:
        """The full blocks, in order (built on request: hashing a prompt needs only the lists)."""
        return self._blocks_from(0)

    @property
    def sequence_hashes(self) -> list[int]:
        return list(self._seq)

    @property
    def local_hashes(self) -> list[int]:
        return list(self._local)

    def block_tokens(self, start: int = 0, end: int | None = None) -> list[bytes]:
        """Token ids of full blocks ``start..end`` as little-endian u32 bytes, one per block
        (what a pool keeps with a registered block)."""
        step = 4 * self.block_size
        stop = len(self._seq) if end is None else min(end, len(self._seq))
        full = self._full
        return [bytes(full[i * step : (i + 1) * step]) for i in range(start, stop)]

    @property
    def hash_key(self) -> tuple[str | None, str | None] | None:
        """``(lora_name, salt)`` when either moved the seed, else None."""
        if self.lora_name is None and self.salt is None:
            return None
        return (self.lora_name, self.salt)

    @property
    def tail(self) -> list[int]:
        """Tokens of the partial last block (fewer than ``block_size``; may be empty)."""
        return _tokens_of_bytes(self._tail)

    @property
    def seed(self) -> int:
        """The local-hash seed this sequence's LoRA name / salt selected."""
        return self._seed

    @property
    def chain_seed(self) -> int:
        return self._chain_seed

    @property
    def num_tokens(self) -> int:
        return len(self._seq) * self.block_size + len(self._tail) // 4

    def __len__(self) -> int:
        """Number of full blocks."""
        return len(self._seq)

    def __repr__(self) -> str:
        return (
            f"TokenBlockSequence(blocks={len(self._seq)}, tail={len(self._tail) // 4}, "
            f"block_size={self.block_size})"
        )
