"""The mock engine with Dynamo's model: polynomial step cost, whole-prompt admission, full
blocks only; and its agreement with Dynamo's own mocker replay on a slice of a real trace."""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path

import pytest

from kvledger.config import Settings, SettingsError
from kvledger.events.types import AnyEvent, Removed, Stored
from kvledger.mocker.cache import SimulatedCache
from kvledger.mocker.engine import Bandwidth, EngineConfig, MockEngine, SimClock, StepRecord
from kvledger.mocker.stats import CountingEmitter
from kvledger.mocker.timing import DynamoTiming
from kvledger.mocker.traces import TraceRequest, iter_arrivals, load_mooncake, synthetic
from kvledger.registry.emitter import EventEmitter
from kvledger.registry.state import RegistryState

BS = 16
TIMING = DynamoTiming()
SHARED_DATA = Path(
    os.environ.get("KVLEDGER_SHARED_DATA", Path(__file__).resolve().parents[2] / "shared/data")
)
TRACE = SHARED_DATA / "mooncake/conversation_trace.jsonl"


def config(**changes: object) -> EngineConfig:
    base: dict[str, object] = {
        "block_size": BS,
        "max_num_batched_tokens": 512,
        "max_num_seqs": 16,
        "watermark": 0.0,
        "bandwidth": Bandwidth.from_settings(Settings.load(block_size=BS)),
        "timing": TIMING,
        "admission": "whole_prompt",
        "cache_partial_blocks": False,
    }
    base.update(changes)
    return EngineConfig(**base)  # type: ignore[arg-type]


def engine(g1: int, **changes: object) -> tuple[MockEngine, list[AnyEvent]]:
    events: list[AnyEvent] = []
    clock = SimClock()
    cache = SimulatedCache.build(g1, policy="lru", emitter=EventEmitter(events.append, clock=clock))
    return MockEngine(cache, config(**changes), clock=clock), events


def request(
    at_ms: float, blocks: list[int], tokens: int | None = None, output: int = 4
) -> TraceRequest:
    length = len(blocks) * BS if tokens is None else tokens
    return TraceRequest(at_ms, length, output, tuple(blocks), trace_block_size=BS)


def assert_replays(eng: MockEngine, events: list[AnyEvent]) -> None:
    assert all(active == 0 for active in eng.cache.tiered.in_use().values())
    assert RegistryState.from_events(events) == eng.cache.tiered.state()


def test_the_polynomial_costs_prefill_and_decode_passes() -> None:
    """One 300-token prompt on a 64-block G1: a 300-token prefill pass that samples the
    first token (a prefill pass: no decode time, as in Dynamo's mocker), then decode passes
    whose cost grows with the context."""
    eng, events = engine(g1=64)
    steps: list[StepRecord] = []
    eng.on_step = steps.append
    stats = eng.run([request(0, list(range(19)), tokens=300, output=3)])
    capacity = 64 * BS
    first = TIMING.prefill_ms(300)
    assert first == pytest.approx(4.209989e-7 * 300**2 + 0.01518344 * 300 + 16.50142)
    assert stats.ttft_ms == [pytest.approx(first)]
    assert [s.step_ms for s in steps[1:]] == [
        pytest.approx(TIMING.decode_ms(301, capacity)),
        pytest.approx(TIMING.decode_ms(302, capacity)),
    ]
    assert TIMING.decode_ms(301, capacity) == pytest.approx(
        5.74 + 54.01 * 301 / 1024 - 25.74 * (301 / 1024) ** 2
    )
    tpot = sum(s.step_ms for s in steps[1:]) / 2
    assert stats.extra["tpot_ms_mean"] == pytest.approx(tpot, abs=1e-3)
    assert_replays(eng, events)


def test_a_pass_of_several_prompt_chunks_costs_the_mean_chunk_in_whole_tokens() -> None:
    """Dynamo's mocker charges k prompt chunks in one pass as k chunks from the mean start
    to the mean end, each mean rounded down to a whole token: prompts of 300 and 11 tokens
    prefilled together from token 0 cost 2 x (311 // 2) = 310 tokens, not 311 (checked
    against Dynamo's replay pass by pass)."""
    eng, events = engine(g1=64, max_num_batched_tokens=512)
    steps: list[StepRecord] = []
    eng.on_step = steps.append
    eng.run([request(0, list(range(19)), tokens=300, output=1), request(0, [99], 11, output=1)])
    assert steps[0].prefill_tokens == 311
    assert steps[0].step_ms == pytest.approx(TIMING.prefill_ms(310))
    assert_replays(eng, events)


