"""A real ``BlockManager`` (real bytes, copies on the copy thread, a real SQLite log): every event
it emits, folded as it is emitted, gives the manager's tiers at that moment, within their
capacities; and a restart with fewer tiers replays to the restarted manager, not to the tiers
the earlier run had.
"""

from __future__ import annotations

import random
import threading
from pathlib import Path

import pytest
from services import manager_settings

from kvledger import BlockManager, PoolExhausted
from kvledger.config import Settings
from kvledger.events.log.replay import replay
from kvledger.events.types import AnyEvent, Cleared
from kvledger.registry.policies import POLICY_NAMES
from kvledger.registry.state import RegistryState

BLOCK = 4


def settings(tmp_path: Path, **kw: object) -> Settings:
    base: dict[str, object] = dict(g1_blocks=6, g2_blocks=8, g3_blocks=12, offload_filter="always")
    return manager_settings(tmp_path, **(base | kw))


def live_state(manager: BlockManager) -> RegistryState:
    return manager.state()


class FoldChecker:
    """An observer that folds each event and compares the fold with the manager right then
    (observers run under the manager's lock, so its tiers cannot move meanwhile)."""

    def __init__(self) -> None:
        self.fold = RegistryState()
        self.manager: BlockManager | None = None
        self.checked = 0

    def __call__(self, event: AnyEvent) -> None:
        self.fold.apply(event)
        m = self.manager
        if m is None or isinstance(event, Cleared):  # a restart clears tier by tier
            return
        capacity = m.capacities()
        for (_, tier), n in self.fold.counts().items():
            assert n <= capacity.get(tier, 0), f"event {event.event_id}: {n} on {tier.name}"
        live = live_state(m)
        assert self.fold == live, f"event {event.event_id}: " + "; ".join(self.fold.diff(live))
        self.checked += 1


@pytest.mark.parametrize("policy", POLICY_NAMES)
def test_each_event_folds_to_the_managers_tiers_at_that_event(tmp_path: Path, policy: str) -> None:
    checker = FoldChecker()
    m = BlockManager(settings(tmp_path, eviction_policy=policy), observers=[checker])
    checker.manager = m
    rng = random.Random(policy)
    prefixes = [[100 * p + t for t in range(2 * BLOCK)] for p in range(3)]
    try:
        for i in range(40):
            tokens = rng.choice(prefixes) + [1000 + i % 5] * (BLOCK * rng.randint(0, 2))
            seq = m.sequence(tokens)
            held = m.onboard(seq)
            fresh = m.allocate(len(seq) - len(held))
            held += m.register(fresh, seq, start=len(seq) - len(fresh))
            m.release(held)
            assert m.wait_idle(10)
    finally:
        m.close()
    assert checker.checked > 50
    assert replay(m.settings.log_url) == live_state(m)

    # the worker comes back without G2 and G3: their blocks must leave the log's state too
    again = FoldChecker()
    again.fold = checker.fold
    m2 = BlockManager(
        settings(tmp_path, eviction_policy=policy, g2_blocks=0, g3_blocks=0), observers=[again]
    )
    again.manager = m2
    try:
        seq = m2.sequence(prefixes[0])
        held = m2.allocate(len(seq))
        m2.release(m2.register(held, seq, start=0))
    finally:
        m2.close()
    replayed = replay(m2.settings.log_url)
    assert replayed == live_state(m2), replayed.diff(live_state(m2))


def test_a_blocking_sink_does_not_hold_up_the_bookkeeping(tmp_path: Path) -> None:
    """A sink that blocks (the log under back-pressure) runs outside the manager's lock:
    another thread's lookup completes while the sink waits."""
    m = BlockManager(settings(tmp_path, g2_blocks=0, g3_blocks=0), log_events=False)
    seq = m.sequence(list(range(2 * BLOCK)))
    seen: list[object] = []

    def sink(event: AnyEvent) -> None:
        if seen:
            return
        other = threading.Thread(target=lambda: seen.append(m.match(seq)))
        other.start()
        other.join(2)
        seen.append(not other.is_alive())
        other.join()

    m.add_sink(sink)
    try:
        m.release(m.register(m.allocate(len(seq)), seq, start=0))
    finally:
        m.close()
    assert seen[-1] is True, "the sink ran while the manager's lock was held"
    assert seen[0] == (2, 0, 0)


def test_events_from_many_threads_reach_the_sinks_in_emission_order(tmp_path: Path) -> None:
    ids: list[int] = []
    m = BlockManager(settings(tmp_path), sinks=[lambda e: ids.append(e.event_id)])
    prefixes = [[100 * p + t for t in range(2 * BLOCK)] for p in range(3)]

    def work(seed: int) -> None:
        rng = random.Random(seed)
        for i in range(25):
            seq = m.sequence(rng.choice(prefixes) + [1000 + seed * 100 + i] * BLOCK)
            try:
                held = m.onboard(seq)
                fresh = m.allocate(len(seq) - len(held), timeout=5)
            except PoolExhausted:
                m.release(held)
                continue
            held += m.register(fresh, seq, start=len(seq) - len(fresh))
            m.release(held)

    threads = [threading.Thread(target=work, args=(n,)) for n in range(4)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert m.wait_idle(10)
    finally:
        m.close()
    assert ids == list(range(len(ids))) and len(ids) > 100
    assert replay(m.settings.log_url) == live_state(m)
