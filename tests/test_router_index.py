"""The router index: prefix depths per worker and tier, folded from events."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from event_streams import prompt_pool, worker_events
from hypothesis import given, settings
from hypothesis import strategies as st

from kvledger.events.types import (
    AnyEvent,
    BlockInfo,
    Cleared,
    Offloaded,
    Onboarded,
    Removed,
    Stored,
    Tier,
)
from kvledger.registry.emitter import EventEmitter
from kvledger.registry.hashing import TokenBlockSequence
from kvledger.registry.index import (
    Depths,
    RouterIndex,
    WorkerKey,
    holders_from_state,
    prefix_depths,
    tier_bit,
)
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


def test_a_block_named_twice_is_removed_once() -> None:
    events: list[AnyEvent] = []
    emit = EventEmitter(events.append, worker_id=1)
    emit.stored(Tier.G1, None, [(10, 1), (11, 2)])
    emit.removed(Tier.G1, [11, 11, 99])  # 99 was never stored
    index = RouterIndex.from_events(events)
    assert index.holders() == {10: {1: 1}}
    assert index.find_matches([1, 2]) == {(1, 0): {Tier.G1: 1}}


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


class PlainIndex:
    """The router index written as plainly as possible, to check the fast one against: a set
    of held sequence hashes per (worker, dp rank, tier), and depths found by testing each
    prompt block against every set."""

    def __init__(self) -> None:
        self.held: dict[tuple[WorkerKey, Tier], set[int]] = {}

    def apply(self, event: AnyEvent) -> None:
        blocks = self.held.setdefault(((event.worker_id, event.dp_rank), event.tier), set())
        if isinstance(event, Stored):
            blocks.update(seq for seq, _local in event.blocks)
        elif isinstance(event, Offloaded | Onboarded):
            blocks.update(info.sequence_hash for info in event.blocks)
        elif isinstance(event, Removed):
            blocks.difference_update(event.sequence_hashes)
        elif isinstance(event, Cleared):
            blocks.clear()

    def remove_worker(self, worker_id: int) -> int:
        gone = [k for k in self.held if k[0][0] == worker_id]
        return sum(len(self.held.pop(k)) for k in gone)

    def depths(self, sequence_hashes: list[int]) -> Depths:
        out: Depths = {}
        for (key, tier), blocks in self.held.items():
            depth = 0
            while depth < len(sequence_hashes) and sequence_hashes[depth] in blocks:
                depth += 1
            if depth:
                out.setdefault(key, {})[tier] = depth
        return out

    def holders(self) -> dict[int, dict[int, int]]:
        out: dict[int, dict[int, int]] = {}
        for ((worker, _dp), tier), blocks in self.held.items():
            for seq in blocks:
                per_worker = out.setdefault(seq, {})
                per_worker[worker] = per_worker.get(worker, 0) | tier_bit(tier)
        return out

    def workers(self) -> set[WorkerKey]:
        return {key for (key, _tier), blocks in self.held.items() if blocks}


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    ops=st.integers(1, 80),
    workers=st.integers(1, 4),
    departures=st.lists(st.tuples(st.integers(0, 400), st.integers(0, 3)), max_size=4),
)
def test_index_answers_as_the_plain_model_does(
    seed: int, ops: int, workers: int, departures: list[tuple[int, int]]
) -> None:
    """At every point of interleaved streams, with workers leaving and coming back (a freed
    slot taken over), the index's depths for every prompt, by local or sequence hashes, its
    holders and its workers are exactly those of the plain model."""
    prompts = prompt_pool(seed)
    streams = [worker_events(seed, w, ops, prompts) for w in range(workers)]
    merged = [e for group in zip(*streams, strict=False) for e in group]
    merged += [e for s in streams for e in s[min(map(len, streams)) :]]
    leaving: dict[int, list[int]] = {}
    for position, worker in departures:
        leaving.setdefault(position % (len(merged) + 1), []).append(worker)
    index, plain = RouterIndex(), PlainIndex()
    chains = [_chain(tokens) for tokens in prompts]

    def check() -> None:
        assert index.holders() == plain.holders()
        assert len(index) == len(plain.holders())
        assert index.workers() == plain.workers()
        for seq in chains:
            expected = plain.depths(seq.sequence_hashes)
            assert index.find_matches(seq.local_hashes) == expected
            assert index.find_matches(seq.sequence_hashes, kind="sequence") == expected

    for position, event in enumerate([*merged, None]):
        for worker in leaving.get(position, ()):
            assert index.remove_worker(worker) == plain.remove_worker(worker)
            check()
        if event is None:
            break
        # a worker that left comes back mid-stream: its later ids follow a gap
        index.apply(event, strict=False)
        plain.apply(event)
        if position % 7 == 0:
            check()
    check()


SMALL = st.integers(0, 4)  # few hash values: links collide, blocks repeat, parents go missing


@st.composite
def any_events(draw: st.DrawFn) -> list[AnyEvent]:
    """Well-numbered events with arbitrary contents: repeated and unknown blocks, a link
    claimed by two blocks, a block stored under two different links."""
    events: list[AnyEvent] = []
    emitters = [EventEmitter(events.append, worker_id=w, dp_rank=w % 2) for w in range(2)]
    for _ in range(draw(st.integers(1, 40))):
        emit = draw(st.sampled_from(emitters))
        tier = draw(st.sampled_from([Tier.G1, Tier.G2]))
        kind = draw(st.sampled_from(["stored", "stored", "copied", "removed", "cleared"]))
        if kind == "stored":
            blocks = draw(st.lists(st.tuples(SMALL, SMALL), min_size=1, max_size=5))
            emit.stored(tier, draw(st.none() | SMALL), blocks)
        elif kind == "copied":
            infos = draw(
                st.lists(st.builds(BlockInfo, SMALL, SMALL, st.none() | SMALL), min_size=1)
            )
            emit.copied(Tier.G2 if tier == Tier.G1 else Tier.G1, tier, infos)
        elif kind == "removed":
            emit.removed(tier, draw(st.lists(SMALL, min_size=1, max_size=6)))
        else:
            emit.cleared(tier)
    return events


@settings(max_examples=150, deadline=None)
@given(events=any_events(), queries=st.lists(st.lists(SMALL, max_size=6), min_size=1, max_size=6))
def test_any_stream_answers_as_the_plain_model_and_the_link_walk(
    events: list[AnyEvent], queries: list[list[int]]
) -> None:
    """On any stream, however inconsistent its hashes, a sequence-hash query gives the plain
    model's depths, and a local-hash query gives what the sequence hashes found by walking the
    links one block at a time give."""
    index, plain = RouterIndex(), PlainIndex()
    for event in events:
        assert index.apply(event)
        plain.apply(event)
        assert index.holders() == plain.holders()
        for hashes in queries:
            assert index.find_matches(hashes, kind="sequence") == plain.depths(hashes)
            walked = index.sequence_hashes_of(hashes)
            assert index.find_matches(hashes) == plain.depths(walked)
    assert index.workers() == plain.workers()
