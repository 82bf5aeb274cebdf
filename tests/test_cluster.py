"""A cluster of mock engines in one process: the routers, the feeds that tell the KV router
what the workers hold, one event log per worker, ``whatif`` on a cluster, and agreement with
Dynamo's own multi-worker replay."""

from __future__ import annotations

import json
import math
import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvledger.cli import main
from kvledger.commands.cluster import ClusterOptions, run_one
from kvledger.config import Settings
from kvledger.events.log import EventLog
from kvledger.events.types import Removed, Stored, Tier
from kvledger.mocker import router as router_module
from kvledger.mocker.feeds import RedisFeed
from kvledger.mocker.router import KvRouter, RoundRobinRouter, WorkerLoad
from kvledger.mocker.routing import KvRouterConfig
from kvledger.mocker.traces import TraceRequest, load_mooncake, synthetic
from kvledger.registry.hashing import chain_sequence_hashes
from kvledger.registry.index import RouterIndex, tier_bit

SHARED_DATA = Path(
    os.environ.get("KVLEDGER_SHARED_DATA", Path(__file__).resolve().parents[2] / "shared/data")
)
SYNTHETIC_TRACE = SHARED_DATA / "mooncake/synthetic_trace.jsonl"
BS = 16
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def dynamo_settings(**changes: Any) -> Settings:
    """Dynamo's engine model on small blocks: what every cluster test here runs."""
    base: dict[str, Any] = {
        "block_size": BS,
        "g1_blocks": 256,
        "max_num_batched_tokens": 512,
        "timing_model": "dynamo",
        "admission_rule": "whole_prompt",
        "cache_partial_blocks": False,
        "eviction_policy": "lru",
    }
    base.update(changes)
    return Settings.load(**base)


def workload(n: int = 300, seed: int = 1) -> list[TraceRequest]:
    """Chat sessions sharing system prompts, arriving faster than one small worker serves."""
    return synthetic(
        n,
        block_size=BS,
        system_prompts=4,
        system_blocks=8,
        sessions=40,
        turn_blocks=(2, 6),
        output_tokens=(4, 40),
        rate_per_s=400.0,
        seed=seed,
    )


def quiet(_message: str) -> None:
    pass


