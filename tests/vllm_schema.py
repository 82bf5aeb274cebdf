"""vLLM's KV event classes for tests that decode our stream the way vLLM does (msgspec).

vllm is not a dependency of kvledger: when it imports (a .bench-venv, an engine's environment)
its own classes are used, otherwise these mirror vLLM 0.33's ``vllm/distributed/kv_events.py``
field for field.
"""

from __future__ import annotations

from typing import Any

import msgspec


# vLLM's documented schema (vLLM 0.33 ``vllm/distributed/kv_events.py``: field names, order and
# defaults), used when vllm itself does not import here.
class _KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(_KVCacheEvent):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[list[int]] | None = None


class BlockRemoved(_KVCacheEvent):
    block_hashes: list[bytes | int]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(_KVCacheEvent):
    pass


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


def vllm_classes() -> tuple[Any, Any, Any, Any]:
    """vLLM's own msgspec classes when vllm imports here, otherwise the schema above."""
    try:
        from vllm.distributed.kv_events import (
            AllBlocksCleared as VAllBlocksCleared,
        )
        from vllm.distributed.kv_events import BlockRemoved as VBlockRemoved
        from vllm.distributed.kv_events import BlockStored as VBlockStored
        from vllm.distributed.kv_events import KVEventBatch as VKVEventBatch
    except Exception:
        return KVEventBatch, BlockStored, BlockRemoved, AllBlocksCleared
    return VKVEventBatch, VBlockStored, VBlockRemoved, VAllBlocksCleared
