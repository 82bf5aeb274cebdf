"""The router index's compiled fold (``registry/_index.c``) against its Python fold.

The compiled ``apply`` handles the usual Stored and Removed itself and hands everything else to
the Python methods, so the two can only differ where it decides which is which, or in what it
does itself. Two indexes take the same events, one through each, and after every event every
answer is compared: the streams mix the engine's shapes (chains growing, branching, evicted from
their ends back, several runs in one removal) with what a stream may also carry (blocks named
twice, unknown parents, links two blocks claim, copies, clears, repeats and gaps in the ids).
"""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from switches import python_with

from kvledger.events.types import AnyEvent, BlockInfo, Removed, Stored, Tier
from kvledger.registry import index as index_module
from kvledger.registry.emitter import EventEmitter
from kvledger.registry.index import PYTHON_APPLY, RouterIndex, _Node
from kvledger.registry.state import EventOrderError

COMPILED = index_module.COMPILED_APPLY
pytestmark = pytest.mark.skipif(
    COMPILED is None, reason="kvledger.registry._index is not built (no C compiler at install)"
)

TIERS = (Tier.G1, Tier.G2, Tier.G3)
SMALL = st.integers(0, 5)  # few hash values: links collide, blocks repeat, parents go missing


@st.composite
def streams(draw: st.DrawFn) -> list[AnyEvent]:
    """Well-numbered events over a block space where a block's hash follows from its parent
    and local hash (as an engine makes it), with, now and then, hashes that do not."""
    events: list[AnyEvent] = []
    emitters = [EventEmitter(events.append, worker_id=w, dp_rank=w % 2) for w in range(3)]
    seq_of: dict[tuple[int | None, int], int] = {}
    link_of: dict[int, tuple[int | None, int]] = {}

    def seq(parent: int | None, local: int) -> int:
        if (parent, local) not in seq_of:
            seq_of[(parent, local)] = 100 + len(seq_of)
            link_of[seq_of[(parent, local)]] = (parent, local)
        return seq_of[(parent, local)]

    def path(end: int) -> list[int]:
        out = [end]
        while (above := link_of[out[-1]][0]) is not None:
            out.append(above)
        return out[::-1]

    def pick() -> int | None:
        known = sorted(link_of)
        return known[draw(st.integers(0, len(known) - 1))] if known else None

    for _ in range(draw(st.integers(1, 60))):
        emit = draw(st.sampled_from(emitters))
        tier = draw(st.sampled_from(TIERS))
        kind = draw(
            st.sampled_from(
                ["grow", "grow", "grow", "again", "evict", "evict", "evict", "remove", "odd"]
            )
        )
        if kind == "grow":  # a new chain, or more of one, under the root or a known block
            parent = None if draw(st.booleans()) else pick()
            first, blocks = parent, []
            for local in draw(st.lists(st.integers(0, 2), min_size=1, max_size=6)):
                parent = seq(parent, local)
                blocks.append((parent, local))
            emit.stored(tier, first, blocks)
        elif kind == "again" and (end := pick()) is not None:  # known blocks, from a depth on
            chain = path(end)
            start = draw(st.integers(0, len(chain) - 1))
            above = link_of[chain[start]][0]
            emit.stored(tier, above, [(s, link_of[s][1]) for s in chain[start:]])
        elif kind == "evict":  # the ends of a few chains, each from its last block back
            gone: list[int] = []
            for _chain in range(draw(st.integers(1, 3))):
                end = pick()
                if end is not None:
                    chain = path(end)
                    gone += chain[draw(st.integers(0, len(chain) - 1)) :][::-1]
            if gone:
                emit.removed(tier, gone)
        elif kind == "remove":  # any blocks, in any order, twice, or never stored
            emit.removed(tier, draw(st.lists(st.integers(95, 100 + len(seq_of)), min_size=1)))
        elif kind == "odd":
            what = draw(st.sampled_from(["stored", "copied", "cleared", "empty"]))
            if what == "stored":  # hashes that break the link rule
                blocks = draw(st.lists(st.tuples(SMALL, SMALL), min_size=1, max_size=5))
                emit.stored(tier, draw(st.none() | SMALL), blocks)
            elif what == "copied":
                infos = draw(
                    st.lists(st.builds(BlockInfo, SMALL, SMALL, st.none() | SMALL), min_size=1)
                )
                emit.copied(Tier.G2 if tier == Tier.G1 else Tier.G1, tier, infos)
            elif what == "cleared":
                emit.cleared(tier)
            else:  # what an emitter never sends, but a stream may carry
                events.append(_empty_removed(emit, tier))
    return events


