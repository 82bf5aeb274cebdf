"""The invariant the log exists for: replaying a run's log rebuilds the registry that run had,
at the end and at any committed cut, for random operation sequences on the mock G1 pool;
and a fold of the events up to any one of them is the manager's pool at that event, within
its capacity. (``test_tiered_replay.py`` checks the same across G1/G2/G3 and copies.)

Runs on a SQLite file and on PostgreSQL (the ``backend`` fixture), a fresh log per example.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from kvledger.events.log import EventLog
from kvledger.events.log.replay import replay, replay_report
from kvledger.events.types import AnyEvent
from kvledger.mocker.g1_pool import Deref, FullBlock, MockG1Pool, PartialBlock, Promote, Use
from kvledger.registry.policies import POLICY_NAMES
from kvledger.registry.state import RegistryState

PATHS = st.lists(st.integers(0, 2), min_size=1, max_size=5).map(tuple)


def seq_hash(path: tuple[int, ...]) -> int:
    h = 1469598103934665603
    for step in path:
        h = ((h ^ (step + 1)) * 1099511628211) % (1 << 64)
    return h


def local_hash(path: tuple[int, ...]) -> int:
    return (seq_hash(path) * 31 + len(path)) % (1 << 64)


class ReplayMachine(RuleBasedStateMachine):
    new_url: Callable[[], str]

    def __init__(self) -> None:
        super().__init__()
        self.log: EventLog | None = None
        self.mgr: MockG1Pool | None = None
        self.held: list[list[FullBlock]] = []
        self.partials: list[tuple[int, tuple[int, ...]]] = []  # (uuid, path of the full prefix)
        self.cuts: list[tuple[int, RegistryState]] = []
        self.uuids = itertools.count()
        self.fold = RegistryState()

    def sink(self, event: AnyEvent) -> None:
        """Fold each event as it is emitted: the fold must be the pool right then."""
        assert self.mgr is not None and self.log is not None
        self.fold.apply(event)
        held = sum(self.fold.counts().values())
        assert held <= self.mgr.max_capacity, f"event {event.event_id}: {held} blocks in the log"
        assert self.fold == self.mgr.registry_state(), f"event {event.event_id}"
        self.log.append(event)

    @rule(
        capacity=st.integers(2, 10),
        eviction=st.sampled_from(POLICY_NAMES),
        batch_size=st.sampled_from([1, 3, 100]),
    )
    @precondition(lambda self: self.mgr is None)
    def start(self, capacity: int, eviction: str, batch_size: int) -> None:
        self.log = EventLog(self.new_url(), batch_size=batch_size, queue_size=max(batch_size, 8))
        self.mgr = MockG1Pool(capacity, 4, eviction=eviction, sink=self.sink, worker_id=3)

    @rule(path=PATHS, with_partial=st.booleans())
    @precondition(lambda self: self.mgr is not None)
    def use(self, path: tuple[int, ...], with_partial: bool) -> None:
        assert self.mgr is not None
        blocks: list[FullBlock | PartialBlock] = [
            FullBlock(seq_hash(path[: i + 1])) for i in range(len(path))
        ]
        uuid = next(self.uuids)
        if with_partial:
            blocks.append(PartialBlock(uuid))
        placed = self.mgr.process(
            Use(blocks, local_hashes=tuple(local_hash(path[: i + 1]) for i in range(len(path))))
        )
        full = [b for b in blocks[:placed] if isinstance(b, FullBlock)]
        if full:
            self.held.append(full)
        if with_partial and placed == len(blocks):
            self.partials.append((uuid, path))

    @rule(data=st.data())
    @precondition(lambda self: self.held)
    def finish(self, data: st.DataObject) -> None:
        assert self.mgr is not None
        blocks = self.held.pop(data.draw(st.integers(0, len(self.held) - 1)))
        self.mgr.process(Deref(blocks))

    @rule(data=st.data(), step=st.integers(0, 2))
    @precondition(lambda self: self.partials)
    def promote(self, data: st.DataObject, step: int) -> None:
        assert self.mgr is not None
        uuid, path = self.partials.pop(data.draw(st.integers(0, len(self.partials) - 1)))
        child = (*path, step)
        self.mgr.process(Promote(uuid, seq_hash(child), seq_hash(path), local_hash(child)))
        self.held.append([FullBlock(seq_hash(child))])

    @rule()
    @precondition(lambda self: self.mgr is not None)
    def cut(self) -> None:
        """Remember the state at this committed point, to replay up to it later."""
        assert self.mgr is not None and self.log is not None
        self.log.flush()
        self.cuts.append((self.mgr.emitter.next_event_id - 1, self.mgr.registry_state()))

    @invariant()
    def replay_matches_now(self) -> None:
        if self.mgr is None or self.log is None or len(self.cuts) % 3:
            return
        self.log.flush()
        assert replay(self.log, checkpoint_every=5) == self.mgr.registry_state()

    def teardown(self) -> None:
        if self.log is None or self.mgr is None:
            return
        try:
            self.log.flush()
            live = self.mgr.registry_state()
            full = replay_report(self.log, use_checkpoints=False, checkpoint_every=None)
            assert full.state == live, full.state.diff(live)
            assert full.state.last_event_id.get(3, -1) == self.mgr.emitter.next_event_id - 1
            assert replay(self.log) == live  # from whatever checkpoints the run left
            for last_id, state in self.cuts:
                assert replay(self.log, until_event_id=last_id) == state
        finally:
            self.log.close()


@pytest.mark.slow
def test_replay_equals_live_state(new_log_url: Callable[[], str]) -> None:
    machine = type("Machine", (ReplayMachine,), {"new_url": staticmethod(new_log_url)})
    run_state_machine_as_test(
        machine,
        settings=settings(max_examples=30, stateful_step_count=40, deadline=None),
    )
