"""The block pool against a tiny reference model, driven by hypothesis.

Requests walk paths in a small tree of blocks (so prefixes are shared and lineage matters),
take the cached prefix, allocate and register the rest, and finish in any order. The model
knows which hashes each request holds; the pool's own events tell it what was evicted, and
each eviction is checked against the model at the moment it happened.
"""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvledger.events.types import AnyEvent, Cleared, Removed, Stored, Tier
from kvledger.registry.emitter import EventEmitter
from kvledger.registry.policies import POLICY_NAMES
from kvledger.registry.pool import BlockPool, PoolBusy, PoolExhausted
from kvledger.registry.state import RegistryState

PATHS = st.lists(st.integers(0, 2), min_size=1, max_size=6).map(tuple)


def seq_hash(path: tuple[int, ...]) -> int:
    """A stable, distinct 64-bit name per path."""
    h = 1469598103934665603
    for step in path:
        h = ((h ^ (step + 1)) * 1099511628211) % (1 << 64)
    return h


class PoolMachine(RuleBasedStateMachine):
    @initialize(capacity=st.integers(1, 12), policy=st.sampled_from(POLICY_NAMES))
    def setup(self, capacity: int, policy: str) -> None:
        self.capacity = capacity
        self.policy = policy
        self.events: list[AnyEvent] = []
        self.pool = BlockPool(
            capacity, tier=Tier.G1, policy=policy, emitter=EventEmitter(self.checked_sink)
        )
        self.requests: list[list[tuple[int, int]]] = []  # held (slot, seq hash) per request
        self.model_refs: dict[int, int] = {}  # resident seq hash -> references held
        self.parent_of: dict[int, int | None] = {}
        self.removing = False  # an explicit remove() is not a policy eviction

    def checked_sink(self, event: AnyEvent) -> None:
        """Check every eviction as it happens, against what the model says is held."""
        if isinstance(event, Removed):
            for h in event.sequence_hashes:
                assert self.model_refs.get(h, 0) == 0, "evicted a block in use"
                if self.policy == "lineage" and not self.removing:
                    live_children = [
                        c for c, p in self.parent_of.items() if p == h and c in self.model_refs
                    ]
                    assert not live_children, f"lineage evicted {h} with children {live_children}"
                self.model_refs.pop(h, None)
        elif isinstance(event, Stored):
            for info in event.infos():
                assert info.sequence_hash not in self.model_refs, "stored a block twice"
                self.model_refs[info.sequence_hash] = 0
        elif isinstance(event, Cleared):
            assert all(v == 0 for v in self.model_refs.values())
            self.model_refs.clear()
        self.events.append(event)

    @rule(path=PATHS)
    def request(self, path: tuple[int, ...]) -> None:
        hashes = [seq_hash(path[: i + 1]) for i in range(len(path))]
        for i, h in enumerate(hashes):
            self.parent_of[h] = hashes[i - 1] if i else None
        hit = self.pool.match(hashes)
        expected = 0
        for h in hashes:
            if h not in self.model_refs:
                break
            expected += 1
        assert len(hit) == expected, "match must return exactly the cached prefix"
        for slot, h in zip(hit, hashes, strict=False):
            assert self.pool.block_info(slot).sequence_hash == h
            self.model_refs[h] += 1
        held = list(zip(hit, hashes, strict=False))
        rest = hashes[len(hit) :]
        try:
            fresh = self.pool.allocate(len(rest))
        except PoolExhausted:
            # nothing handed out; give the prefix back
            self.release(held)
            return
        parent = hashes[len(hit) - 1] if hit else None
        slots = self.pool.register(fresh, [(h, h & 0xFFFF) for h in rest], parent)
        for slot, h in zip(slots, rest, strict=True):
            self.model_refs[h] += 1
            held.append((slot, h))
        self.requests.append(held)

    def release(self, held: list[tuple[int, int]]) -> None:
        self.pool.release([slot for slot, _ in reversed(held)])
        for _, h in held:
            self.model_refs[h] -= 1
            assert self.model_refs[h] >= 0

    @precondition(lambda self: self.requests)
    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        i = data.draw(st.integers(0, len(self.requests) - 1))
        self.release(self.requests.pop(i))

    @rule()
    def clear(self) -> None:
        if self.requests:
            try:
                self.pool.clear()
            except PoolBusy:
                return
            raise AssertionError("clear succeeded with blocks in use")
        self.pool.clear()
        assert self.pool.num_free == self.capacity

    @rule(path=PATHS)
    def miss(self, path: tuple[int, ...]) -> None:
        """An engine reports a miss (ARC learns from ghosts); the pool holds what it held."""
        before = self.pool.resident_blocks()
        self.pool.missed([seq_hash(path)])
        assert self.pool.resident_blocks() == before

    @rule(path=PATHS)
    def remove(self, path: tuple[int, ...]) -> None:
        h = seq_hash(path)
        before = self.model_refs.get(h)
        self.removing = True
        try:
            gone = self.pool.remove([h])
        finally:
            self.removing = False
        if before == 0:
            assert gone == [h]
        else:
            assert gone == []

    @invariant()
    def counts_add_up(self) -> None:
        pool = self.pool
        assert pool.num_free + pool.num_inactive + pool.num_active == self.capacity
        held = sum(len(r) for r in self.requests)
        assert pool.num_active <= held
        assert pool.num_registered == len(self.model_refs)
        assert all(pool.refcount(s) >= 0 for s in range(self.capacity))

    @invariant()
    def pool_agrees_with_model_and_replay(self) -> None:
        resident = self.pool.resident_blocks()
        assert set(resident) == set(self.model_refs)
        for h, refs in self.model_refs.items():
            assert self.pool.refcount(self.pool.lookup(h)) == refs  # type: ignore[arg-type]
        replayed = RegistryState.from_events(self.events)
        live = RegistryState.from_mapping({(0, Tier.G1): resident})
        assert replayed == live, replayed.diff(live)


PoolMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestPoolMachine = PoolMachine.TestCase
