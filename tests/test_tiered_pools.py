"""TieredPools: where blocks go between G1, G2 and G3, and what events say about it."""

from __future__ import annotations

import pytest

from kvledger.events.types import AnyEvent, Offloaded, Onboarded, Tier
from kvledger.registry.emitter import EventEmitter
from kvledger.registry.state import RegistryState
from kvledger.registry.tiered import CopyPlan, MatchResult, TieredPools


def build(
    g1: int = 4, g2: int = 0, g3: int = 0, offload_filter: str = "always"
) -> tuple[TieredPools, list[AnyEvent]]:
    events: list[AnyEvent] = []
    reg = TieredPools(
        g1, g2, g3, policy="lru", offload_filter=offload_filter, emitter=EventEmitter(events.append)
    )
    return reg, events


def run_all(reg: TieredPools, transfers: list[CopyPlan]) -> list[CopyPlan]:
    done = []
    while transfers:
        t = transfers.pop()
        done.append(t)
        transfers.extend(reg.complete(t))
    return done


def store(reg: TieredPools, hashes: list[int]) -> list[int]:
    """Compute and register a chain on G1, complete its offloads, release it."""
    g1 = reg.g1
    reg.note_request(hashes)
    slots = g1.register(g1.allocate(len(hashes)), [(h, h + 1000) for h in hashes], None)
    run_all(reg, reg.plan_offload(slots))
    g1.release(reversed(slots))
    return slots


def state_of(reg: TieredPools) -> RegistryState:
    return reg.state()


def test_write_through_to_g2_then_filtered_to_g3() -> None:
    reg, events = build(g1=2, g2=8, g3=8, offload_filter="seen_twice")
    store(reg, [1, 2])
    assert reg.pools[Tier.G2].probe([1, 2]) == 2
    assert reg.pools[Tier.G3].probe([1, 2]) == 0, "seen once: not worth a disk write yet"
    store(reg, [5, 6])  # pushes 1, 2 out of G1
    assert reg.match([1, 2]) == MatchResult(0, 2, 0)
    reg.note_request([1, 2])  # the prefix comes back: seen twice now
    transfers = run_all(reg, reg.plan_onboard([1, 2], reg.match([1, 2])))
    assert [(t.src_tier, t.dst_tier) for t in transfers] == [
        (Tier.G2, Tier.G1),
        (Tier.G2, Tier.G3),
    ]
    assert reg.pools[Tier.G3].probe([1, 2]) == 2
    offloads = [(e.src_tier, e.tier) for e in events if isinstance(e, Offloaded)]
    assert (Tier.G2, Tier.G3) in offloads
    assert RegistryState.from_events(events) == state_of(reg)


def test_filter_always_and_never() -> None:
    for name, expect in (("always", 2), ("never", 0)):
        reg, _ = build(g1=4, g2=8, g3=8, offload_filter=name)
        store(reg, [1, 2])
        assert reg.pools[Tier.G3].probe([1, 2]) == expect, name


def test_no_g2_means_g1_straight_to_g3() -> None:
    reg, events = build(g1=4, g3=8)
    store(reg, [5, 6, 7])
    assert reg.lower_tiers() == [Tier.G3]
    assert reg.pools[Tier.G3].probe([5, 6, 7]) == 3
    (off,) = [e for e in events if isinstance(e, Offloaded)]
    assert (off.src_tier, off.tier) == (Tier.G1, Tier.G3)


def test_match_continues_prefix_across_tiers_and_onboard_brings_it_up() -> None:
    reg, events = build(g1=3, g2=8, g3=0)
    store(reg, [1, 2, 3])
    store(reg, [7, 8, 9])  # evicts 1, 2, 3 from G1; they stay on G2
    assert reg.match([1, 2, 3, 4]) == MatchResult(0, 3, 0)
    transfers = reg.plan_onboard([1, 2, 3, 4], reg.match([1, 2, 3, 4]))
    (t,) = transfers
    assert (t.src_tier, t.dst_tier, len(t)) == (Tier.G2, Tier.G1, 3)
    run_all(reg, transfers)
    assert reg.match([1, 2, 3]) == MatchResult(3, 0, 0)
    assert [b.sequence_hash for b in t.blocks] == [1, 2, 3]
    assert reg.g1.num_active == 3, "onboarded blocks are held by the request"
    assert any(isinstance(e, Onboarded) and e.src_tier == Tier.G2 for e in events)
    assert RegistryState.from_events(events) == state_of(reg)


def test_onboard_with_too_little_g1_takes_a_prefix() -> None:
    reg, _ = build(g1=3, g2=8)
    store(reg, [1, 2, 3])
    store(reg, [7, 8, 9])
    held = reg.g1.match([7, 8])  # two of three G1 slots in use
    transfers = reg.plan_onboard([1, 2, 3], reg.match([1, 2, 3]))
    assert [len(t) for t in transfers] == [1]
    run_all(reg, transfers)
    reg.g1.release(held)


def test_abort_frees_destination_and_unpins_source() -> None:
    reg, events = build(g1=4, g2=4)
    g1 = reg.g1
    slots = g1.register(g1.allocate(2), [(1, 1), (2, 2)], None)
    (t,) = reg.plan_offload(slots)
    assert reg.pools[Tier.G2].num_active == 2
    reg.abort(t)
    assert reg.pools[Tier.G2].num_free == 4
    g1.release(slots)
    assert g1.num_active == 0
    assert not any(isinstance(e, Offloaded) for e in events)


def test_unknown_filter_is_named() -> None:
    with pytest.raises(ValueError, match="unknown offload filter 'twice'"):
        TieredPools(4, offload_filter="twice")
