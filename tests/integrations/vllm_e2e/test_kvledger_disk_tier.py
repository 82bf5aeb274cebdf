"""kvledger's G3 tier through vLLM's ``SecondaryTierManager`` interface (runs in the vLLM test
venv): what vLLM's own tier tests do not reach. Built the way vLLM builds it, from a
``secondary_tiers`` entry through ``SecondaryTierFactory``; jobs carry real rows of a CPU tier.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any
from unittest.mock import MagicMock

import numpy as np
import pytest
import torch
from vllm.v1.kv_offload.base import LookupResult, OffloadKey, ReqContext, make_offload_key
from vllm.v1.kv_offload.tiering.base import JobResult, TransferJob
from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory

from kvledger import replay
from kvledger.events.types import Tier
from kvledger.integrations.vllm.disk_tier import KvledgerDiskTier
from kvledger.integrations.vllm.keys import key_hash

CHUNKS, ROW = 8, 4096
CTX = ReqContext(req_id="r")


def spec() -> Any:
    s = MagicMock()
    s.kv_events_config.enable_kv_cache_events = True
    s.config.groups = ()
    return s


def make_tier(tmp_path: Path, cpu: torch.Tensor, **settings: Any) -> KvledgerDiskTier:
    config = {
        "type": "KvledgerDiskTier",
        "module_path": "kvledger.integrations.vllm.disk_tier",
        "num_blocks": 4,
        "data_dir": str(tmp_path / "g3"),
        "log_url": f"sqlite:///{tmp_path / 'g3.db'}",
        **settings,
    }
    tier = SecondaryTierFactory.create_secondary_tier(config, memoryview(cpu.numpy()), spec())
    assert isinstance(tier, KvledgerDiskTier)
    return tier


def keys(*ids: int) -> list[OffloadKey]:
    return [make_offload_key(f"k{i}".encode(), 0) for i in ids]


def job(job_id: int, ks: list[OffloadKey], chunks: list[int], load: bool = False) -> TransferJob:
    return TransferJob(job_id, ks, np.array(chunks, dtype=np.int64), load, CTX)


def drain(tier: KvledgerDiskTier) -> dict[int, JobResult]:
    tier.drain_jobs()
    return {r.job_id: r for r in tier.get_finished_jobs()}


@pytest.fixture
def cpu() -> torch.Tensor:
    return torch.randint(-128, 127, (CHUNKS, ROW), dtype=torch.int8)


def test_store_load_round_trip_and_the_log_replays_to_the_tier(
    tmp_path: Path, cpu: torch.Tensor
) -> None:
    tier = make_tier(tmp_path, cpu)
    written = cpu[:3].clone()
    tier.submit_store(job(1, keys(1, 2, 3), [0, 1, 2]))
    assert drain(tier)[1].success
    assert [tier.lookup(k, CTX) for k in keys(1, 2, 3, 4)] == [LookupResult.HIT] * 3 + [
        LookupResult.MISS
    ]
    cpu.zero_()
    tier.submit_load(job(2, keys(3, 1), [7, 5], load=True))
    result = drain(tier)[2]
    assert result.success and result.transfer_bytes == 2 * ROW
    assert torch.equal(cpu[7], written[2]) and torch.equal(cpu[5], written[0])
    tier.flush_log()
    state = replay(f"sqlite:///{tmp_path / 'g3.db'}")
    assert state == tier.worker.state()
    assert set(state.snapshot()[(0, Tier.G3)]) == {key_hash(k) for k in keys(1, 2, 3)}
    tier.shutdown()


def test_a_slot_that_fails_its_checksum_is_a_miss_for_its_key_only(
    tmp_path: Path, cpu: torch.Tensor
) -> None:
    tier = make_tier(tmp_path, cpu)
    written = cpu[:3].clone()
    tier.submit_store(job(1, keys(1, 2, 3), [0, 1, 2]))
    assert drain(tier)[1].success
    slot = tier.pool.lookup(key_hash(keys(2)[0]))
    assert slot is not None
    fd = os.open(tier.disk.path, os.O_WRONLY)
    os.pwrite(fd, b"\xff" * 64, tier.disk.slot_offset(slot) + 100)  # bit rot on disk
    os.close(fd)
    tier.submit_load(job(2, keys(1, 2, 3), [4, 5, 6], load=True))
    result = drain(tier)[2]
    assert not result.success
    assert result.successful_keys is not None
    assert set(result.successful_keys) == set(keys(1, 3))
    assert torch.equal(cpu[4], written[0]) and torch.equal(cpu[6], written[2])
    assert tier.lookup(keys(2)[0], CTX) is LookupResult.MISS  # dropped: Removed(G3)
    assert tier.disk.corrupt_reads == 1
    tier.flush_log()
    assert replay(f"sqlite:///{tmp_path / 'g3.db'}") == tier.worker.state()
    tier.shutdown()


def test_a_block_evicted_between_lookup_and_load_is_a_miss_for_that_key(
    tmp_path: Path, cpu: torch.Tensor
) -> None:
    tier = make_tier(tmp_path, cpu)  # 4 slots
    tier.submit_store(job(1, keys(1, 2, 3, 4), [0, 1, 2, 3]))
    assert drain(tier)[1].success
    assert tier.lookup(keys(1)[0], CTX) is LookupResult.HIT
    tier.submit_store(job(2, keys(5), [4]))  # evicts the least recently used: block 1
    assert drain(tier)[2].success
    tier.submit_load(job(3, keys(1, 2), [6, 7], load=True))
    result = drain(tier)[3]
    assert not result.success and result.successful_keys == (keys(2)[0],)
    tier.shutdown()


def test_take_events_announces_g3_stores_and_evictions_to_vllm(
    tmp_path: Path, cpu: torch.Tensor
) -> None:
    tier = make_tier(tmp_path, cpu, enable_kv_events=True)
    tier.submit_store(job(1, keys(1, 2, 3, 4), [0, 1, 2, 3]))
    drain(tier)
    tier.submit_store(job(2, keys(5), [4]))
    drain(tier)
    events = list(tier.take_events())
    assert [(e.removed, e.keys) for e in events] == [
        (False, keys(1, 2, 3, 4)),
        (True, keys(1)),
        (False, keys(5)),
    ]
    tier.shutdown()


def test_a_restart_serves_what_the_log_vouches_for_and_drops_the_rest(
    tmp_path: Path, cpu: torch.Tensor
) -> None:
    tier = make_tier(tmp_path, cpu)
    tier.submit_store(job(1, keys(1, 2, 3), [0, 1, 2]))
    assert drain(tier)[1].success
    slot = tier.pool.lookup(key_hash(keys(3)[0]))
    tier.shutdown()
    assert slot is not None
    fd = os.open(tmp_path / "g3" / "vllm-g3-w0.bin", os.O_WRONLY)
    os.pwrite(fd, b"\x00" * 64, 4096 + slot * 4096)  # block 3's bytes damaged while down
    os.close(fd)

    again = make_tier(tmp_path, cpu)
    assert set(again.pool.resident_blocks()) == {key_hash(k) for k in keys(1, 2)}
    assert again.disk.recovery.kept == 2 and len(again.disk.recovery.corrupt) == 1
    again.flush_log()
    state = replay(f"sqlite:///{tmp_path / 'g3.db'}")
    assert state == again.worker.state()  # the log says block 3 is gone (Removed)
    again.shutdown()


def test_two_tiers_of_one_worker_cannot_both_be_g3(tmp_path: Path, cpu: torch.Tensor) -> None:
    tier = make_tier(tmp_path, cpu)
    with pytest.raises(ValueError, match="already has a G3 tier"):
        make_tier(tmp_path, cpu, data_dir=str(tmp_path / "other"))
    tier.shutdown()


@pytest.mark.parametrize(
    ("settings", "names"),
    [
        ({"num_blocks": 0}, "num_blocks"),
        ({"num_blocks": "many"}, "num_blocks"),
        ({"eviction_policy": "fifo"}, "eviction_policy"),
        ({"worker_id": -1}, "worker_id"),
        ({"log_url": None, "redis_url": "redis://127.0.0.1:1"}, "redis_url"),
        ({"locality": "nearby"}, "Locality"),
    ],
)
def test_bad_settings_are_refused_naming_them(
    tmp_path: Path, cpu: torch.Tensor, settings: dict[str, Any], names: str
) -> None:
    with pytest.raises(ValueError, match=names):
        make_tier(tmp_path, cpu, **settings)


def test_a_job_outside_the_cpu_tier_fails_without_raising(
    tmp_path: Path, cpu: torch.Tensor
) -> None:
    tier = make_tier(tmp_path, cpu)
    tier.submit_store(job(1, keys(1), [CHUNKS]))
    tier.submit_load(job(2, keys(1), [-1], load=True))
    results = drain(tier)
    assert not results[1].success and not results[2].success
    assert not tier.pool.resident_blocks()
    tier.shutdown()


def test_a_log_inside_a_data_dir_not_made_yet_opens(tmp_path: Path, cpu: torch.Tensor) -> None:
    """The usual setting, ``log_url`` in the tier's own ``data_dir`` on a fresh machine: the
    tier makes its folder (owner-only) before its log opens there."""
    folder = tmp_path / "fresh" / "g3"
    tier = make_tier(tmp_path, cpu, data_dir=str(folder), log_url=f"sqlite:///{folder / 'g3.db'}")
    try:
        tier.submit_store(job(1, keys(1), [0]))
        assert drain(tier)[1].success
        assert (folder / "g3.db").exists() and folder.stat().st_mode & 0o777 == 0o700
    finally:
        tier.shutdown()
