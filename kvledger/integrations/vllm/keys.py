"""How kvledger names vLLM's offloaded blocks, and their parents.

vLLM names an offloaded block by an ``OffloadKey`` (its block hash and the KV-cache group);
kvledger by a 64-bit sequence hash, the xxh3 of that key (the same in every process and run,
so two workers that computed the same prompt name its blocks alike, and a restarted worker
finds its own). vLLM never hands an offloading component token ids (docs/vllm.md), so these
names cannot be Dynamo's token hashes.

A block's parent is the block one chunk before it in the same request and KV-cache group: a
request's ``ReqContext`` carries each key's end-token position, and ``RequestChunks`` (kept
on the context) remembers which key it showed at each position.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import xxhash
from vllm.v1.kv_offload.base import OffloadKey, ReqContext, get_offload_group_idx

__all__ = ["RequestChunks", "key_hash"]


def key_hash(key: bytes) -> int:
    """kvledger's sequence hash for a vLLM ``OffloadKey``: stable across processes and runs."""
    return xxhash.xxh3_64_intdigest(key)


@dataclass(slots=True)
class RequestChunks:
    """The keys one request showed, by (KV-cache group, end-token position): each block's
    parent is the key shown one chunk earlier in its group. Kept on the request's
    ``ReqContext`` (one per ``owner``, so two kvledger components never share one)."""

    owner: object
    by_position: dict[tuple[int, int], int] = field(default_factory=dict)
    #: per group, the last key noted and its position; per key, the one noted before it in
    #: its group at a lower position (the parent when the chunk size is not known)
    last: dict[int, tuple[int, int]] = field(default_factory=dict)
    previous: dict[int, int] = field(default_factory=dict)

    @classmethod
    def of(cls, owner: object, req_context: ReqContext) -> RequestChunks:
        state: RequestChunks | None = req_context.get_state(RequestChunks)
        if state is None or state.owner is not owner:
            state = cls(owner)
            req_context.set_state(state)
        return state

    def note(self, key: OffloadKey, req_context: ReqContext) -> int | None:
        """Remember where ``key`` sits; returns its end-token position (None: unknown)."""
        position: int | None = req_context.get_offload_key_position(key)
        if position is not None:
            group, h = get_offload_group_idx(key), key_hash(key)
            self.by_position[(group, position)] = h
            before = self.last.get(group)
            if before is not None and before[0] < position:
                self.previous[h] = before[1]
            self.last[group] = (position, h)
        return position

    def parent(
        self, key: OffloadKey, position: int | None, chunk_tokens: int | None = None
    ) -> int | None:
        """The hash of the block before ``key`` in its request and group, when this request
        showed it; None at a sequence start or when unknown. Without ``chunk_tokens``, the key
        this request showed just before it at a lower position."""
        if position is None:
            return None
        if chunk_tokens is None:
            return self.previous.get(key_hash(key))
        if position <= chunk_tokens:
            return None
        return self.by_position.get((get_offload_group_idx(key), position - chunk_tokens))
