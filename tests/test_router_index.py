"""The router index: prefix depths per worker and tier, folded from events."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from event_streams import prompt_pool, worker_events
from hypothesis import given, settings
from hypothesis import strategies as st

from kvledger.events.types import AnyEvent, BlockInfo, Tier
from kvledger.registry.emitter import EventEmitter
from kvledger.registry.hashing import TokenBlockSequence
from kvledger.registry.index import RouterIndex, holders_from_state, prefix_depths
from kvledger.registry.state import EventOrderError, RegistryState


def _chain(tokens: list[int]) -> TokenBlockSequence:
    return TokenBlockSequence(tokens, 4)


def test_depths_per_tier_stop_at_holes() -> None:
    seq = _chain(list(range(16)))  # 4 blocks
    s, loc = seq.sequence_hashes, seq.local_hashes
    events: list[AnyEvent] = []
    emit = EventEmitter(events.append, worker_id=1, dp_rank=0)
    emit.stored(Tier.G1, None, list(zip(s, loc, strict=True)))
    emit.copied(Tier.G1, Tier.G2, [BlockInfo(s[0], loc[0], None), BlockInfo(s[1], loc[1], s[0])])
    emit.removed(Tier.G1, [s[2]])  # a hole: block 3 is still there but unusable
    index = RouterIndex.from_events(events)
    assert index.find_matches(loc) == {(1, 0): {Tier.G1: 2, Tier.G2: 2}}
    assert index.find_matches(s, kind="sequence") == {(1, 0): {Tier.G1: 2, Tier.G2: 2}}
    # a prompt that diverges after the first block matches only that block
    other = _chain(list(range(4)) + [99] * 12)
    assert index.find_matches(other.local_hashes) == {(1, 0): {Tier.G1: 1, Tier.G2: 1}}
    with pytest.raises(ValueError, match="kind must be"):
        index.find_matches(loc, kind="tokens")  # type: ignore[arg-type]


def test_cleared_and_worker_removal() -> None:
    seq = _chain(list(range(8)))
    blocks = list(zip(seq.sequence_hashes, seq.local_hashes, strict=True))
    events: list[AnyEvent] = []
    a = EventEmitter(events.append, worker_id=1)
    b = EventEmitter(events.append, worker_id=2, dp_rank=1)
    a.stored(Tier.G1, None, blocks)
    b.stored(Tier.G1, None, blocks[:1])
    index = RouterIndex.from_events(events)
    assert index.find_matches(seq.local_hashes) == {(1, 0): {Tier.G1: 2}, (2, 1): {Tier.G1: 1}}
    a.cleared(Tier.G1)
    index.apply(events[-1])
    assert index.find_matches(seq.local_hashes) == {(2, 1): {Tier.G1: 1}}
    assert index.remove_worker(2) == 1
    assert index.find_matches(seq.local_hashes) == {}
    assert len(index) == 0 and index.workers() == set()


def test_repeats_are_ignored_and_gaps_refused() -> None:
    events = worker_events(1, worker_id=3, ops=30, prompts=prompt_pool(1))
    index = RouterIndex.from_events(events)
    before = index.holders()
    assert not any(index.apply(e) for e in events)  # all repeats
    assert index.holders() == before
    fresh = RouterIndex()
    fresh.apply(events[0])
    with pytest.raises(EventOrderError, match=r"events 1\.\.1 are missing"):
        fresh.apply(events[2])
    assert fresh.apply(events[2], strict=False)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), ops=st.integers(1, 80), workers=st.integers(1, 3))
def test_index_agrees_with_registry_fold(seed: int, ops: int, workers: int) -> None:
    """Whatever the stream, the index holds exactly what the registry fold holds, and every
    depth it reports is backed by the fold."""
    prompts = prompt_pool(seed)
    streams = [worker_events(seed, w, ops, prompts) for w in range(workers)]
    merged = [e for group in zip(*streams, strict=False) for e in group]
    merged += [e for s in streams for e in s[min(map(len, streams)) :]]
    state = RegistryState.from_events(merged)
    index = RouterIndex.from_events(merged)
    assert index.holders() == holders_from_state(state)
    snap = state.snapshot()
    for tokens in prompts[:6]:
        seq = _chain(tokens)
        for (worker, _dp), per_tier in index.find_matches(seq.local_hashes).items():
            for tier, depth in per_tier.items():
                held = snap.get((worker, tier), {})
                assert all(h in held for h in seq.sequence_hashes[:depth])
                assert depth == len(seq.sequence_hashes) or seq.sequence_hashes[depth] not in held


def test_prefix_depths_is_lazy() -> None:
    consumed: list[dict[int, int]] = []

    def masks() -> Iterator[dict[int, int]]:
        for m in ({1: 0b11}, {1: 0b01}, {}, {1: 1}):
            consumed.append(m)
            yield m

    assert prefix_depths(masks()) == {1: {Tier.G1: 2, Tier.G2: 1}}
    assert len(consumed) == 3  # stopped at the first block nobody held
