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
"""

from __future__ import annotations

from typing import Any

from vllm.v1.kv_offload.base import (
    CanonicalKVCaches,
    OffloadingManager,
    OffloadingSpec,
    OffloadingWorker,
)
from vllm.v1.kv_offload.config import OffloadingConfig

from kvledger.integrations.vllm.manager import KvledgerOffloadingManager
from kvledger.integrations.vllm.worker import KvledgerOffloadingWorker

__all__ = ["RETIRED_SETTINGS", "KvledgerOffloadingSpec"]

RETIRED_SETTINGS = ("g3_blocks", "offload_filter", "data_dir")
"""Settings of the G3 this spec once kept below G2; kvledger's G3 for vLLM is now a
secondary tier of vLLM's tiering layer."""


class KvledgerOffloadingSpec(OffloadingSpec):  # type: ignore[misc]  # vLLM is untyped here
    def __init__(self, config: OffloadingConfig) -> None:
        super().__init__(config)
        retired = [name for name in RETIRED_SETTINGS if name in self.extra_config]
        if retired:
            raise ValueError(
                f"KvledgerOffloadingSpec no longer keeps a G3 ({', '.join(retired)} in"
                " kv_connector_extra_config): use vLLM's TieringOffloadingSpec with"
                ' {"type": "KvledgerDiskTier", "module_path":'
                ' "kvledger.integrations.vllm.disk_tier", "num_blocks": N, "data_dir": ...}'
                " in secondary_tiers (docs/vllm.md)"
            )
        cpu_bytes = self.extra_config.get("cpu_bytes_to_use")
        if not cpu_bytes or int(cpu_bytes) <= 0:
            raise ValueError(
                "KvledgerOffloadingSpec needs a positive cpu_bytes_to_use in"
                f" kv_connector_extra_config, got {cpu_bytes!r}"
            )
        if self.blocks_per_chunk != 1:
            raise ValueError(
                "KvledgerOffloadingSpec offloads one vLLM block per chunk; leave"
                f" kv_connector_extra_config block_size unset (got {self.blocks_per_chunk}"
                " blocks per chunk)"
            )
        world = max(config.parallel.world_size, 1)
        bytes_per_chunk = config.worker_kv_bytes_per_block * world * self.blocks_per_chunk
        self.num_chunks = int(cpu_bytes) // bytes_per_chunk if bytes_per_chunk > 0 else 0
        self.log_url: str | None = self.extra_config.get("log_url")
        self.worker_id = _non_negative(
            "worker_id", self.extra_config.get("worker_id", config.parallel.rank)
        )
        self.eviction_policy = str(self.extra_config.get("eviction_policy", "lru"))
        self.cache_policy_module_path: str | None = self.extra_config.get(
            "cache_policy_module_path"
        )
        self._manager: KvledgerOffloadingManager | None = None
        self._worker: OffloadingWorker | None = None

    def get_manager(self) -> OffloadingManager:
        if self._manager is None:
            self._manager = KvledgerOffloadingManager(
                num_chunks=self.num_chunks,
                cache_policy=self.eviction_policy,
                cache_policy_module_path=self.cache_policy_module_path,
                enable_events=self.kv_events_config.enable_kv_cache_events,
                store_threshold=int(self.extra_config.get("store_threshold", 0)),
                max_tracker_size=int(self.extra_config.get("max_tracker_size", 64_000)),
                log_url=self.log_url,
                worker_id=self.worker_id,
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


def _non_negative(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(
            f"KvledgerOffloadingSpec: {name} in kv_connector_extra_config must be a non-negative"
            f" integer, got {value!r}"
        )
    return value