def _empty_removed(emit: EventEmitter, tier: Tier) -> AnyEvent:
    event = Removed(
        event_id=emit.next_event_id,
        worker_id=emit.worker_id,
        dp_rank=emit.dp_rank,
        tier=tier,
        ts=0.0,
        sequence_hashes=(),
    )
    emit.next_event_id += 1
    return event


def same_answers(python: RouterIndex, compiled: RouterIndex, queries: list[list[int]]) -> None:
    assert len(compiled) == len(python)
    assert compiled.holders() == python.holders()
    assert compiled.workers() == python.workers()
    assert compiled.last_event_id == python.last_event_id
    for hashes in queries:
        assert compiled.find_matches(hashes) == python.find_matches(hashes)
        assert compiled.find_matches(hashes, kind="sequence") == python.find_matches(
            hashes, kind="sequence"
        )
        assert compiled.tier_reach(hashes) == python.tier_reach(hashes)
        assert compiled.sequence_hashes_of(hashes) == python.sequence_hashes_of(hashes)


def prompts(index: RouterIndex) -> list[list[int]]:
    """Every chain the index can walk from the root, by sequence and by local hashes."""
    out: list[list[int]] = []
    stack: list[tuple[_Node, list[int], list[int]]] = [(index._root, [], [])]
    while stack:
        node, seqs, locals_ = stack.pop()
        seqs, locals_ = seqs + node.seqs, locals_ + node.locals
        if seqs:
            out += [seqs, locals_, seqs[:-1], [*locals_, 1]]
        stack += [(child, seqs, locals_) for child in node.children.values()]
    return out


@settings(max_examples=300, deadline=None)
@given(
    events=streams(),
    queries=st.lists(st.lists(st.integers(0, 130), max_size=8), max_size=4),
    leave=st.none() | st.tuples(st.integers(0, 59), st.integers(0, 2)),
)
def test_the_compiled_fold_answers_as_the_python_fold(
    events: list[AnyEvent], queries: list[list[int]], leave: tuple[int, int] | None
) -> None:
    """``leave``: after that event, a worker leaves (``remove_worker``: its slot is freed for
    another) and comes back with a fresh stream."""
    python, compiled = RouterIndex(), RouterIndex()
    assert COMPILED is not None
    renumbered: dict[int, int] = {}
    for i, event in enumerate(events):
        if event.worker_id in renumbered:
            event = replace(event, event_id=renumbered[event.worker_id])
            renumbered[event.worker_id] += 1
        assert COMPILED(compiled, event) == PYTHON_APPLY(python, event)
        if leave is not None and i == leave[0]:
            assert compiled.remove_worker(leave[1]) == python.remove_worker(leave[1])
            renumbered[leave[1]] = 0
        same_answers(python, compiled, queries + prompts(python) + prompts(compiled))


