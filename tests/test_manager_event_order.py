"""A real ``BlockManager`` (real bytes, copies on the copy thread, a real SQLite log): every event
it emits, folded as it is emitted, gives the manager's tiers at that moment, within their
capacities; and a restart with fewer tiers replays to the restarted manager, not to the tiers
the earlier run had.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from kvledger import BlockManager
from kvledger.config import Settings
from kvledger.events.replay import replay
from kvledger.events.types import AnyEvent, Cleared
from kvledger.registry.policies import POLICY_NAMES
from kvledger.registry.state import RegistryState

BLOCK = 4


def settings(tmp_path: Path, **kw: object) -> Settings:
    base: dict[str, object] = dict(
        block_size=BLOCK,
        num_layers=2,
        outer_dim=2,
        inner_dim=8,
        dtype="float32",
        g1_blocks=6,
        g2_blocks=8,
        g3_blocks=12,
        offload_filter="always",
        data_dir=tmp_path / "data",
        event_log_url=f"sqlite:///{tmp_path / 'events.db'}",
    )
    base.update(kw)
    return Settings.load(**base)


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
