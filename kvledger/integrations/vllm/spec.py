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
- ``worker_id``: kvledger's worker id in the log (default: vLLM's rank).

Every key is checked by ``kvledger.integrations.extra_config.VllmExtraConfig``: a bad value or a
key kvledger does not read (``eviction_policy`` other than ``lru``, ``offload_filter`` without
``g3_blocks``, a misspelling) stops start-up with a message naming it.
"""

from __future__ import annotations

import os
from pathlib import Path

from vllm.v1.kv_offload.base import (
    CanonicalKVCaches,
    OffloadingManager,
    OffloadingSpec,
    OffloadingWorker,
)
from vllm.v1.kv_offload.config import OffloadingConfig

from kvledger.integrations.extra_config import VllmExtraConfig
from kvledger.integrations.vllm.manager import KvledgerOffloadingManager

__all__ = ["KvledgerOffloadingSpec"]


class KvledgerOffloadingSpec(OffloadingSpec):  # type: ignore[misc]  # vLLM is untyped here
    def __init__(self, config: OffloadingConfig) -> None:
        super().__init__(config)
        # every key checked, by name, before anything is built (kvledger.integrations
        # .extra_config: a bad value or an unknown key is refused, never coerced or ignored)
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
        self.g3_blocks = settings.g3_blocks
        self.offload_filter: str = settings.offload_filter or "seen_twice"
        self.data_dir = Path(
            settings.data_dir or os.environ.get("KVLEDGER_DATA_DIR") or "kvledger-data"
        )
        self._manager: KvledgerOffloadingManager | None = None
        self._worker: OffloadingWorker | None = None

    def get_manager(self) -> OffloadingManager:
        if self._manager is None:
            self._manager = KvledgerOffloadingManager(
                num_chunks=self.num_chunks,
                enable_events=self.kv_events_config.enable_kv_cache_events,
                store_threshold=self.settings.store_threshold,
                max_tracker_size=self.settings.max_tracker_size,
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
