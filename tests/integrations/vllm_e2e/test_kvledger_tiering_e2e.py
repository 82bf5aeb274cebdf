"""kvledger's G3 and G4 under vLLM 0.33's tiering layer, end to end through vLLM's real Scheduler
and OffloadingConnector with vLLM's ``TieringOffloadingSpec`` (runs in the vLLM test venv).

vLLM's CPU tier is the primary (G2, with kvledger's eviction policy through
``cache_policy_module_path``); kvledger's ``KvledgerDiskTier`` is the secondary tier named in
``secondary_tiers``. Prompt A runs and its blocks go G1 -> CPU -> kvledger's G3 (the cascade);
prompt B pushes A out of G1 and of the CPU tier; with G1 wiped and the model writing nothing, A
runs again and its blocks come back G3 -> CPU -> G1 byte-identical. kvledger's log replays to
the tier's state, and a second engine on the same folder and log finds A on G3 at start (warm
restart) and serves it.

G4 the same way, in two processes: worker A (this file run as a script, an engine of its own)
runs a prompt, its blocks cascade into A's exported pool (kvledger's ``KvledgerPeerTier``, real
NIXL agent, real Redis); worker B's engine, G1 wiped and its model writing nothing, runs the same
prompt and loads A's blocks over NIXL byte-identical. A block A reuses between B's lookup and
B's read is a miss for that key: B's engine recomputes it and goes on.

vLLM's CPU tier worker (``CPUOffloadingWorker``) copies G1 <-> CPU with CUDA streams and
vLLM's kernels, which a CPU-only machine has not; ``CpuCopyWorker`` stands in for that one
copy, on the same shared region (vLLM's ``SharedOffloadRegion``, the bytes kvledger's tier
reads and writes), so everything else is vLLM's and kvledger's own code.
"""

from __future__ import annotations

import os
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from tests.kvledger.test_kvledger_peer_tier import Owner, serve
from tests.v1.kv_connector.unit.utils import (
    EOS_TOKEN_ID,
    create_model_runner_output,
    create_vllm_config,
)
from vllm import SamplingParams
from vllm.config import KVEventsConfig, KVTransferConfig, set_current_vllm_config
from vllm.distributed.kv_events import MEDIUM_STORAGE, BlockRemoved, BlockStored
from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
    OffloadingWorkerMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (
    OffloadingConnector,
)
from vllm.forward_context import ForwardContext
from vllm.platforms import current_platform
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
from vllm.v1.kv_offload.base import (
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingWorker,
    OffloadKey,
    TransferResult,
    make_offload_key,
)
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec
from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion
from vllm.v1.kv_offload.tiering.manager import TieringOffloadingManager
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

from kvledger import replay
from kvledger.events.log.database import open_database
from kvledger.events.log.reader import decode_rows, read_chunks, select_rows
from kvledger.events.types import Onboarded, Tier
from kvledger.integrations.vllm.disk_tier import KvledgerDiskTier
from kvledger.integrations.vllm.keys import key_hash
from kvledger.integrations.vllm.peer_tier import KvledgerPeerTier
from kvledger.tiers.remote import nixl_unavailable_reason

