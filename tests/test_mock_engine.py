"""The mock engine's scheduling behaviour, on small hand-made workloads and the synthetic one."""

from __future__ import annotations

import time

import pytest

from kvledger.config import Settings, SettingsError
from kvledger.events.types import AnyEvent, Tier
from kvledger.mocker.cache import SimulatedCache
from kvledger.mocker.engine import (
    Bandwidth,
    EngineConfig,
    MockEngine,
    SimClock,
    StepCosts,
    StepRecord,
)
from kvledger.mocker.traces import TraceRequest, synthetic
from kvledger.registry.emitter import EventEmitter
from kvledger.registry.state import RegistryState

BS = 16
COSTS = StepCosts(prefill_ms_per_token=0.1, step_ms=2.0, per_seq_ms=0.0)


def config(**changes: object) -> EngineConfig:
    base = {
        "block_size": BS,
        "max_num_batched_tokens": 512,
        "max_num_seqs": 16,
        "watermark": 0.0,
        "bandwidth": Bandwidth.from_settings(Settings.load(block_size=BS)),
        "costs": COSTS,
    }
    base.update(changes)
    return EngineConfig(**base)  # type: ignore[arg-type]


def request(at_ms: float, blocks: list[int], output: int = 4) -> TraceRequest:
    return TraceRequest(at_ms, len(blocks) * BS, output, tuple(blocks), trace_block_size=BS)


def engine(g1: int, g2: int = 0, **changes: object) -> tuple[MockEngine, list[AnyEvent]]:
    events: list[AnyEvent] = []
    clock = SimClock()
    emitter = EventEmitter(events.append, clock=clock)
    cache = SimulatedCache.build(g1, g2, policy="lru", emitter=emitter)
    return MockEngine(cache, config(**changes), clock=clock), events


def assert_all_released(eng: MockEngine, events: list[AnyEvent]) -> None:
    for tier, active in eng.cache.tiered.in_use().items():
        assert active == 0, f"{tier.name} still holds {active} active blocks"
    live = eng.cache.tiered.state()
    assert RegistryState.from_events(events) == live


def test_events_carry_simulated_time() -> None:
    """Two requests ten simulated seconds apart: their events are ten seconds apart too,
    though the run takes milliseconds of wall time."""
    eng, events = engine(g1=64)
    started = time.time()
    eng.run([request(0, list(range(4))), request(10_000, list(range(10, 14)))])
    took = time.time() - started
    assert took < 5.0
    first, last = events[0].ts, events[-1].ts
    assert last - first >= 10.0
    assert first == pytest.approx(started, abs=1.0)  # the run starts at the wall-clock time


def test_a_cached_prompt_gets_its_first_token_sooner() -> None:
    shared = list(range(40))
    eng, events = engine(g1=256)
    stats = eng.run(
        [
            request(0, shared),
            request(10_000, shared),  # same prompt, long after: all blocks cached
            request(20_000, list(range(100, 140))),  # as long, nothing cached
        ]
    )
    first, again, fresh = stats.ttft_ms
    # 640 tokens at 0.1 ms in two 512-token chunks (+2 ms a step); a full hit feeds only
    # the last prompt token, in one step that costs what a decode step does
    assert first == pytest.approx(640 * 0.1 + 2 * 2.0)
    assert again == pytest.approx(2.0)
    assert fresh == pytest.approx(first)
    assert stats.hits_by_tier[Tier.G1] == 40
    assert_all_released(eng, events)


def test_chunked_prefill_respects_the_token_budget_and_seat_limit() -> None:
    steps: list[StepRecord] = []
    eng, events = engine(g1=1024, max_num_batched_tokens=300, max_num_seqs=3)
    eng.on_step = steps.append
    reqs = [request(0, list(range(i * 100, i * 100 + 50)), output=20) for i in range(6)]
    stats = eng.run(reqs)
    assert stats.requests == 6 and len(eng.latency_ms) == 6
    assert max(s.tokens for s in steps) == 300  # the budget is used, never exceeded
    assert all(s.seqs <= 3 for s in steps)
    # 800 prompt tokens in 300-token chunks: the first request's first token after 3 steps
    assert stats.ttft_ms[0] == pytest.approx(steps[2].end_ms)
    assert sum(s.prefill_tokens for s in steps) >= 6 * 800 - 6  # every prompt computed
    assert_all_released(eng, events)


def test_a_tiny_g1_preempts_and_still_finishes_every_request() -> None:
    reqs = [request(0, list(range(i * 1000, i * 1000 + 6)), output=60) for i in range(12)]
    eng, events = engine(g1=12)  # one request needs 6 prompt + 4 decode blocks
    stats = eng.run(reqs)
    assert eng.preemptions > 0
    assert stats.requests == 12
    assert len(stats.ttft_ms) == 12 and len(eng.latency_ms) == 12
    assert stats.extra["preemptions"] == eng.preemptions
    assert_all_released(eng, events)


