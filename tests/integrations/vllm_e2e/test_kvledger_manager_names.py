"""How kvledger's vLLM offloading manager names stored blocks in its event log (runs in the
vLLM test venv, from vLLM's test tree).

vLLM 0.33 gives the manager no token ids, so blocks are named by the xxh3 of their vLLM key;
what the manager can give is each block's parent: the block one chunk before it in the same
request and KV-cache group, when it saw that block, across stores of the same request.
"""

from __future__ import annotations

from pathlib import Path

from vllm.v1.kv_offload.base import OffloadKey, ReqContext, make_offload_key

from kvledger import replay
from kvledger.events.log import EventLog
from kvledger.events.types import Stored, Tier
from kvledger.integrations.vllm.manager import KvledgerOffloadingManager, key_hash

CHUNK = 16


def key(i: int, group: int = 0) -> OffloadKey:
    return make_offload_key(i.to_bytes(8, "big"), group)


def request(name: str, keys: list[OffloadKey], first_chunk: int = 0) -> ReqContext:
    ctx = ReqContext(req_id=name)
    for i, k in enumerate(keys):
        ctx.set_offload_key_position(k, (first_chunk + i + 1) * CHUNK)
    return ctx


def store(m: KvledgerOffloadingManager, ctx: ReqContext, keys: list[OffloadKey]) -> None:
    out = m.prepare_store(keys, ctx)
    assert out is not None
    m.complete_store(out.keys_to_store, ctx)


def stored(log_url: str, tier: Tier = Tier.G2) -> list[tuple[int | None, list[int]]]:
    log = EventLog(log_url)
    try:
        return [
            (e.parent_hash, list(e.sequence_hashes))
            for e in log.read()
            if isinstance(e, Stored) and e.tier is tier
        ]
    finally:
        log.close()


def test_stores_of_one_request_chain_on_each_other(tmp_path: Path) -> None:
    log_url = f"sqlite:///{tmp_path / 'names.db'}"
    m = KvledgerOffloadingManager(8, log_url=log_url, tokens_per_chunk={0: CHUNK, 1: CHUNK})
    k = [key(i) for i in range(4)]
    g1 = [key(10 + i, group=1) for i in range(2)]
    ctx = request("a", k)
    for i, other in enumerate(g1):
        ctx.set_offload_key_position(other, (i + 1) * CHUNK)
    store(m, ctx, k[:2])
    store(m, ctx, [k[2], *g1, k[3]])  # a later store, two groups mixed
    # a request that starts at its 3rd chunk: the manager never saw its 2nd
    late = [key(20), key(21)]
    store(m, request("late", late, first_chunk=2), late)
    h = key_hash
    m.flush_log()
    assert stored(log_url) == [
        (None, [h(k[0]), h(k[1])]),
        (h(k[1]), [h(k[2])]),
        (None, [h(g1[0]), h(g1[1])]),
        (h(k[2]), [h(k[3])]),
        (None, [h(late[0]), h(late[1])]),
    ]
    state = replay(log_url).snapshot()[(0, Tier.G2)]
    assert state[h(k[3])] == (h(k[3]), h(k[2]))
    assert state == m.state().snapshot()[(0, Tier.G2)]
    m.shutdown()


def test_without_chunk_sizes_each_store_is_one_chain(tmp_path: Path) -> None:
    log_url = f"sqlite:///{tmp_path / 'names.db'}"
    m = KvledgerOffloadingManager(8, log_url=log_url)
    k = [key(i) for i in range(3)]
    ctx = request("a", k)
    store(m, ctx, k[:2])
    store(m, ctx, k[2:])
    m.flush_log()
    assert stored(log_url) == [(None, [key_hash(k[0]), key_hash(k[1])]), (None, [key_hash(k[2])])]
    m.shutdown()