BLOCK = 16
GPU_BLOCKS = 9  # block 0 is vLLM's null block: 8 usable
HEADS, HEAD = 2, 8
PAGE = 2 * BLOCK * HEADS * HEAD * 4  # one block's K and V, float32
ROW = -(-PAGE // 4096) * 4096  # a CPU-tier chunk: vLLM's shared region aligns rows to pages


class CpuCopyWorker(OffloadingWorker):  # type: ignore[misc]
    """G1 rows <-> the CPU tier's rows in vLLM's shared region, copied with torch at submit."""

    def __init__(self, spec: TieringOffloadingSpec, kv_caches: CanonicalKVCaches) -> None:
        self.region = SharedOffloadRegion(
            engine_id=spec.config.engine_id,
            num_chunks=spec.num_chunks,
            rank=0,
            kv_bytes_per_chunk=spec.kv_bytes_per_chunk,
            cpu_page_size=spec.cpu_page_size_per_worker,
        )
        self.pairs = []
        for t in kv_caches.tensors:
            g1 = t.tensor.view(torch.int8).view(-1, t.page_size_bytes)
            self.pairs.append((g1, self.region.create_next_worker_view(t.page_size_bytes)))
        self.done: list[TransferResult] = []

    def _copy(self, job_id: int, g1_ids: list[int], cpu_ids: list[int], to_cpu: bool) -> bool:
        for g1, cpu in self.pairs:
            for g, c in zip(g1_ids, cpu_ids, strict=True):
                if to_cpu:
                    cpu[c].copy_(g1[g])
                else:
                    g1[g].copy_(cpu[c])
        self.done.append(TransferResult(job_id=job_id, success=True))
        return True

    def submit_store(
        self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec
    ) -> bool:
        assert isinstance(dst_spec, CPULoadStoreSpec)
        return self._copy(job_id, src_spec.block_ids.tolist(), dst_spec.chunk_ids.tolist(), True)

    def submit_load(
        self,
        job_id: int,
        src_spec: LoadStoreSpec,
        dst_spec: GPULoadStoreSpec,
        expedited: bool = False,
    ) -> bool:
        assert isinstance(src_spec, CPULoadStoreSpec)
        return self._copy(job_id, dst_spec.block_ids.tolist(), src_spec.chunk_ids.tolist(), False)

    def get_finished(self) -> list[TransferResult]:
        done, self.done = self.done, []
        return done

    def wait(self, job_ids: set[int]) -> None:
        pass

    def shutdown(self) -> None:
        self.region.cleanup()


@pytest.fixture(autouse=True)
def _cpu_copy_worker(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(
        TieringOffloadingSpec, "get_worker", lambda spec, kv_caches: CpuCopyWorker(spec, kv_caches)
    )


class Engine:
    """vLLM's scheduler and a worker-side connector in one process, stepped by hand."""

    def __init__(self, **extra: Any) -> None:
        config = create_vllm_config(
            block_size=BLOCK, max_num_batched_tokens=1000, disable_hybrid_kv_cache_manager=False
        )
        config.scheduler_config.async_scheduling = False
        config.kv_transfer_config = KVTransferConfig(
            kv_connector="OffloadingConnector",
            kv_role="kv_both",
            kv_connector_extra_config={
                "spec_name": "TieringOffloadingSpec",
                "cpu_bytes_to_use": 64 * PAGE,
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
        assert isinstance(manager, TieringOffloadingManager)
        self.manager = manager
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
            if not self.scheduler.has_requests() and not self.manager.has_pending_work():
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


def g3_tier(engine: Engine) -> KvledgerDiskTier:
    (tier,) = engine.manager.secondary_tiers
    assert isinstance(tier, KvledgerDiskTier)
    return tier


def tiering(tmp_path: Path, cpu_blocks: int) -> dict[str, Any]:
    return {
        "cpu_bytes_to_use": cpu_blocks * ROW,
        "eviction_policy": "LineageCachePolicy",
        "cache_policy_module_path": "kvledger.integrations.vllm.policies",
        "secondary_tiers": [
            {
                "type": "KvledgerDiskTier",
                "module_path": "kvledger.integrations.vllm.disk_tier",
                "num_blocks": 32,
                "data_dir": str(tmp_path / "g3"),
                "log_url": f"sqlite:///{tmp_path / 'vllm-g3.db'}",
                "enable_kv_events": True,
            }
        ],
    }


PROMPT_A = list(range(1000, 1000 + 3 * BLOCK + 5))  # 3 full blocks
PROMPT_B = list(range(5000, 5000 + 7 * BLOCK + 3))  # fills G1 and the CPU tier


def check_a(engine: Engine, req_id: str) -> None:
    block_ids = engine.block_ids[req_id]
    for index in range(3):
        expected = block_bytes(PROMPT_A[index * BLOCK : (index + 1) * BLOCK])
        assert torch.equal(engine.kv[block_ids[index]], expected), f"block {index} of A"


def test_blocks_go_cpu_to_kvledger_g3_and_back_byte_identical(tmp_path: Path) -> None:
    engine = Engine(**tiering(tmp_path, cpu_blocks=7))
    tier = g3_tier(engine)
    engine.add("a1", PROMPT_A)
    engine.run()
    a_blocks = tier.pool.resident_blocks()
    a_hashes = set(a_blocks)
    assert len(a_hashes) == 3, "A's 3 full blocks cascaded to kvledger's G3"
    # named as a chain: each block's parent is the block before it in the request
    parents = sorted(parent is None for _, parent in a_blocks.values())
    assert parents == [False, False, True]
    assert {parent for _, parent in a_blocks.values()} - {None} < a_hashes
    # vLLM's own KV-event stream tells routers A is on STORAGE (kvledger's tier's events)
    stored = [e for e in engine.published if isinstance(e, BlockStored)]
    assert sum(len(e.block_hashes) for e in stored if e.medium == MEDIUM_STORAGE) == 3

    engine.add("b", PROMPT_B)
    engine.run()
    assert len(tier.pool.resident_blocks()) == 3 + 7

    # G1 wiped, the model writes nothing, A is gone from the CPU tier: only G3 has it
    engine.write_kv = False
    engine.kv.zero_()
    engine.add("a2", PROMPT_A)
    engine.run()
    check_a(engine, "a2")
    stats = engine.scheduler.connector.get_kv_connector_stats()  # type: ignore[union-attr]
    assert stats is None or not stats.is_empty()

    tier.flush_log()
    log_url = tiering(tmp_path, 7)["secondary_tiers"][0]["log_url"]
    assert replay(log_url) == tier.worker.state()
    assert set(replay(log_url).snapshot()[(0, Tier.G3)]) >= a_hashes
    engine.manager.shutdown()


def test_a_restarted_engine_serves_g3_from_the_file_its_log_vouches_for(tmp_path: Path) -> None:
    first = Engine(**tiering(tmp_path, cpu_blocks=7))
    first.add("a1", PROMPT_A)
    first.run()
    a_hashes = set(g3_tier(first).pool.resident_blocks())
    first.manager.shutdown()

    second = Engine(**tiering(tmp_path, cpu_blocks=7))
    tier = g3_tier(second)
    assert set(tier.pool.resident_blocks()) == a_hashes, "A recovered from the G3 file"
    second.write_kv = False
    second.add("a2", PROMPT_A)
    second.run()
    check_a(second, "a2")
    tier.flush_log()
    log_url = tiering(tmp_path, 7)["secondary_tiers"][0]["log_url"]
    assert replay(log_url) == tier.worker.state()
    second.manager.shutdown()


# -- G4: worker B's engine loads worker A's blocks over NIXL --------------------------------

REDIS_URL = os.environ.get("KVLEDGER_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
OWNER, READER = 1, 2
PROMPTS = {"A": PROMPT_A, "C": list(range(9000, 9000 + 3 * BLOCK + 1))}
needs_nixl = pytest.mark.skipif(
    nixl_unavailable_reason() is not None, reason=str(nixl_unavailable_reason())
)


def peer_log(folder: Path, worker_id: int) -> str:
    return f"sqlite:///{folder / f'peer-{worker_id}.db'}"


def peer_tiering(folder: Path, worker_id: int, namespace: str) -> dict[str, Any]:
    return {
        "cpu_bytes_to_use": 7 * ROW,
        "secondary_tiers": [
            {
                "type": "KvledgerPeerTier",
                "module_path": "kvledger.integrations.vllm.peer_tier",
                "num_blocks": 16,
                "worker_id": worker_id,
                "log_url": peer_log(folder, worker_id),
                "redis_url": REDIS_URL,
                "redis_namespace": namespace,
                "timeout_s": 5.0,
            }
        ],
    }


def peer_tier(engine: Engine) -> KvledgerPeerTier:
    (tier,) = engine.manager.secondary_tiers
    assert isinstance(tier, KvledgerPeerTier)
    return tier


def settle(engine: Engine) -> None:
    """Until the engine is idle and what its tier did is in its log, Redis and the directory."""
    engine.run()
    tier = peer_tier(engine)
    tier.flush_log()
    publisher = tier.worker.publisher
    assert publisher is not None and publisher.wait_applied(10)
    assert tier.parts.exporter.flush(10)


def blocks_of(prompt: list[int]) -> list[torch.Tensor]:
    return [block_bytes(prompt[i * BLOCK : (i + 1) * BLOCK]) for i in range(len(prompt) // BLOCK)]


def onboarded_from_g4(log_url: str) -> set[int]:
    """The blocks the log says came from another worker (``Onboarded(G4 -> ...)``)."""
    db = open_database(log_url)
    try:
        found: set[int] = set()
        for rows in read_chunks(db, select_rows()):
            for _, event in decode_rows(rows):
                if isinstance(event, Onboarded) and event.src_tier == Tier.G4:
                    found.update(event.sequence_hashes)
        return found
    finally:
        db.dispose()


@pytest.fixture
def g4_pair(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Owner, Engine]]:
    redis = pytest.importorskip("redis")
    try:
        redis.Redis.from_url(REDIS_URL).ping()
    except redis.RedisError as exc:
        pytest.skip(f"no Redis at {REDIS_URL}: {exc}")
    # both engines name blocks alike only with one seed for vLLM's first parent hash
    monkeypatch.setenv("PYTHONHASHSEED", "0")
    namespace = f"kvl-vllm-g4e2e-{uuid.uuid4().hex[:8]}"
    owner = Owner(namespace, tmp_path, script=__file__)
    reader = Engine(**peer_tiering(tmp_path, READER, namespace))
    reader.write_kv = False
    try:
        yield owner, reader
    finally:
        peer_tier(reader).flush_log()
        reader.manager.shutdown()
        owner.close()
        client = redis.Redis.from_url(REDIS_URL)
        for k in client.scan_iter(match=f"kvl:{{{namespace}}}*"):
            client.delete(k)


@needs_nixl
def test_engine_b_loads_engine_as_blocks_over_nixl(
    g4_pair: tuple[Owner, Engine], tmp_path: Path
) -> None:
    owner, reader = g4_pair
    log_url = peer_log(tmp_path, READER)
    held = owner.ask("run", "A")["held"]
    assert len(held) == 3, "A's 3 full blocks cascaded to its exported pool"
    reader.add("a", PROMPT_A)
    reader.run()
    # B computed nothing: every byte of A's blocks in B's G1 came from A, over NIXL
    check_a(reader, "a")
    settle(reader)
    tier = peer_tier(reader)
    assert onboarded_from_g4(log_url) == set(held)
    assert set(tier.pool.resident_blocks()) == set(held), "B now exports them too"
    assert replay(log_url) == tier.worker.state()
    assert owner.ask("state")["replays"]


@needs_nixl
def test_a_block_reused_between_bs_lookup_and_read_is_recomputed(
    g4_pair: tuple[Owner, Engine], tmp_path: Path
) -> None:
    owner, reader = g4_pair
    log_url = peer_log(tmp_path, READER)
    held = owner.ask("run", "C")["held"]
    assert len(held) == 3
    tier = peer_tier(reader)
    prompt = PROMPTS["C"]
    middle = key_hash(tier_key(reader, prompt, 1))
    assert middle in held
    lookup = tier.lookup
    asked: list[int] = []

    def lookup_then_a_reuses_the_middle_slot(key: OffloadKey, ctx: Any) -> Any:
        result = lookup(key, ctx)
        if key_hash(key) == middle and not asked:
            asked.append(middle)
            owner.ask("overwrite", middle)  # after B's lookup found it, before B's read
        return result

    tier.lookup = lookup_then_a_reuses_the_middle_slot  # type: ignore[method-assign]
    reader.write_kv = True  # B's model computes what it could not load
    reader.kv.zero_()
    reader.add("c", prompt)
    reader.run()
    assert asked, "B looked the middle block up on A"
    block_ids = reader.block_ids["c"]
    for index, expected in enumerate(blocks_of(prompt)):
        assert torch.equal(reader.kv[block_ids[index]], expected), f"block {index} of C"
    settle(reader)
    loaded = onboarded_from_g4(log_url)
    assert middle not in loaded, "the reused block was a miss, not A's overwritten bytes"
    assert key_hash(tier_key(reader, prompt, 0)) in loaded, "the block before it came from A"
    assert replay(log_url) == tier.worker.state()
    assert owner.ask("state")["replays"]


def tier_key(engine: Engine, prompt: list[int], index: int) -> OffloadKey:
    """The offload key vLLM gives block ``index`` of ``prompt`` (its block hash, group 0)."""
    request = Request(
        request_id="probe",
        prompt_token_ids=prompt,
        sampling_params=SamplingParams(max_tokens=1),
        pooling_params=None,
        block_hasher=engine.hasher,
    )
    return make_offload_key(request.block_hashes[index], 0)


def owner_main(namespace: str, folder: Path) -> None:
    """Worker A: an engine whose blocks other workers read (commands: ``run A|C``,
    ``overwrite HASH``, ``state``, ``quit``)."""
    # what the harness conftest and the autouse fixture do for the test process
    type(current_platform).support_hybrid_kv_cache = classmethod(lambda cls: True)  # type: ignore[method-assign,assignment]
    TieringOffloadingSpec.get_worker = lambda spec, kv_caches: CpuCopyWorker(spec, kv_caches)  # type: ignore[method-assign,assignment]
    engine = Engine(**peer_tiering(folder, OWNER, namespace))
    tier = peer_tier(engine)

    def run(prompt: str) -> dict[str, Any]:
        engine.add(f"r-{prompt}", PROMPTS[prompt])
        settle(engine)
        return {"held": sorted(tier.pool.resident_blocks())}

    def overwrite(block: str) -> dict[str, Any]:  # its slot reused before the directory knows
        slot = tier.pool.lookup(int(block))
        assert slot is not None
        tier._g2_rows[slot] = 7
        return {"ok": True}

    def state() -> dict[str, Any]:
        settle(engine)
        return {"replays": replay(peer_log(folder, OWNER)) == tier.worker.state()}

    def close() -> None:
        tier.flush_log()
        engine.manager.shutdown()

    serve({"run": run, "overwrite": overwrite, "state": state}, close)


if __name__ == "__main__" and sys.argv[1:2] == ["owner"]:
    owner_main(sys.argv[2], Path(sys.argv[3]))