@settings(max_examples=100, deadline=None)
@given(events=streams(), cut=st.integers(0, 59), jump=st.integers(-3, 3))
def test_repeats_and_gaps_go_as_in_python(events: list[AnyEvent], cut: int, jump: int) -> None:
    """An event whose id is a repeat is ignored, one past a gap refused, the same way."""
    assert COMPILED is not None
    python, compiled = RouterIndex(), RouterIndex()
    for event in events[:cut]:
        COMPILED(compiled, event)
        PYTHON_APPLY(python, event)
    if cut >= len(events):
        return
    odd = replace(events[cut], event_id=events[cut].event_id + jump)
    outcomes: list[bool | str] = []
    for apply, index in ((PYTHON_APPLY, python), (COMPILED, compiled)):
        try:
            outcomes.append(apply(index, odd))
        except EventOrderError as error:
            outcomes.append(str(error))
    assert outcomes[0] == outcomes[1]
    for strict in (True, False):  # the keyword goes to the Python fold
        outcomes.clear()
        for apply, index in ((PYTHON_APPLY, python), (COMPILED, compiled)):
            try:
                outcomes.append(apply(index, odd, strict=strict))  # type: ignore[call-arg]
            except EventOrderError as error:
                outcomes.append(str(error))
        assert outcomes[0] == outcomes[1]
    same_answers(python, compiled, prompts(python))


def test_a_malformed_event_raises_as_in_python() -> None:
    """A block that is not a pair: the compiled fold leaves it to the Python one, whose error
    it is, before anything changed."""
    assert COMPILED is not None

    def stored(event_id: int, blocks: tuple[tuple[int, ...], ...]) -> Stored:
        return Stored(
            event_id=event_id,
            worker_id=0,
            dp_rank=0,
            tier=Tier.G1,
            ts=0.0,
            parent_hash=None,
            blocks=blocks,  # type: ignore[arg-type]
        )

    errors = []
    for apply in (PYTHON_APPLY, COMPILED):
        index = RouterIndex()
        apply(index, stored(0, ((9, 9),)))  # the place exists: the compiled fold takes event 1
        with pytest.raises(ValueError) as caught:
            apply(index, stored(1, ((1, 2, 3),)))
        errors.append(str(caught.value))
    assert errors[0] == errors[1]


@pytest.mark.parametrize("value, compiled", [("1", False), ("0", True), ("", True)])
def test_the_switch_turns_the_compiled_fold_off(value: str, compiled: bool) -> None:
    """``KVLEDGER_PYTHON_INDEX=1``: the class's ``apply`` is the Python fold."""
    code = (
        "from kvledger.registry import index as m; "
        "print(m.RouterIndex.apply is m.COMPILED_APPLY, m.RouterIndex.apply is m.PYTHON_APPLY)"
    )
    out = python_with("KVLEDGER_PYTHON_INDEX", value, code)
    assert out.stdout.split() == [str(compiled), str(not compiled)]


@settings(max_examples=200, deadline=None)
@given(
    requests=st.lists(st.lists(st.integers(0, 12), max_size=12), max_size=8),
    order=st.randoms(use_true_random=False),
    extra=st.lists(st.integers(0, 14), max_size=3),
)
def test_the_compiled_counts_count_as_python(
    requests: list[list[int]], order: random.Random, extra: list[int]
) -> None:
    """A router's active blocks: requests counted in, then out in another order, then keys
    counted out that are not there (a KeyError, after the same keys before it went)."""
    assert index_module.COMPILED_COUNTS is not None
    compiled_count, compiled_uncount = index_module.COMPILED_COUNTS
    python: dict[int, int] = {}
    compiled: dict[int, int] = {}
    for keys in requests:
        index_module.python_count(python, keys)
        compiled_count(compiled, keys)
        assert compiled == python
    for keys in order.sample(requests, len(requests)):
        index_module.python_uncount(python, iter(keys))
        compiled_uncount(compiled, iter(keys))
        assert compiled == python
    errors = []
    for uncount, counts in ((index_module.python_uncount, python), (compiled_uncount, compiled)):
        with pytest.raises(KeyError) as caught:
            uncount(counts, [*extra, 99])
        errors.append(caught.value.args)
    assert errors[0] == errors[1]
    assert compiled == python
