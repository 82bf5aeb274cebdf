"""``KvledgerOffloadingSpec``: what vLLM's OffloadingSpecFactory loads for
``{"spec_name": "KvledgerOffloadingSpec", "spec_module_path": "kvledger.integrations.vllm.spec"}``.

Settings, in ``kv_connector_extra_config``:

- ``cpu_bytes_to_use`` (required): G2 size in bytes, as for vLLM's CPU offloading;
- ``log_url``: the durable event log (e.g. ``sqlite:///kvledger-vllm.db``); every G2
  transition of the run goes there, so ``kvledger replay`` rebuilds the state;
- ``store_threshold`` / ``max_tracker_size``: the offload filter (store a block only once it
  was offered that many times).
"""

from __future__ import annotations

from vllm.v1.kv_offload.base import (
    CanonicalKVCaches,
    OffloadingManager,
    OffloadingSpec,
    OffloadingWorker,
)
from vllm.v1.kv_offload.config import OffloadingConfig

from kvledger.integrations.vllm.manager import KvledgerOffloadingManager

__all__ = ["KvledgerOffloadingSpec"]


class KvledgerOffloadingSpec(OffloadingSpec):  # type: ignore[misc]  # vLLM is untyped here
    def __init__(self, config: OffloadingConfig) -> None:
        super().__init__(config)
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
        self._manager: KvledgerOffloadingManager | None = None
        self._worker: OffloadingWorker | None = None

    def get_manager(self) -> OffloadingManager:
        if self._manager is None:
            self._manager = KvledgerOffloadingManager(
                num_chunks=self.num_chunks,
                enable_events=self.kv_events_config.enable_kv_cache_events,
                store_threshold=int(self.extra_config.get("store_threshold", 0)),
                max_tracker_size=int(self.extra_config.get("max_tracker_size", 64_000)),
                log_url=self.log_url,
                worker_id=int(self.config.parallel.rank),
            )
        return self._manager

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if self._worker is None:
            from kvledger.integrations.vllm.worker import KvledgerOffloadingWorker

            self._worker = KvledgerOffloadingWorker(kv_caches, self.num_chunks)
        return self._worker
