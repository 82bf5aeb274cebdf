"""Log order equals state order: a fold of the events up to ANY one of them is the registry as it
was at that event, across G1/G2/G3, every eviction policy and offload filter, copies that finish
whole, in part or not at all, and restarts.

Every event a ``TieredPools`` emits is sent through the record codec and folded into a
``RegistryState`` the moment it is emitted. Right then the fold must equal the registry's live
blocks, and no tier of the fold may hold more blocks than the tier has slots: so a replay that
stops at any committed event rebuilds what the worker held at that event.

The machine drives the registry the ways its callers do (``kvledger.BlockManager`` and the
simulator): a request takes its cached G1 prefix, onboards the part cached on G2/G3, computes
and registers the rest and writes it through; copies between tiers finish later, in any order,
whole, with only a prefix arrived (the rest failed; a corrupt G3 source is dropped) or not at
all; requests finish in any order; an idle tier is cleared; the worker restarts with other
sizes, policy and filter, continuing its event ids from the log.
"""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from kvledger.events.codec import decode, encode
from kvledger.events.types import AnyEvent, Tier
from kvledger.mocker.cache import Admission, SimulatedCache
from kvledger.registry.emitter import EventEmitter
from kvledger.registry.errors import PoolBusy
from kvledger.registry.policies import POLICY_NAMES
from kvledger.registry.state import RegistryState
from kvledger.registry.tiered import OFFLOAD_FILTERS, CopyPlan, TieredPools

WORKER = 7
PATHS = st.lists(st.integers(0, 1), min_size=1, max_size=4).map(tuple)
SIZES = st.tuples(st.integers(2, 6), st.sampled_from([8, 3, 0]), st.sampled_from([10, 4, 0]))
#: for a rule that starts over (a clear): taken one time in eight, so runs grow
RARELY = st.integers(0, 7).map(lambda n: n == 3)
#: how a copy ends: whole, a prefix of it (cut mod its length; the rest failed), or failed
OUTCOMES = st.tuples(
    st.sampled_from(["whole", "whole", "whole", "partial", "failed"]),
    st.integers(0, 7),
)


def seq_hash(path: tuple[int, ...]) -> int:
    """A stable, distinct 64-bit name per path in a small tree, so prompts share prefixes."""
    h = 1469598103934665603
    for step in path:
        h = ((h ^ (step + 1)) * 1099511628211) % (1 << 64)
    return h


def local_hash(seq: int) -> int:
    return (seq * 31 + 7) % (1 << 64)


class TieredReplayMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.fold = RegistryState()
        self.restarting = False
        self.since_restart = 0  # events
        self.pending: list[CopyPlan] = []  # copies started and not yet finished
        self.requests: list[list[int]] = []  # G1 slots each running request holds
        self.admissions: list[tuple[Admission, list[int]]] = []  # simulator requests, hashes

    # -- the check, at every event -------------------------------------------------------

    def sink(self, event: AnyEvent) -> None:
        decoded = decode(encode(event))
        assert decoded == event
        assert self.fold.apply(decoded), f"event {event.event_id} repeats an id"
        self.since_restart += 1
        if not self.restarting:
            self.check_fold(f"after event {event.event_id} ({type(event).__name__})")

    def check_fold(self, when: str) -> None:
        capacity = self.reg.capacities()
        for (_, tier), count in self.fold.counts().items():
            assert count <= capacity.get(tier, 0), (
                f"{when}: the log holds {count} blocks on {tier.name}, "
                f"which has {capacity.get(tier, 0)} slots"
            )
        live = self.reg.state()
        assert self.fold == live, f"{when}: " + "; ".join(self.fold.diff(live))

    # -- starting and restarting ---------------------------------------------------------

    def build(self, sizes: tuple[int, int, int], policy: str, offload_filter: str) -> None:
        # ids go on from what the log holds, as a restarted worker's do
        first = self.fold.last_event_id.get(WORKER, -1) + 1
        self.emitter = EventEmitter(self.sink, worker_id=WORKER, first_event_id=first)
        self.reg = TieredPools(
            *sizes, policy=policy, offload_filter=offload_filter, emitter=self.emitter
        )

    @initialize(
        sizes=SIZES,
        policy=st.sampled_from(POLICY_NAMES),
        offload_filter=st.sampled_from(OFFLOAD_FILTERS),
    )
    def start(self, sizes: tuple[int, int, int], policy: str, offload_filter: str) -> None:
        self.build(sizes, policy, offload_filter)

    @rule(
        sizes=SIZES,
        policy=st.sampled_from(POLICY_NAMES),
        offload_filter=st.sampled_from(OFFLOAD_FILTERS),
    )
    @precondition(lambda self: self.since_restart >= 12)
    def restart(self, sizes: tuple[int, int, int], policy: str, offload_filter: str) -> None:
        """The worker dies (copies in flight and running requests are lost) and starts again
        on the same log, maybe with other sizes: tiers it no longer has must empty too."""
        self.pending.clear()
        self.requests.clear()
        self.admissions.clear()
        self.restarting = True
        self.build(sizes, policy, offload_filter)
        self.reg.resume(self.fold.last_event_id.get(WORKER, -1))
        self.restarting = False
        self.since_restart = 0
        self.check_fold("after a restart")

    # -- copies --------------------------------------------------------------------------

    def finish_copy(self, plan: CopyPlan, outcome: tuple[str, int]) -> list[int]:
        """Record a copy's end as ``BlockManager`` does; returns the destination slots landed."""
        kind, cut = outcome
        reg = self.reg
        if kind == "failed":
            reg.abort(plan)
            return []
        good = len(plan) if kind == "whole" else cut % len(plan)
        self.pending.extend(reg.complete(plan, arrived=good))
        return plan.landed

    @rule(data=st.data(), outcomes=st.lists(OUTCOMES, min_size=1, max_size=4))
    @precondition(lambda self: self.pending)
    def copies_finish(self, data: st.DataObject, outcomes: list[tuple[str, int]]) -> None:
        """Copies in flight end, in any order (follow-up copies they start join the queue)."""
        for outcome in outcomes:
            if not self.pending:
                break
            plan = self.pending.pop(data.draw(st.integers(0, len(self.pending) - 1)))
            self.finish_copy(plan, outcome)

    # -- requests ------------------------------------------------------------------------

    def running(self) -> int:
        """Requests holding G1 blocks (at most two, so that G1 keeps room to move blocks)."""
        return len(self.requests) + len(self.admissions)

    @rule(path=PATHS, outcomes=st.lists(OUTCOMES, min_size=2, max_size=2), keep=st.booleans())
    def request(self, path: tuple[int, ...], outcomes: list[tuple[str, int]], keep: bool) -> None:
        """A prompt: its cached prefix, onboarded from G2/G3 where G1 lacks it, and the rest
        computed; kept running (``keep``) or finished at once."""
        reg = self.reg
        hashes = [seq_hash(path[: i + 1]) for i in range(len(path))]
        match = reg.match(hashes)
        reg.note_request(hashes)
        held = reg.g1.match(hashes[: match.g1])
        plans = reg.plan_onboard(hashes, match)
        assert len(plans) <= len(outcomes)
        broken = False
        for plan, outcome in zip(plans, outcomes, strict=False):
            landed = self.finish_copy(plan, outcome)
            if broken:  # after a hole: cached on G1, not part of this request's prefix
                reg.g1.release(landed)
                continue
            held.extend(landed)
            broken = len(landed) < len(plan)
        start = len(held)
        fresh = reg.g1.allocate_upto(len(hashes) - start)
        if fresh:
            blocks = [(h, local_hash(h)) for h in hashes[start : start + len(fresh)]]
            registered = reg.g1.register(fresh, blocks, hashes[start - 1] if start else None)
            held.extend(registered)
            self.pending.extend(reg.plan_offload(registered))
        if keep and self.running() < 2:
            self.requests.append(held)
        else:
            reg.g1.release(list(reversed(held)))

    @rule(data=st.data())
    @precondition(lambda self: self.requests)
    def request_finishes(self, data: st.DataObject) -> None:
        slots = self.requests.pop(data.draw(st.integers(0, len(self.requests) - 1)))
        self.reg.g1.release(list(reversed(slots)))

    # -- the simulator's requests (copies finish at once) ---------------------------------

    @rule(path=PATHS, limit=st.integers(1, 4), keep=st.booleans())
    def simulator_admits(self, path: tuple[int, ...], limit: int, keep: bool) -> None:
        hashes = [seq_hash(path[: i + 1]) for i in range(len(path))]
        cache = SimulatedCache(self.reg)
        admission = cache.admit(hashes, [local_hash(h) for h in hashes], limit=limit)
        if keep and self.running() < 2:
            self.admissions.append((admission, hashes))
        else:
            cache.finish(admission)

    @rule(data=st.data())
    @precondition(lambda self: self.admissions)
    def simulator_decodes(self, data: st.DataObject) -> None:
        """A running request completes more blocks (its prompt beyond ``limit``)."""
        admission, hashes = self.admissions[data.draw(st.integers(0, len(self.admissions) - 1))]
        SimulatedCache(self.reg).extend(admission, hashes, [local_hash(h) for h in hashes])

    @rule(data=st.data())
    @precondition(lambda self: self.admissions)
    def simulator_finishes(self, data: st.DataObject) -> None:
        admission, _ = self.admissions.pop(data.draw(st.integers(0, len(self.admissions) - 1)))
        SimulatedCache(self.reg).finish(admission)

    @rule(tier=st.sampled_from([Tier.G1, Tier.G2, Tier.G3]), rarely=RARELY)
    def clear(self, tier: Tier, rarely: bool) -> None:
        pool = self.reg.pools.get(tier)
        if pool is None or not rarely:
            return
        if pool.num_active:
            with pytest.raises(PoolBusy):
                pool.clear()
        else:
            pool.clear()

    @invariant()
    def fold_is_live_state(self) -> None:
        if hasattr(self, "reg"):
            self.check_fold("between steps")
            assert self.fold.last_event_id.get(WORKER, -1) == self.emitter.next_event_id - 1


def test_a_fold_up_to_any_event_is_the_registry_at_that_event() -> None:
    run_state_machine_as_test(
        TieredReplayMachine,
        settings=settings(max_examples=150, stateful_step_count=50, deadline=None),
    )
