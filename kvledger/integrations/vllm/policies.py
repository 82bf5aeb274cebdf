"""kvledger's eviction policies as vLLM ``CachePolicy``s, for vLLM's own CPU offloading tier.

vLLM 0.33 loads an out-of-tree policy by class name and module path::

    "kv_connector_extra_config": {"spec_name": "TieringOffloadingSpec",
        "cpu_bytes_to_use": 8000000000,
        "eviction_policy": "LineageCachePolicy",
        "cache_policy_module_path": "kvledger.integrations.vllm.policies", ...}

(``CPUOffloadingSpec`` reads the same two keys.) Each class here drives one policy of
``kvledger.registry.policies`` -- the same object ``BlockManager``'s pools and kvledger's own
vLLM manager use -- over vLLM's chunk slots: ``LruCachePolicy``, ``ArcCachePolicy``,
``LineageCachePolicy`` and ``MultiLruCachePolicy`` (TinyLFU-gated LRU levels).

What vLLM tells a policy, and what kvledger's policy hears:

- a chunk inserted (a store begins): ``registered``, with its parent (the chunk one position
  before it in the same request and group, ``keys.RequestChunks``); ``released`` once nobody
  reads or writes it (vLLM's ``mark_evictable``), ``activated`` when a transfer pins it again;
- a use (``touch``, or a request finishing, tail first): the chunk becomes the most recently
  released of its kind; a reuse (a chunk the request read, not one it stored) is also an
  access, which ARC and the frequency sketch count;
- a store of chunks that were not there (``on_store_miss``), and a touch of an absent one:
  ``missed``, from which ARC adapts;
- ``evict(n, protected)``: the protected chunks are held aside while the policy picks ``n``
  victims, and come back as the most recently used (vLLM protects the chunks the same store
  offers, which that request is about to use). It returns None, changing nothing the engine
  can see, when ``n`` cannot be had (lineage keeps a parent while a child is in use: such a
  shortfall puts the picked chunks back, as the most recently used).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import ClassVar

from vllm.v1.kv_offload.base import OffloadKey, ReqContext
from vllm.v1.kv_offload.cpu.policies.base import CachePolicy, ChunkStatus, order_request_keys

from kvledger.integrations.vllm.keys import RequestChunks, key_hash
from kvledger.registry.policies import EvictionPolicy, make_policy

__all__ = [
    "ArcCachePolicy",
    "KvledgerCachePolicy",
    "LineageCachePolicy",
    "LruCachePolicy",
    "MultiLruCachePolicy",
]


class KvledgerCachePolicy(CachePolicy):  # type: ignore[misc]  # vLLM is untyped here
    """vLLM's ``CachePolicy`` over the kvledger policy named ``policy_name``; a chunk's slot
    is its ``chunk_id``."""

    policy_name: ClassVar[str] = "lru"

    def __init__(self, cache_capacity: int) -> None:
        super().__init__(cache_capacity)
        self.policy: EvictionPolicy = make_policy(self.policy_name)
        self.policy.bind(max(cache_capacity, 1))
        self.chunks: dict[OffloadKey, ChunkStatus] = {}
        self._key_at: dict[int, OffloadKey] = {}  # slot -> key
        self._named: dict[int, tuple[int, int | None]] = {}  # slot -> (hash, parent hash)
        self._evictable: set[OffloadKey] = set()

    # -- what vLLM's manager tells a policy ------------------------------------------------

    def get(self, key: OffloadKey) -> ChunkStatus | None:
        return self.chunks.get(key)

    def insert(self, key: OffloadKey, chunk: ChunkStatus, req_context: ReqContext) -> None:
        chunks = RequestChunks.of(self, req_context)
        position = chunks.note(key, req_context)
        h, parent = key_hash(key), chunks.parent(key, position)
        slot = chunk.chunk_id
        self.chunks[key] = chunk
        self._key_at[slot] = key
        self._named[slot] = (h, parent)
        self.policy.registered([slot], [h], [parent])
        if chunk.ref_cnt == 0:
            self.mark_evictable(key)

    def remove(self, key: OffloadKey) -> None:
        chunk = self.chunks.pop(key)
        slot = chunk.chunk_id
        self._evictable.discard(key)
        del self._key_at[slot], self._named[slot]
        self.policy.forget([slot])

    def mark_evictable(self, key: OffloadKey) -> None:
        self._evictable.add(key)
        self.policy.released([self.chunks[key].chunk_id])

    def mark_non_evictable(self, key: OffloadKey) -> None:
        self._evictable.discard(key)
        self.policy.activated([self.chunks[key].chunk_id])

    def touch(self, keys: Iterable[OffloadKey], req_context: ReqContext) -> None:
        keys = list(keys)
        self._use(reversed(keys), set(keys), report_absent=True)

    def on_store_miss(self, keys: Iterable[OffloadKey], req_context: ReqContext) -> None:
        self.policy.missed([key_hash(key) for key in keys])

    def on_request_access(self, keys: Iterable[OffloadKey], req_context: ReqContext) -> None:
        chunks = RequestChunks.of(self, req_context)
        for key in keys:
            chunks.note(key, req_context)

    def on_request_finished(
        self,
        key_groups: Sequence[Sequence[OffloadKey]],
        insertion_only_keys: set[OffloadKey],
        reused_keys: set[OffloadKey],
        req_context: ReqContext,
    ) -> None:
        order = order_request_keys(key_groups, req_context)
        self._use(reversed(order), reused_keys, report_absent=False)

    def _use(
        self, keys: Iterable[OffloadKey], accessed: set[OffloadKey], *, report_absent: bool
    ) -> None:
        """Each present, ready chunk of ``keys`` becomes the most recently used (the last one
        most of all); those in ``accessed`` count as an access too."""
        policy, chunks, evictable = self.policy, self.chunks, self._evictable
        absent: list[int] = []
        for key in keys:
            chunk = chunks.get(key)
            if chunk is None:
                absent.append(key_hash(key))
                continue
            if not chunk.is_ready:  # a store in flight is not a use
                continue
            slot = [chunk.chunk_id]
            idle = key in evictable
            if idle:
                policy.activated(slot)
            if key in accessed and policy.tracks_access:
                policy.accessed(slot)
            if idle:
                policy.released(slot)
        if absent and report_absent:
            policy.missed(absent)

    def evict(
        self, n: int, protected: set[OffloadKey]
    ) -> list[tuple[OffloadKey, ChunkStatus]] | None:
        if n == 0:
            return []
        evictable = self._evictable
        held = [self.chunks[key].chunk_id for key in protected if key in evictable]
        if len(evictable) - len(held) < n:
            return None
        policy = self.policy
        policy.activated(held)
        victims = policy.pick_victims(n)
        policy.released(held)
        if len(victims) < n:  # lineage: parents of chunks in use stay; put the picked back
            named = [self._named[slot] for slot in victims]
            policy.registered(victims, [h for h, _ in named], [p for _, p in named])
            policy.released(victims)
            return None
        out: list[tuple[OffloadKey, ChunkStatus]] = []
        for slot in victims:
            key = self._key_at.pop(slot)
            del self._named[slot]
            evictable.discard(key)
            out.append((key, self.chunks.pop(key)))
        return out

    def clear(self) -> None:
        self.policy.clear()
        self.policy.bind(max(self.cache_capacity, 1))
        self.chunks.clear()
        self._key_at.clear()
        self._named.clear()
        self._evictable.clear()


class LruCachePolicy(KvledgerCachePolicy):
    """kvledger's LRU: the least recently used chunk goes first."""

    policy_name = "lru"


class ArcCachePolicy(KvledgerCachePolicy):
    """kvledger's ARC (``registry.policies.ArcPolicy``): recency and frequency lists with an
    adaptive split learnt from recently evicted chunks."""

    policy_name = "arc"


class LineageCachePolicy(KvledgerCachePolicy):
    """kvledger's lineage policy: leaves first, so a prefix outlives its suffixes."""

    policy_name = "lineage"


class MultiLruCachePolicy(KvledgerCachePolicy):
    """kvledger's frequency-aware policy: a TinyLFU sketch places chunks in LRU levels."""

    policy_name = "multi_lru"
