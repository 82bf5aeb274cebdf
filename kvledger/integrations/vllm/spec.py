"""``KvledgerOffloadingSpec``: what vLLM's OffloadingSpecFactory loads for
``{"spec_name": "KvledgerOffloadingSpec", "spec_module_path": "kvledger.integrations.vllm.spec"}``.

Settings, in ``kv_connector_extra_config``:

- ``cpu_bytes_to_use`` (required): G2 size in bytes, as for vLLM's CPU offloading;
- ``log_url``: the durable event log (e.g. ``sqlite:///kvledger-vllm.db``); every G2
  transition of the run goes there, so ``kvledger replay`` rebuilds the state;
- ``store_threshold`` / ``max_tracker_size``: vLLM's store filter (store a block in G2 only
  once it was offered that many times);
- ``g3_blocks``: G3 slots below G2 (default 0: no G3). G2 blocks that evictions push out go
  down to G3 when ``offload_filter`` lets them (``always``, ``seen_twice`` -- the default, as
  in kvledger's settings: asked for by two requests or more -- or ``never``);
- ``data_dir``: where each worker keeps its G3 file, ``vllm-g3-w<worker_id>.bin`` (with
  ``-r<rank>`` when there are several ranks, each holding its share of every block; default
  ``$KVLEDGER_DATA_DIR`` or ``kvledger-data``);
- ``worker_id``: kvledger's worker id in the log (default: vLLM's rank);
- ``eviction_policy``: G2's eviction policy, one of kvledger's: ``lru`` (the default, ranked
  per request as vLLM's LRU is), ``arc``, ``lineage``, ``multi_lru`` (TinyLFU-gated).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from vllm.v1.kv_offload.base import (
    CanonicalKVCaches,
    OffloadingManager,
    OffloadingSpec,
    OffloadingWorker,
)
from vllm.v1.kv_offload.config import OffloadingConfig

from kvledger.integrations.vllm.manager import OFFLOAD_FILTERS, KvledgerOffloadingManager

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
        self.worker_id = _non_negative(
            "worker_id", self.extra_config.get("worker_id", config.parallel.rank)
        )
        self.g3_blocks = _non_negative("g3_blocks", self.extra_config.get("g3_blocks", 0))
        self.offload_filter = str(self.extra_config.get("offload_filter", "seen_twice"))
        if self.offload_filter not in OFFLOAD_FILTERS:
            raise ValueError(
                "KvledgerOffloadingSpec: offload_filter must be one of"
                f" {', '.join(OFFLOAD_FILTERS)}, got {self.offload_filter!r}"
            )
        self.eviction_policy = str(self.extra_config.get("eviction_policy", "lru"))
        self.cache_policy_module_path: str | None = self.extra_config.get(
            "cache_policy_module_path"
        )
        self.data_dir = Path(
            self.extra_config.get("data_dir")
            or os.environ.get("KVLEDGER_DATA_DIR")
            or "kvledger-data"
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
                g3_blocks=self.g3_blocks,
                offload_filter=self.offload_filter,
                tokens_per_chunk={
                    group.group_id: group.tokens_per_block * self.blocks_per_chunk
                    for group in self.config.groups
                },
            )
        return self._manager

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if self._worker is None:
            from kvledger.integrations.vllm.worker import KvledgerOffloadingWorker

            name = f"vllm-g3-w{self.worker_id}"
            if self.config.parallel.world_size > 1:  # each rank keeps its share of every block
                name += f"-r{self.config.parallel.rank}"
            g3_file = self.data_dir / f"{name}.bin" if self.g3_blocks else None
            self._worker = KvledgerOffloadingWorker(
                kv_caches, self.num_chunks, g3_blocks=self.g3_blocks, g3_file=g3_file
            )
        return self._worker


def _non_negative(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(
            f"KvledgerOffloadingSpec: {name} in kv_connector_extra_config must be a non-negative"
            f" integer, got {value!r}"
        )
    return value
