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


def _why_not(item: pytest.Item) -> str | None:
    name = item.nodeid.split("::", 1)[1] if "::" in item.nodeid else item.name
    for prefix, why in NOT_APPLICABLE.items():
        if name.startswith(prefix) or item.name.startswith(prefix):
            return why
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not POINT_AT_KVLEDGER:
        return
    for item in items:
        if item.module is not None and hasattr(item.module, "CPUOffloadingManager"):
            why = _why_not(item)
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
