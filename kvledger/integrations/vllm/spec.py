"""``KvledgerOffloadingSpec``: what vLLM's OffloadingSpecFactory loads for
``{"spec_name": "KvledgerOffloadingSpec", "spec_module_path": "kvledger.integrations.vllm.spec"}``.

Settings, in ``kv_connector_extra_config``:

- ``cpu_bytes_to_use`` (required): G2 size in bytes, as for vLLM's CPU offloading;
- ``log_url``: the durable event log (e.g. ``sqlite:///kvledger-vllm.db``); every G2
  transition of the run goes there, so ``kvledger replay`` rebuilds the state;
- ``store_threshold`` / ``max_tracker_size``: vLLM's store filter (store a block in G2 only
  once it was offered that many times);
- ``worker_id``: kvledger's worker id in the log (default: vLLM's rank);
- ``eviction_policy``: G2's eviction policy, one of kvledger's: ``lru`` (the default, ranked
  per request as vLLM's LRU is), ``arc``, ``lineage``, ``multi_lru`` (TinyLFU-gated).

kvledger's G3 and G4 for vLLM are secondary tiers of vLLM's ``TieringOffloadingSpec``
(``disk_tier``, ``peer_tier``); the ``g3_blocks`` this spec once took is refused with where
to go (docs/vllm.md says why it was retired).

Every key is checked by ``kvledger.integrations.extra_config.VllmExtraConfig``: a bad value or a
key kvledger does not read (a misspelling, a retired G3 key) stops start-up with a message
naming it.
"""

from __future__ import annotations

from vllm.v1.kv_offload.base import (
    CanonicalKVCaches,
    OffloadingManager,
    OffloadingSpec,
    OffloadingWorker,
)
from vllm.v1.kv_offload.config import OffloadingConfig

from kvledger.integrations.extra_config import RETIRED_SETTINGS, VllmExtraConfig
from kvledger.integrations.vllm.manager import KvledgerOffloadingManager
from kvledger.integrations.vllm.worker import KvledgerOffloadingWorker

__all__ = ["RETIRED_SETTINGS", "KvledgerOffloadingSpec"]


class KvledgerOffloadingSpec(OffloadingSpec):  # type: ignore[misc]  # vLLM is untyped here
    def __init__(self, config: OffloadingConfig) -> None:
        super().__init__(config)
        # every key checked, by name, before anything is built (kvledger.integrations
        # .extra_config: a bad value, an unknown key or a retired G3 key is refused, never
        # coerced or ignored)
        self.settings = settings = VllmExtraConfig.load(self.extra_config)
        if self.blocks_per_chunk != 1:
            raise ValueError(
                "KvledgerOffloadingSpec offloads one vLLM block per chunk; leave"
                f" kv_connector_extra_config block_size unset (got {self.blocks_per_chunk}"
                " blocks per chunk)"
            )
        world = max(config.parallel.world_size, 1)
        bytes_per_chunk = config.worker_kv_bytes_per_block * world * self.blocks_per_chunk
        self.num_chunks = settings.chunks(bytes_per_chunk)
        self.log_url: str | None = settings.log_url
        rank = config.parallel.rank
        self.worker_id = settings.worker_id if settings.worker_id is not None else rank
        self.eviction_policy: str = settings.eviction_policy
        self._manager: KvledgerOffloadingManager | None = None
        self._worker: OffloadingWorker | None = None

    def get_manager(self) -> OffloadingManager:
        if self._manager is None:
            self._manager = KvledgerOffloadingManager(
                num_chunks=self.num_chunks,
                cache_policy=self.eviction_policy,
                enable_events=self.kv_events_config.enable_kv_cache_events,
                store_threshold=self.settings.store_threshold,
                max_tracker_size=self.settings.max_tracker_size,
                log_url=self.log_url,
                worker_id=self.worker_id,
                redis_url=self.settings.redis_url,
                redis_namespace=self.settings.redis_namespace,
                tokens_per_chunk={
                    group.group_id: group.tokens_per_block * self.blocks_per_chunk
                    for group in self.config.groups
                },
            )
        return self._manager

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if self._worker is None:
            self._worker = KvledgerOffloadingWorker(kv_caches, self.num_chunks)
        return self._worker
