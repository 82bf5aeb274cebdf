"""Real simulated runs on real SQLite logs: replaying the log up to ANY event gives what the
simulated worker held at that event, and no replayed prefix holds more blocks than a tier has.

The Mooncake synthetic trace, engine off and on, every eviction policy, with and without G2/G3.
A sink beside the log notes the live per-tier counts at every event (and the whole live state
at some), so the log read back afterwards is compared event by event with the run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvledger.config import Settings
from kvledger.events.log import EventLog
from kvledger.events.log.replay import replay
from kvledger.events.types import AnyEvent, Tier
from kvledger.mocker.cache import SimulatedCache
from kvledger.mocker.engine import EngineConfig, MockEngine, SimClock
from kvledger.mocker.engine_off import replay_cache
from kvledger.mocker.traces import load_mooncake
from kvledger.registry.emitter import EventEmitter
from kvledger.registry.state import RegistryState

# The shared data folder sits beside the checkout; KVLEDGER_SHARED_DATA points elsewhere
# (a clone in another folder).
SHARED_DATA = Path(
    os.environ.get("KVLEDGER_SHARED_DATA", Path(__file__).resolve().parents[2] / "shared/data")
)
TRACE = SHARED_DATA / "mooncake/synthetic_trace.jsonl"
BLOCK = 512
WORKER = 0

pytestmark = pytest.mark.skipif(
    not TRACE.exists(), reason=f"trace not found at {TRACE} (set KVLEDGER_SHARED_DATA)"
)


def live_state(cache: SimulatedCache) -> RegistryState:
    return cache.tiered.state()


def live_counts(cache: SimulatedCache) -> dict[Tier, int]:
    return {t: n for t, n in cache.tiered.counts().items() if n}


@pytest.mark.parametrize(
    ("policy", "sizes", "offload_filter", "engine", "requests"),
    [
        ("multi_lru", (2048, 0, 0), "seen_twice", False, 800),  # the run of issue 12
        ("multi_lru", (1024, 0, 0), "seen_twice", True, 800),
        ("lru", (512, 1024, 2048), "seen_twice", False, 400),
        ("lineage", (512, 1024, 2048), "always", True, 300),
        ("multi_lru", (512, 0, 1024), "always", False, 400),
    ],
)
def test_replay_up_to_every_event_is_the_run_at_that_event(
    tmp_path: Path,
    policy: str,
    sizes: tuple[int, int, int],
    offload_filter: str,
    engine: bool,
    requests: int,
) -> None:
    url = f"sqlite:///{tmp_path}/run.db"
    log = EventLog(url)
    counts: list[dict[Tier, int]] = []  # live counts right after event i
    snapshots: dict[int, RegistryState] = {}  # the whole live state after some events
    cache: SimulatedCache

    def sink(event: AnyEvent) -> None:
        log.append(event)
        counts.append(live_counts(cache))
        if event.event_id % 97 == 0:
            snapshots[event.event_id] = live_state(cache)

    clock = SimClock()  # the mock engine's; engine off stamps wall time
    cache = SimulatedCache.build(
        *sizes,
        policy=policy,
        offload_filter=offload_filter,
        emitter=EventEmitter(sink, worker_id=WORKER, clock=clock if engine else time.time),
    )
    trace = sorted(load_mooncake(TRACE), key=lambda r: r.arrival_ms)[:requests]
    if engine:
        settings = Settings.load(block_size=BLOCK, g1_blocks=sizes[0])
        MockEngine(cache, EngineConfig.from_settings(settings), clock=clock).run(trace)
    else:
        replay_cache(trace, cache, BLOCK)
    log.close()
    replayed, live = replay(url), live_state(cache)
    assert replayed == live, replayed.diff(live)

    capacity = cache.tiered.capacities()
    fold = RegistryState()
    with EventLog(url, read_only=True) as reader:
        for i, event in enumerate(reader.read()):
            assert event.event_id == i
            fold.apply(event)
            folded = {tier: n for (_, tier), n in fold.counts().items()}
            for tier, n in folded.items():
                assert n <= capacity.get(tier, 0), f"event {i}: {n} blocks on {tier.name}"
            assert folded == counts[i], f"event {i} ({type(event).__name__})"
            if i in snapshots:
                assert fold == snapshots[i], f"event {i}: " + "; ".join(fold.diff(snapshots[i]))
    assert len(counts) == i + 1
    # the replay command's own path (chunks, checkpoints) at a few of those points
    for event_id in sorted(snapshots)[:: max(1, len(snapshots) // 4)]:
        assert replay(url, until_event_id=event_id) == snapshots[event_id]


def test_issue_12_simulate_command_replays_and_no_prefix_overfills(tmp_path: Path) -> None:
    """The command of issue 12 as a user runs it: it used to end in REPLAY MISMATCH."""
    url = f"sqlite:///{tmp_path}/m.db"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVLEDGER_", "DYN_KVBM_"))}
    args = ["simulate", "--trace", str(TRACE), "--log", url, "--json", "--engine", "off"]
    args += ["--policy", "multi_lru", "--g1-blocks", "2048", "--requests", "800"]
    proc = subprocess.run(
        [sys.executable, "-m", "kvledger.cli", *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert "REPLAY MISMATCH" not in proc.stdout + proc.stderr
    summary = json.loads(proc.stdout)
    assert summary["replay_matches"] is True
    last = summary["events_written"] - 1
    for until in range(0, last + 1, 50):
        held = replay(url, until_event_id=until).counts().get((0, Tier.G1), 0)
        assert held <= 2048, f"replay --until {until}: {held} blocks in a 2048-block G1"