def kvledger(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVLEDGER_", "DYN_KVBM_"))}
    return subprocess.run(
        [sys.executable, "-m", "kvledger.cli", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )


# -- the KV router's cost ------------------------------------------------------------------


def chain(*locals_: int) -> list[int]:
    return chain_sequence_hashes(list(locals_))


def stored(
    worker: int, event_id: int, tier: Tier, hashes: list[int], parent: int | None = None
) -> Stored:
    blocks = tuple((h, h) for h in hashes)
    return Stored(
        event_id=event_id,
        worker_id=worker,
        dp_rank=0,
        tier=tier,
        ts=0.0,
        parent_hash=parent,
        blocks=blocks,
        token_ids=None,
    )


def test_the_kv_router_weighs_cached_prefixes_against_load_as_dynamo_does() -> None:
    """Worker 0 holds the first 3 of a 4-block, 69-token prompt on G1; worker 1 holds the
    first 2 on G1 and the next 2 on G2 (host hits, weighed 0.75). Costs, in blocks:
    prefill_load_scale * max(0, (active prefill tokens + 69) / 16 - credit) + active blocks
    + the prompt's blocks not among them."""
    prompt = chain(1, 2, 3, 4)
    index = RouterIndex()
    index.apply(stored(0, 0, Tier.G1, prompt[:3]))
    index.apply(stored(1, 0, Tier.G1, prompt[:2]))
    index.apply(stored(1, 1, Tier.G2, prompt[2:], parent=prompt[1]))
    router = KvRouter(index, [0, 1], block_size=BS, tiers=True)
    costs, devices = router.costs(prompt, 69)
    assert devices == [3, 2]
    assert costs == [pytest.approx(69 / 16 - 3 + 4), pytest.approx(69 / 16 - (2 + 0.75 * 2) + 4)]
    assert router.route(7, prompt, 69) == 1  # 2 G1 + 2 G2 hits beat 3 G1 hits
    load = router.loads[1]
    assert (load.prefill_tokens, len(load.blocks)) == (69 - 2 * BS, 4)
    # the same prompt again: its blocks are active on worker 1 (no new decode blocks), but
    # its uncached 37 tokens wait there: (37 + 69) / 16 - 3.5 + 4
    costs, _ = router.costs(prompt, 69)
    assert costs[1] == pytest.approx((37 + 69) / 16 - 3.5 + 4)
    router.prefill_done(1, 7)
    assert router.loads[1].prefill_tokens == 0
    router.finished(1, 7)
    assert router.loads[1].blocks == {}


def test_kv_router_settings_are_checked_by_name() -> None:
    with pytest.raises(ValueError, match="host_cache_hit_weight must be a finite number >= 0"):
        KvRouterConfig(host_cache_hit_weight=-1.0)
    with pytest.raises(ValueError, match="router_temperature"):
        KvRouterConfig(router_temperature=math.nan)
    assert KvRouterConfig() == KvRouterConfig(
        overlap_score_credit=1.0,
        prefill_load_scale=1.0,
        host_cache_hit_weight=0.75,
        disk_cache_hit_weight=0.25,
        router_temperature=0.0,
    )


def test_ties_go_to_a_random_worker_chosen_by_the_seed() -> None:
    """Empty workers cost the same: the pick is random, and the seed makes it repeatable."""

    def picks(seed: int) -> list[int]:
        router = KvRouter(RouterIndex(), [0, 1, 2, 3], block_size=BS, seed=seed)
        out = []
        for request in range(200):
            out.append(router.route(request, chain(request), BS))
            router.finished(out[-1], request)
        return out

    assert picks(3) == picks(3)
    assert picks(3) != picks(4)
    assert set(picks(3)) == {0, 1, 2, 3}


def test_a_temperature_draws_cheaper_workers_more_often() -> None:
    router = KvRouter(
        RouterIndex(), [0, 1], block_size=BS, config=KvRouterConfig(router_temperature=0.5)
    )
    router.loads[1].add(-1, chain(99, 98, 97, 96), 0)  # worker 1 is busier
    drawn = [router._sample(router.costs(chain(5), BS)[0], 0.5) for _ in range(2000)]
    assert 0.7 < drawn.count(0) / len(drawn) < 0.95  # e^-1 odds for the dearer one


@given(st.data())
@settings(max_examples=60, deadline=None)
def test_active_prefix_is_the_held_part_of_a_prompt(data: st.DataObject) -> None:
    load = WorkerLoad()
    prompts = data.draw(st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=8), max_size=5))
    for i, locals_ in enumerate(prompts):
        load.add(i, chain_sequence_hashes(locals_), 0)
    asked = chain_sequence_hashes(data.draw(st.lists(st.integers(0, 3), max_size=9)))
    scan = 0
    while scan < len(asked) and asked[scan] in load.blocks:
        scan += 1
    assert load.active_prefix(asked) == scan


@given(st.data())
@settings(max_examples=80, deadline=None)
def test_tier_reach_follows_a_prefix_across_faster_tiers(data: st.DataObject) -> None:
    """Against a block-by-block walk of ``holders()``: for each worker, how many leading
    blocks are on G1, on G1 or G2, on G1 to G3, on G1 to G4."""
    prompt = chain_sequence_hashes(list(range(8)))
    index = RouterIndex()
    ids = {0: 0, 1: 0}
    for _ in range(data.draw(st.integers(0, 12))):
        worker = data.draw(st.sampled_from([0, 1]))
        tier = data.draw(st.sampled_from(list(Tier)))
        start = data.draw(st.integers(0, 7))
        end = data.draw(st.integers(start + 1, 8))
        if data.draw(st.booleans()):
            parent = prompt[start - 1] if start else None
            event: Stored | Removed = stored(worker, ids[worker], tier, prompt[start:end], parent)
        else:
            event = Removed(
                event_id=ids[worker],
                worker_id=worker,
                dp_rank=0,
                tier=tier,
                ts=0.0,
                sequence_hashes=tuple(prompt[start:end]),
            )
        index.apply(event)
        ids[worker] += 1
    holders = index.holders()
    expected: dict[tuple[int, int], list[int]] = {}
    for worker in (0, 1):
        levels = []
        for level in range(4):
            wanted = sum(tier_bit(Tier(t)) for t in range(1, level + 2))
            depth = 0
            while depth < 8 and holders.get(prompt[depth], {}).get(worker, 0) & wanted:
                depth += 1
            levels.append(depth)
        if any(levels):
            expected[(worker, 0)] = levels
    assert index.tier_reach(prompt) == expected