def test_the_speedup_ratio_divides_every_pass() -> None:
    fast = DynamoTiming(speedup_ratio=4.0)
    assert fast.prefill_ms(1000) == pytest.approx(TIMING.prefill_ms(1000) / 4)
    assert fast.decode_ms(10, 100) == pytest.approx(TIMING.decode_ms(10, 100) / 4)
    assert TIMING.prefill_ms(0) == 0.0
    assert TIMING.decode_ms(0, 100) == pytest.approx(5.74)
    assert TIMING.decode_ms(500, 100) == TIMING.decode_ms(100, 100)  # load is capped at 1
    with pytest.raises(ValueError, match="speedup_ratio must be > 0"):
        DynamoTiming(speedup_ratio=0.0)


def test_whole_prompt_admission_waits_until_the_prompt_fits() -> None:
    """G1 of 28 blocks, 128-token (8-block) prefill chunks: a 16-block request runs (17 blocks
    once it decodes); a second 16-block one does not fit in the 11 blocks left, so it waits.
    The watermark rule starts it as its first chunk fits, and has to preempt later."""
    reqs = [request(0, list(range(16)), output=40), request(1, list(range(100, 116)), output=40)]
    whole, events = engine(g1=28, max_num_batched_tokens=128)
    stats = whole.run(reqs)
    assert whole.preemptions == 0
    assert stats.ttft_ms[1] + 1 > min(whole.latency_ms)  # it started once the first ended
    watermark, _ = engine(g1=28, max_num_batched_tokens=128, admission="watermark")
    watermark.run(reqs)
    assert watermark.preemptions > 0
    assert_replays(whole, events)


def test_only_full_blocks_are_cached_and_a_partial_tail_is_freed() -> None:
    """Prompts of 2.5 blocks with one output token: the tail never fills, so with full blocks
    only it is never named and, freed, it is the next block handed out instead of a cached
    one; cached too, it pushes out more of the other requests' blocks."""
    reqs = [
        request(i * 100, [2 * i, 2 * i + 1, 10_000 + i], tokens=40, output=1) for i in range(40)
    ]
    free, free_events = engine(g1=6)
    free.run(reqs)
    cached, cached_events = engine(g1=6, cache_partial_blocks=True)
    cached.run(reqs)

    def stored(events: list[AnyEvent]) -> int:
        return sum(len(e.blocks) for e in events if isinstance(e, Stored))

    def evicted(events: list[AnyEvent]) -> int:
        return sum(len(e.sequence_hashes) for e in events if isinstance(e, Removed))

    assert stored(free_events) == 80  # two full blocks per request, no tail
    assert stored(cached_events) == 120
    assert evicted(cached_events) > evicted(free_events) + 30
    assert_replays(free, free_events)
    assert_replays(cached, cached_events)


def test_a_tail_that_fills_during_decode_is_named_then() -> None:
    """A 20-token prompt (one full block, a 4-token tail) generating 30 tokens: the tail
    fills at token 32 and gets a name; the last block (18 tokens, never full) does not."""
    eng, events = engine(g1=8)
    eng.run([request(0, [1, 2], tokens=20, output=30)])
    names = [b for e in events if isinstance(e, Stored) for b in e.blocks]
    assert len(names) == 3  # the prompt's full block, the filled tail, the decode block
    assert_replays(eng, events)


@pytest.mark.parametrize("model", ["dynamo", "linear"])
def test_parked_decoders_give_exactly_what_single_steps_give(model: str) -> None:
    reqs = synthetic(200, block_size=BS, sessions=20, output_tokens=(1, 300), seed=5)
    changes: dict[str, object] = {}
    if model == "linear":
        changes = {"timing": None, "admission": "watermark", "cache_partial_blocks": True}
    runs = []
    for ahead in (True, False):
        eng, events = engine(g1=300, **changes)
        eng.decode_ahead = ahead
        steps: list[StepRecord] = []
        eng.on_step = steps.append
        stats = eng.run(reqs)
        runs.append((stats.ttft_ms, eng.latency_ms, eng.steps, eng.preemptions, events, steps))
    fast, slow = runs
    assert fast[3] > 0  # preemptions happened: parked sequences were among the victims
    assert fast[:4] == slow[:4]
    # same events but for their wall-clock stamps (each run starts its clock when it starts)
    assert [replace(e, ts=0.0) for e in fast[4]] == [replace(e, ts=0.0) for e in slow[4]]
    assert fast[5] == slow[5]


