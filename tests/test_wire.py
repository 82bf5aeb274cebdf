"""Wire formats, checked against the real decoders: Dynamo's RadixTree and msgspec/vLLM."""

from __future__ import annotations

import json
import random
from typing import Any

import msgpack
import msgspec
import pytest
from event_streams import prompt_pool, worker_events
from hypothesis import given, settings
from hypothesis import strategies as st
from vllm_schema import vllm_classes

from kvledger.events import codec
from kvledger.events.shared.subscribe import decode_stream_record
from kvledger.events.types import (
    AnyEvent,
    Baseline,
    BlockInfo,
    Cleared,
    Offloaded,
    Removed,
    RunInfo,
    Stored,
    Tier,
)
from kvledger.events.wire import (
    WireFormatError,
    decode_baseline,
    encode_baseline,
    encode_dynamo,
    encode_vllm_batch,
    pack_hashes,
)
from kvledger.mocker.g1_pool import Deref, FullBlock, MockG1Pool, Use
from kvledger.registry.hashing import TokenBlockSequence
from kvledger.registry.index import RouterIndex, overlap_scores

U64 = st.integers(0, 2**64 - 1)
COMMON: dict[str, Any] = {"worker_id": 7, "dp_rank": 1, "tier": Tier.G2, "ts": 12.5}


# -- the shared registry's records -------------------------------------------------------


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10_000), ops=st.integers(1, 60))
def test_the_stream_carries_each_events_log_record(seed: int, ops: int) -> None:
    for event in worker_events(seed, 2, ops, prompt_pool(seed)):
        assert decode_stream_record(codec.encode(event)) == event


@given(
    eid=st.integers(0, 2**53),
    blocks=st.lists(st.tuples(U64, U64, st.none() | U64), min_size=0, max_size=8),
    tier=st.sampled_from(list(Tier)),
)
def test_baseline_round_trip(
    eid: int, blocks: list[tuple[int, int, int | None]], tier: Tier
) -> None:
    baseline = decode_baseline(
        encode_baseline(
            worker_id=7,
            dp_rank=1,
            tier=tier,
            event_id=eid,
            ts=2.5,
            seq=[s for s, _, _ in blocks],
            local=[loc for _, loc, _ in blocks],
            parent=[p for _, _, p in blocks],
        )
    )
    assert baseline == Baseline(
        event_id=eid,
        worker_id=7,
        dp_rank=1,
        tier=tier,
        ts=2.5,
        blocks=tuple(BlockInfo(*b) for b in blocks),
    )


def test_record_errors_name_the_problem() -> None:
    with pytest.raises(ValueError, match="unsigned 64-bit"):
        pack_hashes([-1])
    with pytest.raises(codec.CodecError):
        decode_stream_record(b"\xc1")
    run = RunInfo(
        event_id=0, worker_id=7, dp_rank=0, tier=Tier.G1, ts=0.0, g1_blocks=1, g2_blocks=0,
        g3_blocks=0, block_size=4, policy="lru", offload_filter="always",
    )  # fmt: skip
    with pytest.raises(codec.CodecError, match="transitions only"):
        decode_stream_record(codec.encode(run))
    with pytest.raises(WireFormatError, match="not msgpack"):
        decode_baseline(b"\xc1")
    with pytest.raises(WireFormatError, match="kind 100"):
        decode_baseline(msgpack.packb([1, 2]))
    good = encode_baseline(
        worker_id=1, dp_rank=0, tier=Tier.G1, event_id=3, ts=0.0, seq=[1], local=[2], parent=[None]
    )
    record = msgpack.unpackb(good, raw=True)
    for index, value, message in [
        (0, 9, "version 9"),
        (5, 7, "unknown tier 7"),
        (7, b"\x00" * 5, "multiple of 8 bytes"),
    ]:
        bad = list(record)
        bad[index] = value
        with pytest.raises(WireFormatError, match=message):
            decode_baseline(msgpack.packb(bad, use_bin_type=False))


# -- Dynamo ------------------------------------------------------------------------------


def test_dynamo_json_shape() -> None:
    stored = Stored(
        event_id=3, **{**COMMON, "tier": Tier.G1}, parent_hash=None, blocks=((10, 1), (11, 2))
    )
    assert json.loads(encode_dynamo(stored)[0]) == {
        "event_id": 3,
        "dp_rank": 1,
        "data": {
            "stored": {
                "parent_hash": None,
                "blocks": [
                    {"block_hash": 10, "tokens_hash": 1},
                    {"block_hash": 11, "tokens_hash": 2},
                ],
            }
        },
    }
    assert encode_dynamo(stored, tier=Tier.G2) == []  # another tier: nothing for this router
    cleared = Cleared(event_id=4, **{**COMMON, "tier": Tier.G1})
    assert json.loads(encode_dynamo(cleared)[0])["data"] == "cleared"
    # a copy of two unrelated blocks is two stored events, each with its own parent
    copy = Offloaded(
        event_id=5,
        **COMMON,
        src_tier=Tier.G1,
        blocks=(BlockInfo(10, 1, None), BlockInfo(11, 2, 10), BlockInfo(30, 3, 29)),
    )
    parts = [json.loads(b)["data"]["stored"] for b in encode_dynamo(copy, tier=Tier.G2)]
    assert [(p["parent_hash"], len(p["blocks"])) for p in parts] == [(None, 2), (29, 1)]


