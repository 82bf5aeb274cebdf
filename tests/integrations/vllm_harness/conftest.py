"""Root conftest for vLLM 0.33's own tests, run in the vLLM test venv against kvledger.

vLLM's own root conftest pulls its whole serving and model-download stack; the tests run here
need none of it, so this file takes its place (tests/integrations/setup_vllm_test_venv.sh puts
it there). It does two things:

- lets the platform vLLM finds here (no GPU, no compiled vLLM kernels) claim the hybrid
  KV-cache manager: the offloading-connector tests build a scheduler with it enabled, which
  such a platform refuses although nothing those tests run needs a GPU. A test-only patch.
- with ``KVLEDGER_VLLM_MANAGER=1``, points every test module that builds vLLM's
  ``CPUOffloadingManager`` at kvledger's manager (and its ``ARCCachePolicy`` at kvledger's
  ``ArcPolicy``, the class kvledger's manager runs for ``cache_policy="arc"``, which the
  tests' ``isinstance`` check of ``manager._policy`` then finds), and skips the tests that
  read or patch that class's or vLLM's policies' private parts (listed below with the
  reason), which no other manager has.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
from vllm.platforms import current_platform

type(current_platform).support_hybrid_kv_cache = classmethod(lambda cls: True)  # type: ignore[method-assign,assignment]

POINT_AT_KVLEDGER = os.environ.get("KVLEDGER_VLLM_MANAGER") == "1"

_ARC_LISTS = "reads or rewrites ARCCachePolicy's own t1/t2/b1/b2 lists and target"
_ARC_EVICT = "drives ARCCachePolicy.evict directly, with its chunks' ref_cnt set by hand"
#: test name (prefix) -> why it cannot apply to any manager but CPUOffloadingManager
NOT_APPLICABLE = {
    "TestARCPolicy::test_basic": _ARC_LISTS,
    "TestARCPolicy::test_t1_to_t2_promotion": _ARC_LISTS,
    "TestARCPolicy::test_adaptive_target": _ARC_LISTS,
    "TestARCPolicy::test_t1_t2_eviction_policy": _ARC_LISTS,
    "TestARCPolicy::test_batch_eviction_scans_t1_and_t2_once": _ARC_EVICT,
    "TestARCPolicy::test_batch_eviction_falls_back_after_t1_iterator_exhausted": _ARC_EVICT,
    "TestARCPolicy::test_store_falls_back_to_t1_when_t2_cannot_satisfy_eviction": _ARC_LISTS,
    "TestARCPolicy::test_batch_eviction_failure_is_atomic": _ARC_EVICT,
    "TestARCPolicy::test_ghost_list_bounds": _ARC_LISTS,
    "TestARCPolicy::test_touch_ordering": _ARC_LISTS,
    "TestARCPolicy::test_failed_store": _ARC_LISTS,
    "TestARCPolicy::test_full_scenario": _ARC_LISTS,
    "test_reset_discards_stale_request_access_classification": _ARC_LISTS,
    "test_arc_counts_reuse_once_and_keeps_insertions_in_t1": _ARC_LISTS,
    "test_arc_reuse_wins_if_same_request_later_reinserts_key": _ARC_LISTS,
    "test_arc_ghost_hit_adapts_once_per_request_before_insertion": _ARC_LISTS,
    "test_arc_pending_chunk_is_not_a_frequency_hit": _ARC_LISTS,
    "test_cpu_manager_reports_allocation_size_on_allocation_failure": (
        "monkeypatches CPUOffloadingManager._allocate_chunks"
    ),
    "test_lru_batch_eviction_failure_is_atomic": "drives LRUCachePolicy.evict directly",
    "test_lru_repeated_pin_cycles_compact_lazy_heap_entries": "reads LRUCachePolicy._heap",
    "test_evictable_cache_chunk_count": (
        "reads CPUOffloadingManager._num_evictable_cache_chunks and patches _policy.evict"
    ),
    "test_touch_forwards_req_context_to_policy": "patches CPUOffloadingManager._policy.touch",
    "test_request_finish_forwards_grouped_deduplicated_accesses": (
        "patches CPUOffloadingManager._policy.on_request_finished"
    ),
    "test_failed_store_records_access_once_and_uses_store_miss_hook": (
        "patches CPUOffloadingManager._record_request_cache_access and _policy hooks"
    ),
}


_FS_FILES = "asserts the fs tier's one file per block (its FileMapper paths) or its I/O module"
_FS_INSIDE = "reads or patches the fs tier's own lookup thread, thread pool or job bookkeeping"
_EXAMPLE_INSIDE = "reads or fills the example tier's own chunks dict or completed_jobs list"
_SYNC = (
    "counts on the example tier finishing each job inside submit_store (two steps later the"
    " primary chunks must be free); kvledger's tier finishes on its I/O threads, as vLLM's"
    " contract allows"
)
#: tests of vLLM's own tiers that cannot apply to kvledger's tier in their place, and why
TIER_NOT_APPLICABLE = {
    "test_store_creates_file_and_lookup_succeeds": _FS_FILES,
    "test_store_accepts_block_published_by_another_writer": _FS_FILES,
    "test_store_then_load_roundtrip": _FS_FILES,
    "test_store_load_data_integrity": _FS_FILES,
    "test_store_load_roundtrip_without_o_direct": "patches the fs tier's O_DIRECT probe",
    "test_factory_forwards_locality_to_fs_tier": "checks vLLM's registration of the 'fs' type",
    "test_shutdown_discards_pending_tasks": _FS_INSIDE,
    "test_batch_lookup_c_extension": "tests the fs tier's C lookup extension",
    "test_batch_lookup_dispatch": _FS_INSIDE,
    "test_failed_load_corrects_verdict_and_removes_corrupt_file": _FS_FILES,
    "test_failed_load_after_abort_does_not_break_newer_probe": _FS_INSIDE,
    "test_batched_partial_load_failure_keeps_loaded_blocks": _FS_FILES,
    "test_batched_load_first_block_fails_marks_whole_batch": _FS_FILES,
    "test_transient_load_failure_leaves_file": _FS_FILES,
    "test_mixed_job_results_emit_event_only_for_successful_job": _FS_FILES,
    "test_partially_failed_store_emits_no_event": _FS_FILES,
    "test_events_disabled_by_default": _FS_INSIDE,
    "test_events_require_global_kv_events_flag": _FS_INSIDE,
    "test_fs_tier_cross_tp_round_trip": _FS_FILES,
    "TestExampleSecondaryTierManager": _EXAMPLE_INSIDE,
    "TestTieringOffloadingManager::test_cascade_to_all_secondary_tiers": _EXAMPLE_INSIDE,
    "TestTieringOffloadingManager::test_ref_cnt_protection_during_cascade": _EXAMPLE_INSIDE,
    "TestTieringOffloadingManager::test_promotion_from_secondary": _EXAMPLE_INSIDE,
    "TestTieringOffloadingManager::test_failed_promotion_keeps_only_successful_chunks": (
        _EXAMPLE_INSIDE
    ),
    "TestTieringOffloadingManager::test_lookup_does_not_report_async_delay_for_promotion": (
        _EXAMPLE_INSIDE
    ),
    "TestTieringOffloadingManager::test_held_promotions_keep_primary_hits": _EXAMPLE_INSIDE,
    "TestTieringOffloadingManager::test_reset_holds_promotions_until_flushed": _EXAMPLE_INSIDE,
    "TestTieringOffloadingManager::test_lookup_batches_submit_load_per_request": _EXAMPLE_INSIDE,
    "TestTieringOffloadingManager::test_lookup_shared_chunk_no_duplicate_promotion": (
        _EXAMPLE_INSIDE
    ),
    "TestTieringOffloadingManager::test_reset_cache_clears_orchestrator_state": _EXAMPLE_INSIDE,
    "TestTieringOffloadingManager::test_tier_filter_": _EXAMPLE_INSIDE,
    "TestTieringOffloadingManager::test_eviction_in_primary_tier": _SYNC,
    "TestTieringOffloadingManager::test_request_order_survives_late_cascade_completion": _SYNC,
    "TestTieringOffloadingManager::test_late_old_store_submission_does_not_override_newer": (_SYNC),
}


def _why_not(item: pytest.Item) -> str | None:
    name = item.nodeid.split("::", 1)[1] if "::" in item.nodeid else item.name
    for prefix, why in NOT_APPLICABLE.items():
        if name.startswith(prefix) or item.name.startswith(prefix):
            return why
    return None


def _tier_why_not(item: pytest.Item) -> str | None:
    name = item.nodeid.split("::", 1)[1] if "::" in item.nodeid else item.name
    for prefix, why in TIER_NOT_APPLICABLE.items():
        if name.startswith(prefix) or item.name.startswith(prefix):
            return why
    return None


#: vLLM's tests of a tier's behaviour, run with kvledger's G3 tier in the tier's place
TIER_TEST_MODULES = ("test_fs_tier", "test_tiering_offloading")


def _points_at_a_tier(module: object) -> bool:
    return getattr(module, "__name__", "").rpartition(".")[2] in TIER_TEST_MODULES


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not POINT_AT_KVLEDGER:
        return
    for item in items:
        why = None
        if item.module is not None and hasattr(item.module, "CPUOffloadingManager"):
            why = _why_not(item)
        if why is None and item.module is not None and _points_at_a_tier(item.module):
            why = _tier_why_not(item)
        if why is not None:
            item.add_marker(pytest.mark.skip(reason=f"not applicable to kvledger: {why}"))


@pytest.fixture(autouse=True)
def _kvledger_manager(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    if POINT_AT_KVLEDGER and hasattr(request.module, "CPUOffloadingManager"):
        from kvledger.integrations.vllm.manager import KvledgerOffloadingManager

        monkeypatch.setattr(request.module, "CPUOffloadingManager", KvledgerOffloadingManager)
        if hasattr(request.module, "ARCCachePolicy"):
            from kvledger.registry.policies import ArcPolicy

            monkeypatch.setattr(request.module, "ARCCachePolicy", ArcPolicy)
    if POINT_AT_KVLEDGER and _points_at_a_tier(request.module):
        _point_tiers_at_kvledger(request, monkeypatch)


def _point_tiers_at_kvledger(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM's fs and example tiers' tests, with kvledger's G3 tier in their place: each with
    the constructor of the tier it stands in for (the fs tier's ``root_dir`` is where the G3
    file goes; the example tier's has none, so a temporary folder is). kvledger's lookups
    answer at once, so the fs tests' helper that waits for the fs tier's own lookup thread
    is replaced by one that just looks up."""
    import tempfile
    import time

    from kvledger.integrations.vllm.disk_tier import KvledgerDiskTier

    folder = tempfile.TemporaryDirectory(prefix="kvledger-tier-")
    request.addfinalizer(folder.cleanup)

    class KvledgerTierAsFs(KvledgerDiskTier):  # type: ignore[misc]
        def __init__(
            self,
            offloading_spec: Any,
            primary_kv_view: memoryview,
            tier_type: str,
            root_dir: str,
            n_read_threads: int = 16,
            n_write_threads: int = 16,
            enable_kv_events: bool = False,
            locality: str | None = None,
            backpressure_detector: Any = None,
        ) -> None:
            super().__init__(
                offloading_spec,
                primary_kv_view,
                tier_type,
                backpressure_detector,
                num_blocks=64,
                data_dir=root_dir,
                io_threads=max(1, min(n_read_threads, n_write_threads)),
                enable_kv_events=enable_kv_events,
                locality=locality,
            )

    class KvledgerTierAsExample(KvledgerDiskTier):  # type: ignore[misc]
        def __init__(
            self,
            offloading_spec: Any,
            primary_kv_view: memoryview,
            tier_type: str,
            custom_param: int = 0,
            backpressure_detector: Any = None,
        ) -> None:
            super().__init__(
                offloading_spec,
                primary_kv_view,
                tier_type,
                backpressure_detector,
                num_blocks=64,
                data_dir=tempfile.mkdtemp(dir=folder.name),
            )

    def lookup_and_wait(tier: Any, keys: list[Any], ctx: Any = None, timeout: float = 1.0) -> Any:
        ctx = ctx if ctx is not None else request.module._CTX
        deadline = time.monotonic() + timeout
        results = [tier.lookup(k, ctx) for k in keys]
        while any(r.name == "RETRY" for r in results) and time.monotonic() < deadline:
            time.sleep(0.01)
            results = [tier.lookup(k, ctx) for k in keys]
        return results

    module = request.module
    if hasattr(module, "FileSystemTierManager"):
        monkeypatch.setattr(module, "FileSystemTierManager", KvledgerTierAsFs)
        monkeypatch.setattr(module, "lookup_and_wait", lookup_and_wait)
    if hasattr(module, "ExampleSecondaryTierManager"):
        monkeypatch.setattr(module, "ExampleSecondaryTierManager", KvledgerTierAsExample)