def test_engine_model_settings_are_validated() -> None:
    with pytest.raises(SettingsError, match="timing_model"):
        Settings.load(timing_model="quadratic")
    with pytest.raises(SettingsError, match="admission_rule"):
        Settings.load(admission_rule="greedy")
    with pytest.raises(SettingsError, match="speedup_ratio"):
        Settings.load(speedup_ratio=0)
    with pytest.raises(ValueError, match="admission must be one of"):
        config(admission="greedy")
    s = Settings.load(timing_model="dynamo", admission_rule="whole_prompt", speedup_ratio=2.0)
    c = EngineConfig.from_settings(s)
    assert c.timing == DynamoTiming(speedup_ratio=2.0) and c.admission == "whole_prompt"


# -- agreement with Dynamo's mocker ----------------------------------------------------------

REQUESTS = 1000
G1_BLOCKS = 1024


@pytest.fixture(scope="module")
def trace_slice(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if not TRACE.is_file():
        pytest.skip(f"the Mooncake trace is not at {TRACE} (set KVLEDGER_SHARED_DATA)")
    rows = TRACE.read_text().splitlines()[:REQUESTS]
    path = tmp_path_factory.mktemp("trace") / "slice.jsonl"
    path.write_text("\n".join(rows) + "\n")
    return path


def test_agrees_with_dynamos_mocker_replay_within_five_percent(trace_slice: Path) -> None:
    """The first 1,000 requests of the Mooncake conversation trace, 1,024 blocks of 512
    tokens (tight enough to preempt): TTFT p50/p99, mean TPOT, preemptions and the token hit
    rate over every admission within 5% of what Dynamo's own replay reports."""
    core = pytest.importorskip("dynamo._core", reason="ai-dynamo-runtime is not installed")
    database_args = {
        "num_gpu_blocks": G1_BLOCKS,
        "block_size": 512,
        "max_num_seqs": 256,
        "max_num_batched_tokens": 8192,
        "speedup_ratio": 1.0,
        "enable_prefix_caching": True,
        "enable_chunked_prefill": True,
    }
    result = core.run_mocker_trace_replay(
        [str(trace_slice)],
        extra_engine_args={"engine": database_args},
        capture_telemetry=True,
        telemetry_sample_interval_ms=1e12,
    )
    theirs = result.summary
    their_preemptions = sum(
        s["decode_interval_metrics"]["preemptions"] + s["prefill_interval_metrics"]["preemptions"]
        for s in result.telemetry["samples"]
    )

    settings = Settings.load(
        block_size=512,
        g1_blocks=G1_BLOCKS,
        timing_model="dynamo",
        admission_rule="whole_prompt",
        cache_partial_blocks=False,
        eviction_policy="lru",
    )
    clock = SimClock()
    tally = CountingEmitter(clock=clock)
    cache = SimulatedCache.build(G1_BLOCKS, policy="lru", emitter=tally)
    eng = MockEngine(cache, EngineConfig.from_settings(settings), clock=clock)
    ours = eng.run(list(iter_arrivals(load_mooncake(trace_slice)))).summary(cache, tally)

    assert theirs["completed_requests"] == ours["requests"] == REQUESTS
    pairs = {
        "ttft p50": (ours["ttft_ms_p50"], theirs["median_ttft_ms"]),
        "ttft p99": (ours["ttft_ms_p99"], theirs["p99_ttft_ms"]),
        "tpot": (ours["tpot_ms_mean"], theirs["mean_tpot_ms"]),
        "preemptions": (ours["preemptions"], their_preemptions),
        "hits": (ours["token_hit_rate_all_admissions"], theirs["prefix_cache_reused_ratio"]),
    }
    assert their_preemptions > 10  # the slice exercises preemption
    off = {k: (a, b) for k, (a, b) in pairs.items() if abs(a - b) > 0.05 * abs(b)}
    assert not off, f"differ from Dynamo's by more than 5%: {json.dumps(off)}"