def test_dynamo_radix_tree_scores_match_our_index() -> None:
    """Three mock engines' G1 streams, fed to Dynamo's RadixTree and to our index, give the
    same overlap scores for every prompt, at many points of the stream."""
    from dynamo.llm import RadixTree

    rng = random.Random(5)
    heads = [[rng.randrange(32000) for _ in range(16 * rng.randrange(2, 10))] for _ in range(6)]
    prompts = [
        rng.choice(heads) + [rng.randrange(32000) for _ in range(16 * rng.randrange(1, 8))]
        for _ in range(60)
    ]
    tree, index = RadixTree(), RouterIndex()
    sent = removed = 0

    def check() -> None:
        for tokens in prompts[::3]:
            local = TokenBlockSequence(tokens, 16).local_hashes
            ours = overlap_scores(index.find_matches(local), Tier.G1)
            # Dynamo's stub says Dict[int, int]; the keys are (worker_id, dp_rank) pairs
            assert tree.find_matches(local).scores == ours  # type: ignore[comparison-overlap]

    streams: list[list[AnyEvent]] = [[], [], []]
    managers = [
        MockG1Pool(64, 16, eviction="lineage", sink=streams[w].append, worker_id=w, dp_rank=w % 2)
        for w in range(3)
    ]
    for step in range(150):
        w = step % 3
        tokens = rng.choice(prompts)
        seq = TokenBlockSequence(tokens, 16)
        blocks = [FullBlock(h) for h in seq.sequence_hashes]
        placed = managers[w].process(Use(blocks, local_hashes=seq.local_hashes))
        managers[w].process(Deref(blocks[:placed]))
        for event in streams[w]:
            for payload in encode_dynamo(event):
                tree.apply_event(w, payload)
            index.apply(event)
            sent += 1
            removed += isinstance(event, Removed)
        streams[w].clear()
        if step % 10 == 9:
            check()
    assert sent > 150 and removed > 0
    managers[1].emitter.cleared(Tier.G1)
    (cleared,) = streams[1]
    tree.apply_event(1, encode_dynamo(cleared)[0])
    index.apply(cleared)
    check()
    tree.remove_worker(2)
    index.remove_worker(2)
    check()


@settings(max_examples=20, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    steps=st.lists(
        st.tuples(st.integers(0, 2), st.sampled_from(["use", "use", "use", "restart", "leave"])),
        min_size=1,
        max_size=60,
    ),
)
def test_index_agrees_with_radix_tree_through_restarts_and_departures(
    seed: int, steps: list[tuple[int, str]]
) -> None:
    """Whatever the order of prompts, worker restarts (a Cleared, ids going on) and
    departures (``remove_worker``, then a fresh worker under the same id), Dynamo's RadixTree
    fed our JSON and our index fed the events give the same G1 overlap scores."""
    dynamo_llm = pytest.importorskip("dynamo.llm", reason="ai-dynamo-runtime is not installed")
    rng = random.Random(seed)
    heads = [[rng.randrange(32000) for _ in range(16 * rng.randrange(1, 6))] for _ in range(4)]
    prompts = [
        rng.choice(heads) + [rng.randrange(32000) for _ in range(16 * rng.randrange(1, 6))]
        for _ in range(24)
    ]
    tree, index = dynamo_llm.RadixTree(), RouterIndex()
    stream: list[AnyEvent] = []

    def manager(worker: int) -> MockG1Pool:
        return MockG1Pool(32, 16, sink=stream.append, worker_id=worker, dp_rank=worker % 2)

    def deliver() -> None:
        for event in stream:
            for payload in encode_dynamo(event):
                tree.apply_event(event.worker_id, payload)
            assert index.apply(event)
        stream.clear()

    managers = [manager(w) for w in range(3)]
    for step, (w, what) in enumerate(steps):
        if what == "use":
            seq = TokenBlockSequence(rng.choice(prompts), 16)
            blocks = [FullBlock(h) for h in seq.sequence_hashes]
            placed = managers[w].process(Use(blocks, local_hashes=seq.local_hashes))
            managers[w].process(Deref(blocks[:placed]))
        elif what == "restart":  # the restart rule: ids go on, and G1 starts empty
            last = managers[w].emitter.next_event_id - 1
            managers[w] = manager(w)
            managers[w].emitter.resume(last, clear=[Tier.G1])
        else:
            tree.remove_worker(w)
            index.remove_worker(w)
            managers[w] = manager(w)
        deliver()
        if step % 4 == 3 or step == len(steps) - 1:
            for tokens in prompts:
                local = TokenBlockSequence(tokens, 16).local_hashes
                ours = overlap_scores(index.find_matches(local), Tier.G1)
                assert tree.find_matches(local).scores == ours


