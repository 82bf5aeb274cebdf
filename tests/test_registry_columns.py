"""The registry's array form: folding batches of block operations into sorted columns gives
what folding the same events one by one into dicts gives, whatever the batching and whichever
form each tier is held in at the time."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvledger.events.types import (
    AnyEvent,
    BlockInfo,
    Cleared,
    Offloaded,
    Removed,
    Stored,
    Tier,
)
from kvledger.registry.columns import BlockColumns, BlockOps, fold, ops_from_events
from kvledger.registry.state import RegistryState

# few hashes, so that stores, removals and copies keep hitting the same blocks
HASHES = st.sampled_from([0, 1, 2, 3, 5, 8, 2**63, 2**64 - 1])
TIERS = st.sampled_from([Tier.G1, Tier.G2])


class ColumnsAgreeWithDicts(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.reference = RegistryState()  # event by event, dicts only
        self.state = RegistryState()  # batches into columns, now and then an event into dicts
        self.batch: list[AnyEvent] = []
        self.next_id = {0: 0, 1: 0}

    def _event(self, cls: type, worker: int, tier: Tier, **fields: object) -> None:
        event = cls(
            event_id=self.next_id[worker], worker_id=worker, dp_rank=0, tier=tier, ts=0.0, **fields
        )
        self.next_id[worker] += 1
        self.reference.apply(event)
        self.batch.append(event)

    @rule(
        worker=st.sampled_from([0, 1]),
        tier=TIERS,
        parent=st.none() | HASHES,
        blocks=st.lists(st.tuples(HASHES, HASHES), min_size=1, max_size=4),
    )
    def stored(
        self, worker: int, tier: Tier, parent: int | None, blocks: list[tuple[int, int]]
    ) -> None:
        self._event(Stored, worker, tier, parent_hash=parent, blocks=tuple(blocks))

    @rule(worker=st.sampled_from([0, 1]), tier=TIERS, hashes=st.lists(HASHES, min_size=1))
    def removed(self, worker: int, tier: Tier, hashes: list[int]) -> None:
        self._event(Removed, worker, tier, sequence_hashes=tuple(hashes))

    @rule(
        worker=st.sampled_from([0, 1]),
        infos=st.lists(st.builds(BlockInfo, HASHES, HASHES, st.none() | HASHES), min_size=1),
    )
    def offloaded(self, worker: int, infos: list[BlockInfo]) -> None:
        self._event(Offloaded, worker, Tier.G2, src_tier=Tier.G1, blocks=tuple(infos))

    @rule(worker=st.sampled_from([0, 1]), tier=TIERS)
    def cleared(self, worker: int, tier: Tier) -> None:
        self._event(Cleared, worker, tier)

    @precondition(lambda self: self.batch)
    @rule()
    def fold_batch(self) -> None:
        for key, ops in ops_from_events(self.batch).items():
            self.state.fold_ops(key, ops)
        for event in self.batch:
            self.state.last_event_id[event.worker_id] = event.event_id
        self.batch.clear()

    @precondition(lambda self: self.batch)
    @rule()
    def apply_one_by_one(self) -> None:
        """Through the dict path, which turns every tier held as arrays into dicts first."""
        for event in self.batch:
            assert self.state.apply(event)
        self.batch.clear()

    @invariant()
    def same_counts_and_digest(self) -> None:
        if not self.batch:
            assert self.state.counts() == self.reference.counts()
            assert self.state.digest() == self.reference.digest()

    def teardown(self) -> None:
        if self.batch:
            self.fold_batch()
        assert self.state == self.reference
        assert self.state.last_event_id == self.reference.last_event_id


TestColumnsAgreeWithDicts = ColumnsAgreeWithDicts.TestCase
TestColumnsAgreeWithDicts.settings = settings(max_examples=150, stateful_step_count=30)


@given(st.dictionaries(HASHES, st.tuples(HASHES, st.none() | HASHES)))
def test_columns_round_trip_through_dicts(blocks: dict[int, tuple[int, int | None]]) -> None:
    columns = BlockColumns.from_dict(blocks)
    assert columns.to_dict() == blocks
    assert list(columns.seq) == sorted(blocks)


def test_fold_keeps_the_last_operation_and_the_order() -> None:
    base = BlockColumns.from_dict({1: (10, None), 5: (50, 1), 9: (90, 5)})
    u64 = np.array
    ops = BlockOps(
        seq=u64([5, 7, 7, 3, 9], np.uint64),
        local=u64([55, 70, 0, 30, 0], np.uint64),
        parent=u64([1, 0, 0, 1, 0], np.uint64),
        has_parent=np.array([True, False, False, True, False]),
        store=np.array([True, True, False, True, False]),
    )
    assert fold(base, ops).to_dict() == {1: (10, None), 3: (30, 1), 5: (55, 1)}
    cleared = BlockOps(ops.seq[:1], ops.local[:1], ops.parent[:1], ops.has_parent[:1],
                       ops.store[:1], cleared=True)  # fmt: skip
    assert fold(base, cleared).to_dict() == {5: (55, 1)}


def test_a_hash_that_is_not_a_u64_is_refused() -> None:
    with pytest.raises(OverflowError):
        BlockColumns.from_dict({-1: (0, None)})
