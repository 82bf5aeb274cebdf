"""kvledger as vLLM's offload store, end to end through vLLM 0.33's real Scheduler and
OffloadingConnector, on CPU tensors (runs in the vLLM test venv, from vLLM's test tree).

A stand-in "model" writes each computed KV block as bytes derived from its tokens. Prompt A
runs and is offloaded to kvledger's G2; prompt B fills G1 and evicts A there; A runs again:
its prefix must come back from G2 (a connector load, not recomputed) byte-identical, and the
event log of the run must replay to the manager's live state.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch
from tests.v1.kv_connector.unit.utils import (
    EOS_TOKEN_ID,
    create_model_runner_output,
    create_vllm_config,
)
from vllm import SamplingParams
from vllm.config import KVEventsConfig, KVTransferConfig, set_current_vllm_config
from vllm.distributed.kv_events import BlockRemoved, BlockStored
from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
    OffloadingWorkerMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (
    OffloadingConnector,
)
from vllm.forward_context import ForwardContext
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import (
    get_request_block_hasher,
    init_none_hash,
    resolve_kv_cache_block_sizes,
)
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
)
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

from kvledger import replay
from kvledger.integrations.vllm.manager import KvledgerOffloadingManager
from kvledger.integrations.vllm.worker import KvledgerOffloadingWorker

BLOCK = 16
GPU_BLOCKS = 9  # block 0 is vLLM's null block: 8 usable
HEADS, HEAD = 2, 8
PAGE = 2 * BLOCK * HEADS * HEAD * 4  # one block's K and V, float32


class Engine:
    """vLLM's scheduler and a worker-side connector in one process, stepped by hand."""

    def __init__(self, log_url: str, **extra: Any) -> None:
        config = create_vllm_config(
            block_size=BLOCK, max_num_batched_tokens=1000, disable_hybrid_kv_cache_manager=False
        )
        config.scheduler_config.async_scheduling = False
        config.kv_transfer_config = KVTransferConfig(
            kv_connector="OffloadingConnector",
            kv_role="kv_both",
            kv_connector_extra_config={
                "spec_name": "KvledgerOffloadingSpec",
                "spec_module_path": "kvledger.integrations.vllm.spec",
                "cpu_bytes_to_use": 64 * PAGE,
                "log_url": log_url,
                **extra,
            },
        )
        config.kv_events_config = KVEventsConfig(enable_kv_cache_events=True, publisher="null")
        spec = FullAttentionSpec(
            block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD, dtype=torch.float32
        )
        group = KVCacheGroupSpec(["layer"], spec)
        kv_cache_config = KVCacheConfig(
            num_blocks=GPU_BLOCKS,
            kv_cache_tensors=[
                KVCacheTensor(
                    size=spec.page_size_bytes * GPU_BLOCKS,
                    layers=["layer"],
                    layer_stride=spec.page_size_bytes * GPU_BLOCKS,
                    block_stride=spec.page_size_bytes,
                )
            ],
            kv_cache_groups=[group],
        )
        config.cache_config.num_gpu_blocks = GPU_BLOCKS
        sched_block, hash_block = resolve_kv_cache_block_sizes(kv_cache_config, config)
        self.scheduler = Scheduler(
            vllm_config=config,
            kv_cache_config=kv_cache_config,
            log_stats=True,
            structured_output_manager=StructuredOutputManager(config),
            block_size=sched_block,
            hash_block_size=hash_block,
        )
        self.kv = torch.zeros(GPU_BLOCKS, 2, BLOCK, HEADS, HEAD, dtype=torch.float32)
        self.worker = OffloadingConnector(config, KVConnectorRole.WORKER, kv_cache_config)
        with set_current_vllm_config(config):
            self.worker.register_kv_caches({"layer": self.kv})
        connector = self.scheduler.connector
        assert isinstance(connector, OffloadingConnector)
        assert connector.connector_scheduler is not None
        manager = connector.connector_scheduler.manager
        assert isinstance(manager, KvledgerOffloadingManager)
        self.manager = manager
        assert self.worker.connector_worker is not None
        offloading_worker = self.worker.connector_worker.worker
        assert isinstance(offloading_worker, KvledgerOffloadingWorker)
        self.kvledger_worker = offloading_worker
        init_none_hash(sha256)
        self.hasher = get_request_block_hasher(BLOCK, sha256)
        self.ctx = ForwardContext(no_compile_layers={}, attn_metadata={}, slot_mapping={})
        self.write_kv = True
        self.block_ids: dict[str, list[int]] = {}
        # what vLLM's own KV-event stream publishes (to routers), caught at its publisher
        self.published: list[BlockStored | BlockRemoved] = []
        publisher = self.scheduler.kv_event_publisher
        publisher.publish = lambda batch: self.published.extend(batch.events)  # type: ignore[method-assign]

    def add(self, req_id: str, tokens: list[int]) -> None:
        params = SamplingParams(max_tokens=2)
        params.update_from_generation_config({}, EOS_TOKEN_ID)
        self.scheduler.add_request(
            Request(
                request_id=req_id,
                prompt_token_ids=tokens,
                sampling_params=params,
                pooling_params=None,
                block_hasher=self.hasher,
            )
        )

    def _compute(self, out: SchedulerOutput) -> None:
        """The model: write every block this step computes as bytes of its tokens."""
        for req in self.scheduler.running:
            # schedule() already counted this step's tokens as computed
            end = req.num_computed_tokens
            start = end - out.num_scheduled_tokens.get(req.request_id, 0)
            (block_ids,) = self.scheduler.kv_cache_manager.get_block_ids(req.request_id)
            self.block_ids[req.request_id] = list(block_ids)
            if not self.write_kv:
                continue
            tokens = req.all_token_ids
            for index in range(start // BLOCK, min(end, len(tokens)) // BLOCK):
                self.kv[block_ids[index]] = block_bytes(tokens[index * BLOCK : (index + 1) * BLOCK])

    def run(self) -> None:
        """Step until every request finished and every store reached kvledger."""
        for _ in range(200):
            if not self.scheduler.has_requests() and not self.manager.stores_in_flight:
                return
            out = self.scheduler.schedule()
            meta = out.kv_connector_metadata
            self.worker.handle_preemptions(meta)
            self.worker.bind_connector_metadata(meta)
            self.worker.start_load_kv(self.ctx)
            self._compute(out)  # the forward pass, between the loads and the saves
            self.worker.wait_for_save()
            time.sleep(0.01)  # let the copier's thread finish the copies
            sending, receiving = self.worker.get_finished(out.finished_req_ids)
            worker_meta = self.worker.build_connector_worker_meta() or OffloadingWorkerMetadata()
            self.worker.clear_connector_metadata()
            output = create_model_runner_output(
                reqs=self.scheduler.running,
                finished_sending=sending,
                finished_recving=receiving,
                token_id=EOS_TOKEN_ID,
                kv_connector_worker_meta=worker_meta,
            )
            self.scheduler.update_from_output(out, output)
        raise AssertionError("the engine did not settle in 200 steps")


def block_bytes(tokens: list[int]) -> torch.Tensor:
    """One block's KV as the stand-in model writes it: a function of its tokens only."""
    gen = torch.Generator().manual_seed(hash(tuple(tokens)) & 0x7FFFFFFF)
    return torch.randn(2, BLOCK, HEADS, HEAD, generator=gen)


def test_prompt_offloaded_evicted_from_g1_loaded_back_byte_identical(tmp_path: Path) -> None:
    log_url = f"sqlite:///{tmp_path / 'vllm-run.db'}"
    engine = Engine(log_url)
    prompt_a = list(range(1000, 1000 + 3 * BLOCK + 5))  # 3 full blocks
    prompt_b = list(range(5000, 5000 + 7 * BLOCK + 3))  # fills G1: A's blocks are evicted

    engine.add("a1", prompt_a)
    engine.run()
    assert engine.manager.pool.num_registered == 3, "A's 3 full blocks are in kvledger's G2"
    # logged as a chain: the first block starts the sequence, each later one names the last
    parents = {seq: parent for seq, (_, parent) in engine.manager.pool.resident_blocks().items()}
    (first,) = [seq for seq, parent in parents.items() if parent is None]
    (second,) = [seq for seq, parent in parents.items() if parent == first]
    assert [seq for seq, parent in parents.items() if parent == second] != []

    engine.add("b", prompt_b)
    engine.run()

    # From here the model writes nothing and G1 is wiped: only a load from kvledger can put
    # A's bytes back where vLLM expects them.
    engine.write_kv = False
    engine.kv.zero_()
    engine.add("a2", prompt_a)
    engine.run()
    block_ids = engine.block_ids["a2"]
    for index in range(3):
        expected = block_bytes(prompt_a[index * BLOCK : (index + 1) * BLOCK])
        assert torch.equal(engine.kv[block_ids[index]], expected), f"block {index} of A"

    engine.manager.flush_log()
    assert replay(log_url) == engine.manager.state()
    engine.manager.shutdown()


def test_the_retired_g3_setting_is_refused_naming_where_g3_went(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"g3_blocks.*TieringOffloadingSpec.*KvledgerDiskTier"):
        Engine(f"sqlite:///{tmp_path / 'bad.db'}", g3_blocks=16)