# -- vLLM --------------------------------------------------------------------------------


def test_vllm_batch_decodes_and_matches_msgspec_bytes() -> None:
    KVEventBatch, BlockStored, BlockRemoved, AllBlocksCleared = vllm_classes()
    g1 = {**COMMON, "tier": Tier.G1}
    events: list[AnyEvent] = [
        Stored(
            event_id=0,
            **g1,
            parent_hash=None,
            blocks=((2**64 - 1, 1), (5, 2)),
            token_ids=((1, 2), (3, 4)),
        ),
        Stored(event_id=1, **g1, parent_hash=5, blocks=((6, 3),)),
        Offloaded(event_id=2, **COMMON, src_tier=Tier.G1, blocks=(BlockInfo(5, 2, 2**64 - 1),)),
        Removed(event_id=3, **{**COMMON, "tier": Tier.G3}, sequence_hashes=(9,)),
        Cleared(event_id=4, **g1),
    ]
    data = encode_vllm_batch(events, block_size=2)
    batch = msgspec.msgpack.decode(data, type=KVEventBatch)
    assert batch.ts == 12.5 and batch.data_parallel_rank == 1
    expected = [
        BlockStored(
            block_hashes=[2**64 - 1, 5],
            parent_block_hash=None,
            token_ids=[1, 2, 3, 4],
            block_size=2,
            lora_id=None,
            medium="GPU",
            lora_name=None,
        ),
        BlockStored(
            block_hashes=[6],
            parent_block_hash=5,
            token_ids=[],
            block_size=2,
            lora_id=None,
            medium="GPU",
            lora_name=None,
        ),
        BlockStored(
            block_hashes=[5],
            parent_block_hash=2**64 - 1,
            token_ids=[],
            block_size=2,
            lora_id=None,
            medium="CPU",
            lora_name=None,
        ),
        BlockRemoved(block_hashes=[9], medium="STORAGE"),
        # G2 still holds block 5: clearing G1 is removing what G1 held
        BlockRemoved(block_hashes=[6, 5, 2**64 - 1], medium="GPU"),
    ]
    cleared = batch.events[-1]
    assert isinstance(cleared, BlockRemoved)
    assert sorted(cleared.block_hashes) == sorted(expected[-1].block_hashes)  # in any order
    expected[-1] = cleared
    assert batch.events == expected
    assert (
        msgspec.msgpack.encode(KVEventBatch(ts=12.5, events=expected, data_parallel_rank=1)) == data
    )
    # when no other tier holds anything, clearing G1 is vLLM's AllBlocksCleared
    alone = encode_vllm_batch([events[0], Cleared(event_id=5, **g1)], block_size=2)
    assert msgspec.msgpack.decode(alone, type=KVEventBatch).events[1:] == [AllBlocksCleared()]
    # an empty batch has no rank: nil, as vLLM writes it
    plain = encode_vllm_batch([], block_size=2, ts=1.0)
    assert plain == msgspec.msgpack.encode(KVEventBatch(ts=1.0, events=[]))


def test_vllm_refuses_what_it_cannot_express() -> None:
    g2 = {**COMMON}
    with pytest.raises(ValueError, match=r"Cleared on G2 .* pass the VllmMapper"):
        encode_vllm_batch([Cleared(event_id=0, **g2)], block_size=2)
    assert encode_vllm_batch(
        [Cleared(event_id=0, **g2)], block_size=2, tiers=[Tier.G1]
    ) == msgpack.packb([12.5, [], 1])
    g4 = {**COMMON, "tier": Tier.G4}
    with pytest.raises(ValueError, match="no medium for tier G4"):
        encode_vllm_batch([Removed(event_id=0, **g4, sequence_hashes=(1,))], block_size=2)
    stored = Stored(
        event_id=0, **COMMON, parent_hash=None, blocks=((1, 1),), token_ids=((1, 2, 3),)
    )
    with pytest.raises(ValueError, match=r"blocks of \[3\] token ids, block_size is 2"):
        encode_vllm_batch([stored], block_size=2)
    other_rank = Removed(event_id=1, **{**COMMON, "dp_rank": 0}, sequence_hashes=(1,))
    with pytest.raises(ValueError, match="one dp rank"):
        encode_vllm_batch([stored, other_rank], block_size=3)