def test_watermark_keeps_g1_room_for_running_sequences() -> None:
    reqs = [request(0, list(range(i * 1000, i * 1000 + 6)), output=60) for i in range(12)]
    tight, _ = engine(g1=40, watermark=0.0)
    tight.run(reqs)
    spare, events = engine(g1=40, watermark=0.5)
    stats = spare.run(reqs)
    assert stats.requests == 12
    assert spare.preemptions < tight.preemptions
    assert_all_released(spare, events)


def test_onboarding_from_g2_costs_copy_time() -> None:
    bw = Bandwidth(bytes_per_block=1 << 20, gbps={frozenset((Tier.G1, Tier.G2)): 1.0})
    prompt = list(range(8))
    others = [request(1000 + 10 * i, list(range(100 + 10 * i, 108 + 10 * i))) for i in range(4)]
    eng, events = engine(g1=12, g2=64, bandwidth=bw)
    stats = eng.run([request(0, prompt), *others, request(5000, prompt)])
    assert stats.hits_by_tier[Tier.G2] == 8  # G1 lost it, G2 kept the write-through copy
    copy_ms = bw.copy_ms(Tier.G2, Tier.G1, 8)
    assert copy_ms == pytest.approx(8 * (1 << 20) / 1e9 * 1e3)
    assert eng.onboard_ms == pytest.approx(copy_ms)
    assert stats.ttft_ms[-1] == pytest.approx(2.0 + copy_ms)
    assert_all_released(eng, events)


def test_synthetic_workload_with_three_tiers_replays_exactly() -> None:
    events: list[AnyEvent] = []
    clock = SimClock()
    cache = SimulatedCache.build(
        512, 256, 1024, policy="lineage", emitter=EventEmitter(events.append, clock=clock)
    )
    eng = MockEngine(cache, config(max_num_batched_tokens=2048, max_num_seqs=32), clock=clock)
    stats = eng.run(synthetic(300, block_size=BS, sessions=30, seed=3))
    assert stats.requests == 300 and stats.blocks_unplaced == 0
    assert stats.hits_by_tier[Tier.G1] > 0 and stats.hits_by_tier[Tier.G3] > 0
    assert stats.ttft_ms and all(t > 0 for t in stats.ttft_ms)
    assert_all_released(eng, events)
    # events are stamped with simulated time: monotonic, spanning the simulated run
    stamps = [e.ts for e in events]
    assert stamps == sorted(stamps)
    assert stamps[-1] - stamps[0] == pytest.approx(stats.extra["simulated_s"], abs=1.0)


def test_speedup_makes_the_run_track_wall_time() -> None:
    eng, _ = engine(g1=64, speedup=10.0)
    started = time.monotonic()
    stats = eng.run([request(0, [1, 2]), request(1000, [3, 4])])  # 1 s simulated at least
    assert time.monotonic() - started >= stats.extra["simulated_s"] / 10.0 * 0.99
    with pytest.raises(ValueError, match="speedup must be >= 0"):
        config(speedup=-1.0)


def test_a_request_larger_than_g1_is_refused_with_its_size() -> None:
    eng, _ = engine(g1=4)
    with pytest.raises(ValueError, match=r"request 0 needs 5 G1 blocks .* G1 holds 4"):
        eng.run([request(0, [1, 2, 3, 4], output=10)])


def test_a_late_request_larger_than_g1_is_refused_before_the_run_starts() -> None:
    """Requests are hashed as they arrive, but checked against G1 before the first step: a
    run that cannot finish never half-runs."""
    eng, events = engine(g1=4)
    trace = [request(0, [1]), request(10, [2]), request(20, [1, 2, 3, 4], output=10)]
    with pytest.raises(ValueError, match=r"request 2 needs 5 G1 blocks .* G1 holds 4"):
        eng.run(trace)
    assert events == []


@pytest.mark.parametrize(
    ("field", "value", "named"),
    [
        ("watermark", 1.0, "watermark"),
        ("max_num_batched_tokens", 0, "max_num_batched_tokens"),
        ("g1_g2_gbps", 0, "g1_g2_gbps"),
    ],
)
def test_engine_settings_are_validated(field: str, value: object, named: str) -> None:
    with pytest.raises(SettingsError, match=named):
        Settings.load(**{field: value})


def test_decoding_ahead_gives_exactly_what_single_steps_give() -> None:
    reqs = synthetic(200, block_size=BS, sessions=20, output_tokens=(1, 300), seed=5)
    runs = []
    for ahead in (True, False):
        eng, events = engine(g1=400, g2=200)
        eng.decode_ahead = ahead
        steps: list[StepRecord] = []
        eng.on_step = steps.append
        stats = eng.run(reqs)
        runs.append((stats.ttft_ms, eng.latency_ms, eng.steps, eng.preemptions, events, steps))
    fast, slow = runs
    assert fast[0] == pytest.approx(slow[0]) and fast[1] == pytest.approx(slow[1])
    assert fast[2:4] == slow[2:4]
    assert [(type(e), e.event_id) for e in fast[4]] == [(type(e), e.event_id) for e in slow[4]]
    assert [s.tokens for s in fast[5]] == [s.tokens for s in slow[5]]
    assert len(fast[5]) == fast[2]