# -- a cluster run ---------------------------------------------------------------------------


def test_round_robin_workers_run_alone_as_they_would_interleaved(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Round robin does not look at the workers, so the cluster runs each worker alone; the
    figures are those of the arrival-by-arrival loop the KV router needs."""
    requests = workload()
    alone = run_one(
        dynamo_settings(), ClusterOptions(3, "round_robin"), requests, log_dir=None, note=quiet
    ).summary
    monkeypatch.setattr(RoundRobinRouter, "stateless", False)
    interleaved = run_one(
        dynamo_settings(), ClusterOptions(3, "round_robin"), requests, log_dir=None, note=quiet
    ).summary
    for key in ("ttft_ms_p50", "ttft_ms_p99", "tpot_ms_mean", "hit_rate", "routed"):
        assert alone["cluster"][key] == interleaved["cluster"][key]
    assert alone["cluster"]["routed"] == [100, 100, 100]


def test_the_kv_router_beats_round_robin_on_shared_prefixes() -> None:
    requests = workload()
    figures = {
        router: run_one(
            dynamo_settings(), ClusterOptions(4, router), requests, log_dir=None, note=quiet
        ).summary["cluster"]
        for router in ("round_robin", "random", "kv")
    }
    assert figures["kv"]["hit_rate"] > figures["round_robin"]["hit_rate"] + 0.1
    assert figures["kv"]["hit_rate"] > figures["random"]["hit_rate"] + 0.1
    assert figures["kv"]["ttft_ms_p50"] < figures["round_robin"]["ttft_ms_p50"]
    assert sum(figures["random"]["routed"]) == len(requests)


def test_a_request_sees_the_blocks_of_steps_that_ended_before_it_arrived(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A 48-block prompt prefills 32 blocks a step (a 512-token budget) on one worker; the
    same prompt arriving during its second step finds the 32 blocks of the first one only:
    a step's blocks reach the router when the step ends, as in Dynamo's replay."""
    prompt = tuple(range(48))
    first = TraceRequest(0.0, 48 * BS, 2, prompt, BS)
    solo = run_one(
        dynamo_settings(), ClusterOptions(1, "kv"), [first], log_dir=None, note=quiet
    ).summary
    step_ms = solo["per_worker"][0]["ttft_ms_p50"] / 2  # two equal prefill steps
    seen: list[list[int]] = []
    pick = KvRouter._pick

    def spy(self: KvRouter, request: int, hashes: list[int], tokens: int) -> int:
        seen.append(self.costs(hashes, tokens)[1])
        return pick(self, request, hashes, tokens)

    monkeypatch.setattr(KvRouter, "_pick", spy)
    second = TraceRequest(1.5 * step_ms, 48 * BS, 2, prompt, BS)
    run_one(dynamo_settings(), ClusterOptions(2, "kv"), [first, second], log_dir=None, note=quiet)
    assert sorted(seen[1]) == [0, 32]


def test_a_delayed_feed_leaves_the_router_blind_for_that_long() -> None:
    requests = workload()
    fresh = run_one(
        dynamo_settings(), ClusterOptions(4, "kv"), requests, log_dir=None, note=quiet
    ).summary["cluster"]
    stale = run_one(
        dynamo_settings(),
        ClusterOptions(4, "kv", feed_delay_ms=1e9),
        requests,
        log_dir=None,
        note=quiet,
    ).summary["cluster"]
    assert fresh["router_overlap"] > 0.3
    assert stale["router_overlap"] == 0
    assert stale["router_events_behind"]["stale_decisions"] > 0.9
    assert stale["hit_rate"] < fresh["hit_rate"]


def test_g2_and_g3_hits_count_and_g4_brings_peers_blocks() -> None:
    requests = workload(400)
    tiers = dynamo_settings(g1_blocks=64, g2_blocks=256, g3_blocks=1024, offload_filter="always")
    kv = run_one(tiers, ClusterOptions(4, "kv"), requests, log_dir=None, note=quiet)
    by_tier = kv.summary["cluster"]["hits_by_tier"]
    assert by_tier["G2"] > 0 and by_tier["G3"] >= 0
    no_g4 = run_one(tiers, ClusterOptions(4, "round_robin"), requests, log_dir=None, note=quiet)
    g4 = run_one(
        tiers, ClusterOptions(4, "round_robin", g4=True), requests, log_dir=None, note=quiet
    )
    with_peers = g4.summary["cluster"]
    assert with_peers["hits_by_tier"]["G4"] > 0
    assert with_peers["hit_rate"] > no_g4.summary["cluster"]["hit_rate"]
    assert with_peers["ttft_ms_p50"] <= no_g4.summary["cluster"]["ttft_ms_p50"]


def test_each_worker_logs_its_own_events_and_the_router_index_is_their_fold(
    tmp_path: Path,
) -> None:
    """One SQLite log per worker, owner-only, each replaying to its worker's final state; the
    router's index at the end equals the index folded from the logs, as every view outside
    a worker must."""
    requests = workload()
    outcome = run_one(
        dynamo_settings(g2_blocks=128),
        ClusterOptions(3, "kv"),
        requests,
        log_dir=tmp_path / "run",
        note=quiet,
    )
    assert outcome.replay_ok
    logs = sorted((tmp_path / "run").glob("worker-*.db"))
    assert [p.name for p in logs] == ["worker-0.db", "worker-1.db", "worker-2.db"]
    assert all(p.stat().st_mode & 0o077 == 0 for p in (tmp_path / "run").iterdir())
    assert outcome.index is not None
    assert outcome.index.holders() == fold_logs(tmp_path / "run").holders()
    assert all(w["replay_matches"] for w in outcome.summary["per_worker"])


def test_without_a_log_the_router_index_folds_the_same_events(tmp_path: Path) -> None:
    """The memory feed takes a worker's events as they are emitted, alone or beside the
    worker's log (``worker_sink``): the run and the router's index come out the same with a
    log per worker as without one (copies to G2 included)."""
    requests = workload()
    settings = dynamo_settings(g2_blocks=128)
    logged = run_one(
        settings, ClusterOptions(3, "kv"), requests, log_dir=tmp_path / "run", note=quiet
    )
    bare = run_one(settings, ClusterOptions(3, "kv"), requests, log_dir=None, note=quiet)
    assert logged.index is not None and bare.index is not None
    assert bare.index.holders() == logged.index.holders() != {}
    assert bare.index.last_event_id == logged.index.last_event_id
    for summary in (logged.summary, bare.summary):
        summary["cluster"].pop("wall_s")
        summary["cluster"].pop("log")
        summary["cluster"].pop("replay_matches")
        for worker in summary["per_worker"]:
            for key in ("log", "replay_matches"):
                worker.pop(key, None)
    assert bare.summary == logged.summary


def fold_logs(folder: Path) -> RouterIndex:
    index = RouterIndex()
    for path in sorted(folder.glob("worker-*.db")):
        with EventLog(f"sqlite:///{path}", read_only=True) as log:
            for event in log.read():
                index.apply(event)
    return index


def test_the_zmq_feed_carries_every_event_to_the_router(tmp_path: Path) -> None:
    """The real ZMQ publishers (vLLM's wire format) on loopback ports and the router's
    subscribers: at the end the router's index is the fold of the workers' logs."""
    outcome = run_one(
        dynamo_settings(),
        ClusterOptions(2, "kv", feed="zmq"),
        workload(200),
        log_dir=tmp_path / "run",
        note=quiet,
    )
    assert outcome.replay_ok
    assert outcome.summary["cluster"]["requests"] == 200
    assert "router_events_behind" in outcome.summary["cluster"]
    assert outcome.index is not None
    assert outcome.index.holders() == fold_logs(tmp_path / "run").holders() != {}


def test_the_redis_feed_goes_through_the_shared_registry(
    redis_client: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each worker's RedisPublisher into a namespace of the run's own, the router reading
    the registry's stream: at the end its index is the fold of the workers' logs, and the
    namespace is gone."""
    namespaces: list[str] = []
    close = RedisFeed.close

    def spy(feed: RedisFeed) -> None:
        namespaces.append(feed.namespace)
        close(feed)

    monkeypatch.setattr(RedisFeed, "close", spy)
    outcome = run_one(
        dynamo_settings(),
        ClusterOptions(2, "kv", feed="redis", redis_url="redis://127.0.0.1:6379/0"),
        workload(200),
        log_dir=tmp_path / "run",
        note=quiet,
    )
    assert outcome.summary["cluster"]["requests"] == 200
    assert outcome.index is not None
    assert outcome.index.holders() == fold_logs(tmp_path / "run").holders() != {}
    assert namespaces and namespaces[0].startswith("kvledger-simulate-")
    assert not list(redis_client.scan_iter(match=f"kvl:{{{namespaces[0]}}}*", count=1000))


# -- the command line -------------------------------------------------------------------------


def test_simulate_workers_writes_logs_whatif_reruns_the_cluster(tmp_path: Path) -> None:
    run = tmp_path / "run"
    proc = kvledger(
        "simulate", "--dynamo", "--block-size", "16", "--g1-blocks", "256", "--requests",
        "300", "--workers", "3", "--router", "kv", "--log", str(run), "--json", "--plot",
        str(tmp_path / "cluster.png"), cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["cluster"]["workers"] == 3 and out["cluster"]["replay_matches"] is True
    assert (tmp_path / "cluster.png").read_bytes()[:8] == PNG_MAGIC
    replayed = kvledger("replay", str(run / "worker-1.db"), cwd=tmp_path)
    assert replayed.returncode == 0, replayed.stderr
    whatif = kvledger(
        "whatif", str(run), "--workers", "2,3", "--router", "round_robin,kv", "--json",
        "--plot", str(tmp_path / "whatif.png"), cwd=tmp_path,
    )  # fmt: skip
    assert whatif.returncode == 0, whatif.stderr
    result = json.loads(whatif.stdout)
    assert result["baseline_reproduces"] is True
    assert [(r["cluster"]["workers"], r["cluster"]["router"]) for r in result["runs"]] == [
        (3, "kv"),
        (2, "round_robin"),
        (2, "kv"),
        (3, "round_robin"),
    ]
    assert result["runs"][0]["cluster"]["ttft_ms_p50"] == out["cluster"]["ttft_ms_p50"]
    assert (tmp_path / "whatif.png").read_bytes()[:8] == PNG_MAGIC
    table = kvledger("simulate", "--dynamo", "--block-size", "16", "--g1-blocks", "256",
                     "--requests", "100", "--workers", "2,3", "--router", "round_robin,kv",
                     "--no-log", cwd=tmp_path)  # fmt: skip
    assert table.returncode == 0, table.stderr
    assert table.stdout.count("round_robin") == 2 and table.stdout.count(" kv ") == 2


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--engine", "off"], "needs --engine on"),
        (["--g4"], "--g4: peers send blocks from their G2"),
        (["--router-feed", "redis"], "--router-feed redis needs a Redis server"),
        (["--log", "sqlite:///x.db"], "names a folder"),
        (["--router-config", "overlap_weight=2"], "NAME one of overlap_score_credit"),
        (["--metrics-port", "9999"], "are for one worker"),
        (["--feed-delay-ms", "-1"], "--feed-delay-ms must be >= 0"),
    ],
)
def test_bad_cluster_settings_get_a_clear_error(
    tmp_path: Path,
    args: list[str],
    message: str,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    clean_env: None,
) -> None:
    monkeypatch.chdir(tmp_path)
    try:
        status = main(["simulate", "--requests", "10", "--workers", "2", *args])
    except SystemExit as exc:  # argparse refuses the flag itself
        status = int(exc.code or 0)
    assert status != 0
    assert message in capsys.readouterr().err


def test_whatif_names_a_damaged_cluster_folder(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    run_one(dynamo_settings(), ClusterOptions(2, "kv"), workload(50), log_dir=tmp_path / "run",
            note=quiet)  # fmt: skip
    requests = tmp_path / "run" / "requests.jsonl"
    lines = requests.read_text().splitlines()
    requests.write_text("\n".join([*lines[:3], '{"timestamp": 1}', *lines[3:]]) + "\n")
    assert main(["whatif", str(tmp_path / "run"), "--workers", "3"]) == 2
    assert f"{requests}:4: not a recorded request" in capsys.readouterr().err
    (tmp_path / "run" / "cluster.json").write_text('{"workers": 2}')
    assert main(["whatif", str(tmp_path / "run")]) == 2
    assert "not a cluster manifest" in capsys.readouterr().err
    assert main(["whatif", str(tmp_path / "run"), "--policy", "lru"]) == 2
    assert "a cluster folder is re-run whole" in capsys.readouterr().err


# -- agreement with Dynamo's multi-worker replay ------------------------------------------------


@pytest.mark.parametrize("router", ["round_robin", "kv"])
def test_agrees_with_dynamos_multi_worker_replay(tmp_path: Path, router: str) -> None:
    """The first 800 requests of the Mooncake synthetic trace, 2 workers of 1,024 blocks of
    512 tokens, arrivals twice as fast: TTFT p50/p99, mean TPOT and token reuse within 5% of
    what Dynamo's replay reports, and the same split of requests between the workers (the
    KV router's only tie here is the first request, between two empty workers)."""
    core = pytest.importorskip("dynamo._core", reason="ai-dynamo-runtime is not installed")
    if not SYNTHETIC_TRACE.is_file():
        pytest.skip(f"the Mooncake trace is not at {SYNTHETIC_TRACE} (set KVLEDGER_SHARED_DATA)")
    rows = SYNTHETIC_TRACE.read_text().splitlines()[:800]
    trace = tmp_path / "slice.jsonl"
    trace.write_text("\n".join(rows) + "\n")
    result = core.run_mocker_trace_replay(
        [str(trace)],
        extra_engine_args={"engine": {"num_gpu_blocks": 1024, "block_size": 512}},
        num_workers=2,
        router_mode="kv_router" if router == "kv" else "round_robin",
        arrival_speedup_ratio=2.0,
        capture_per_request=True,
    )
    theirs = result.summary
    their_split = sorted(
        sum(1 for r in result.per_request if r["decode_worker_idx"] == w) for w in (0, 1)
    )
    requests = [r._replace(arrival_ms=r.arrival_ms / 2) for r in load_mooncake(trace)]
    ours = run_one(
        dynamo_settings(block_size=512, g1_blocks=1024, max_num_batched_tokens=8192),
        ClusterOptions(2, router),
        requests,
        log_dir=None,
        note=quiet,
    ).summary["cluster"]
    pairs = {
        "ttft p50": (ours["ttft_ms_p50"], theirs["median_ttft_ms"]),
        "ttft p99": (ours["ttft_ms_p99"], theirs["p99_ttft_ms"]),
        "tpot": (ours["tpot_ms_mean"], theirs["mean_tpot_ms"]),
        "reuse": (ours["token_hit_rate_all_admissions"], theirs["prefix_cache_reused_ratio"]),
    }
    off = {k: (a, b) for k, (a, b) in pairs.items() if abs(a - b) > 0.05 * abs(b)}
    assert not off, f"differ from Dynamo's by more than 5%: {json.dumps(off)}"
    assert sorted(ours["routed"]) == their_split


def test_the_random_router_spreads_requests_evenly() -> None:
    rng = random.Random(0)
    router = router_module.RandomRouter(4, seed=rng.randrange(1 << 30))
    picks = [router.route(i, [], 1) for i in range(4000)]
    assert all(900 < picks.count(w) < 1100 for w in range(4))
