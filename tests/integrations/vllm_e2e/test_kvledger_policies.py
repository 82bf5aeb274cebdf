"""kvledger's eviction policies for vLLM users, run in the vLLM test venv.

Two ways in: kvledger's own offloading manager (``cache_policy`` lru, arc, lineage,
multi_lru), and vLLM's own ``CPUOffloadingManager`` (the CPU tier of vLLM's tiering layer)
with kvledger's policies loaded through ``cache_policy_module_path``. Both drive the same
policy objects (``kvledger.registry.policies``). The request stream is the offload bench's
kind: documents shared at random (a few hot ones), private tails. (vLLM's manager is reached
through its module: the harness points a module's own ``CPUOffloadingManager`` at kvledger's.)
"""

from __future__ import annotations

import random

import pytest
from vllm.v1.kv_offload.base import LookupResult, OffloadingManager, ReqContext, make_offload_key
from vllm.v1.kv_offload.cpu import manager as vllm_cpu

from kvledger.integrations.vllm import policies
from kvledger.integrations.vllm.manager import CACHE_POLICIES, KvledgerOffloadingManager

MODULE = "kvledger.integrations.vllm.policies"
ADAPTERS = {
    "lru": "LruCachePolicy",
    "arc": "ArcCachePolicy",
    "lineage": "LineageCachePolicy",
    "multi_lru": "MultiLruCachePolicy",
}


def stream(requests: int, seed: int = 1) -> list[list[bytes]]:
    rng = random.Random(seed)
    docs = [[f"d{d}b{b}".encode() for b in range(rng.randint(2, 10))] for d in range(30)]
    out = []
    for r in range(requests):
        doc = docs[min(int(rng.paretovariate(1.0)) - 1, len(docs) - 1)]
        tail = [f"r{r}t{t}".encode() for t in range(rng.randint(0, 4))]
        out.append([make_offload_key(k, 0) for k in doc + tail])
    return out


def hits(manager: OffloadingManager, keys_per_request: list[list[bytes]]) -> int:
    """What the OffloadingConnector's scheduler asks of a manager, request by request; the
    number of blocks loaded back."""
    total = 0
    for i, keys in enumerate(keys_per_request):
        ctx = ReqContext(req_id=str(i))
        for pos, key in enumerate(keys):
            ctx.set_offload_key_position(key, (pos + 1) * 16)
        manager.on_new_request(ctx)
        found = 0
        for key in keys:
            if manager.lookup(key, ctx) is not LookupResult.HIT:
                break
            found += 1
        if found:
            manager.prepare_load(keys[:found], ctx)
            manager.touch(keys[:found], ctx)
            manager.complete_load(keys[:found], ctx)
        out = manager.prepare_store(keys[found:], ctx)
        if out is not None and out.keys_to_store:
            manager.complete_store(out.keys_to_store, ctx)
        manager.on_request_finished(ctx)
        list(manager.take_events())
        total += found
    return total


@pytest.mark.parametrize("capacity", [16, 64])
def test_kvledgers_arc_hits_as_vllms_arc_and_beats_lru(capacity: int) -> None:
    keys = stream(2000)
    vllm_arc = hits(vllm_cpu.CPUOffloadingManager(capacity, cache_policy="arc"), keys)
    vllm_lru = hits(vllm_cpu.CPUOffloadingManager(capacity, cache_policy="lru"), keys)
    ours = hits(KvledgerOffloadingManager(capacity, cache_policy="arc"), keys)
    through_vllm = hits(
        vllm_cpu.CPUOffloadingManager(
            capacity, cache_policy="ArcCachePolicy", cache_policy_module_path=MODULE
        ),
        keys,
    )
    # the same algorithm: kvledger orders a pinned block by its release where vLLM keeps
    # its place, which moves a victim now and then, never the hit rate by more than 2 %
    for got in (ours, through_vllm):
        assert abs(got - vllm_arc) <= 0.02 * vllm_arc, (got, vllm_arc)
    assert vllm_arc > vllm_lru and ours > vllm_lru


@pytest.mark.parametrize("policy", CACHE_POLICIES)
def test_every_policy_runs_in_both_managers(policy: str) -> None:
    keys = stream(600, seed=3)
    ours = KvledgerOffloadingManager(8, cache_policy=policy, enable_events=True)
    theirs = vllm_cpu.CPUOffloadingManager(
        8, cache_policy=ADAPTERS[policy], cache_policy_module_path=MODULE, enable_events=True
    )
    assert hits(ours, keys) > 0
    assert hits(theirs, keys) > 0
    assert isinstance(theirs._policy, getattr(policies, ADAPTERS[policy]))


def test_lru_matches_vllms_lru_exactly() -> None:
    """kvledger's lru is vLLM's request-ranked LRU: the same loads on the same stream."""
    keys = stream(1500, seed=5)
    assert hits(KvledgerOffloadingManager(16), keys) == hits(
        vllm_cpu.CPUOffloadingManager(16), keys
    )


def test_an_unknown_policy_is_refused_naming_the_choices() -> None:
    with pytest.raises(ValueError, match="lru, arc, lineage, multi_lru"):
        KvledgerOffloadingManager(8, cache_policy="fifo")
    with pytest.raises(ValueError, match="cache_policy_module_path"):
        KvledgerOffloadingManager(8, cache_policy="ArcCachePolicy", cache_policy_module_path=MODULE)


def evicted_after_a_touched_tail(policy: str) -> list[bytes]:
    """A request stores head -> tail, another stores one block, the tail is touched again;
    then one block must go. The least recently used is the head, whose child lives."""
    manager = vllm_cpu.CPUOffloadingManager(3, cache_policy=policy, cache_policy_module_path=MODULE)
    head, tail, other = (make_offload_key(k, 0) for k in (b"head", b"tail", b"other"))
    ctx = ReqContext(req_id="a")
    ctx.set_offload_key_position(head, 16)
    ctx.set_offload_key_position(tail, 32)
    manager.on_new_request(ctx)
    assert manager.prepare_store([head, tail], ctx) is not None
    manager.complete_store([head, tail], ctx)
    manager.on_request_finished(ctx)
    late = ReqContext(req_id="b")
    late.set_offload_key_position(other, 16)
    manager.on_new_request(late)
    assert manager.prepare_store([other], late) is not None
    manager.complete_store([other], late)
    manager.on_request_finished(late)
    manager.touch([tail], late)
    out = manager.prepare_store([make_offload_key(b"new", 0)], ReqContext(req_id="c"))
    assert out is not None
    return [bytes(key[:-4]) for key in out.evicted_keys]


def test_lineage_through_vllms_manager_keeps_a_prefix_whose_suffix_lives() -> None:
    assert evicted_after_a_touched_tail("LruCachePolicy") == [b"head"]
    assert evicted_after_a_touched_tail("LineageCachePolicy") == [b"other"]
