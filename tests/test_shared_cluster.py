"""The sharded shared registry on a real Redis Cluster (3 masters, 3 replicas, started here).

Three ``kvledger worker`` processes publish to one namespace split over 3 shards. The index must
equal the union of their replayed logs, with no event applied twice, through a master killed
with SIGKILL mid-run (its replica takes over; events it had not received are re-sent from the
workers' logs) and through a slot moved to another master mid-run.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from functools import partial
from itertools import pairwise
from pathlib import Path
from typing import cast

import pytest
import redis
import redis_cluster
from event_streams import prompt_pool, worker_events
from redis.crc import key_slot
from redis_cluster import LocalCluster
from services import REDIS_URL, wait_until
from stream_router import stream_router
from worker_kills import kill_rounds, worker_command

from kvledger.events.log import EventLog
from kvledger.events.shared import SharedRegistry, connect
from kvledger.events.shared.subscribe import decode_stream_entry
from kvledger.events.types import AnyEvent, Tier
from kvledger.registry.index import holders_from_state
from kvledger.registry.state import RegistryState
from kvledger.tiers.remote.directory import AgentCard, BlockEntry, Region, RemoteDirectory

pytestmark = [pytest.mark.redis, pytest.mark.slow]
WORKERS = (1, 2, 3)
SHARDS = 3


def _start_cluster() -> LocalCluster:
    why = redis_cluster.available()
    if why is not None:
        pytest.skip(f"no Redis Cluster can be started here: {why}")
    return LocalCluster().start()


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    started = _start_cluster()
    yield started
    started.stop()


@pytest.fixture
def own_cluster() -> Iterator[LocalCluster]:
    """A cluster for one test that breaks it."""
    started = _start_cluster()
    yield started
    started.stop()


@pytest.fixture
def procs() -> Iterator[dict[int, subprocess.Popen[str]]]:
    running: dict[int, subprocess.Popen[str]] = {}
    yield running
    for proc in running.values():
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def _spawn(
    url: str, namespace: str, worker: int, log: Path, requests: int
) -> subprocess.Popen[str]:
    cmd = [
        sys.executable, "-m", "kvledger.cli", "worker",
        "--worker-id", str(worker), "--redis-url", url, "--namespace", namespace,
        "--shards", str(SHARDS), "--log", str(log), "--lease-ttl", "3",
        "--blocks", "256", "--block-size", "16", "--seed", "7",
        "--requests", str(requests), "--interval", "0.004", "--linger",
    ]  # fmt: skip
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)


def _done(proc: subprocess.Popen[str]) -> dict[str, object]:
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line, f"worker exited early with {proc.wait()}"
    report: dict[str, object] = json.loads(line)
    assert report["done"] and report["drained"], report
    return report


def _run_workers(
    cluster: LocalCluster,
    namespace: str,
    tmp_path: Path,
    procs: dict[int, subprocess.Popen[str]],
    mid_run: Callable[[SharedRegistry], None],
    requests: int = 400,
) -> tuple[SharedRegistry, dict[int, dict[str, object]], dict[int, int]]:
    """Start the workers, do ``mid_run`` once each applied some events, and check the end:
    the index is the union of the replayed logs and every event was applied once. Returns the
    registry, the workers' reports and each one's applied id right after ``mid_run``."""
    reg = SharedRegistry(connect(cluster.url), namespace, shards=SHARDS)
    logs = {w: tmp_path / f"w{w}.db" for w in WORKERS}
    for w in WORKERS:
        procs[w] = _spawn(cluster.url, namespace, w, logs[w], requests=requests)
    wait_until(lambda: all(reg.applied_event_id(w) >= 40 for w in WORKERS), "first events", 60)
    mid_run(reg)
    after = {w: reg.applied_event_id(w) for w in WORKERS}
    reports = {w: _done(procs[w]) for w in WORKERS}
    last = {w: int(str(reports[w]["last_event_id"])) for w in WORKERS}
    # A fail-over may lose writes the old master had confirmed; heartbeats find and re-send them
    wait_until(lambda: all(reg.applied_event_id(w) == last[w] for w in WORKERS), "re-sync", 30)
    events: list[AnyEvent] = []
    for path in logs.values():
        with EventLog(str(path), read_only=True) as log:
            events.extend(log.read())
    replayed = RegistryState.from_events(sorted(events, key=lambda e: (e.worker_id, e.event_id)))
    assert reg.snapshot() == holders_from_state(replayed)
    for w in WORKERS:
        assert reg.applied_count(w) == last[w] + 1  # no shard applied an event twice
    # Per worker, its stream's events between purge notices: a worker whose lease lapsed
    # (an outage longer than the lease) is purged and sends its log again from event 0, so
    # each run since a notice, and the last one whole, holds each event once, in order
    runs: dict[int, list[list[int]]] = {w: [[]] for w in WORKERS}
    baselines: list[str] = []
    for stream in reg.stream_keys:
        entries = cast(list[tuple[bytes, dict[bytes, bytes]]], reg.client.xrange(stream))
        for _id, fields in entries:
            if b"e" in fields:
                for event in decode_stream_entry(fields[b"e"]):
                    runs[event.worker_id][-1].append(event.event_id)
            elif b"purged" in fields:
                runs[int(fields[b"w"])].append([])
            else:
                baselines.append(stream)
    assert not baselines  # no reset here
    expected = {
        w: [list(range(len(ids))) for ids in r[:-1]] + [list(range(last[w] + 1))]
        for w, r in runs.items()
    }
    assert runs == expected, (
        {w: list(map(_stream_damage, runs[w], expected[w])) for w in WORKERS},
        {w: reports[w]["reconciled"] for w in WORKERS},
    )
    router, subscriber = stream_router(reg)
    while subscriber.poll(block_ms=10):
        pass
    assert router.holders() == reg.snapshot()  # a router's fold of the streams
    for proc in procs.values():
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
    return reg, reports, after


def _stream_damage(ids: list[int], wanted: list[int]) -> dict[str, list[int]]:
    """The ids a run of a stream lacks, holds twice, and where its order breaks."""
    return {
        "missing": sorted(set(wanted) - set(ids))[:20],
        "twice": sorted({i for i in ids if ids.count(i) > 1})[:20],
        "out_of_order_at": [i for i, (a, b) in enumerate(pairwise(ids)) if b <= a][:20],
    }


def test_three_workers_on_a_cluster_equal_their_logs(
    cluster: LocalCluster, tmp_path: Path, procs: dict[int, subprocess.Popen[str]]
) -> None:
    namespace = f"union-{uuid.uuid4().hex[:8]}"
    reg, _, _ = _run_workers(cluster, namespace, tmp_path, procs, mid_run=lambda _reg: None)
    masters = {cluster.master_of(key_slot(k.index.encode())) for k in reg.shard_keys}
    assert len(masters) == SHARDS  # the shards sit on three different masters
    hashes = list(reg.snapshot())
    assert dict(zip(hashes, reg.who_has(hashes), strict=True)) == reg.snapshot()
    reg.delete_namespace()


def test_connect_picks_the_client_and_the_directory_works_on_a_cluster(
    cluster: LocalCluster,
) -> None:
    assert isinstance(connect(cluster.url), redis.RedisCluster)
    assert type(connect(REDIS_URL)) is redis.Redis
    assert type(connect("redis://127.0.0.1:1/0")) is redis.Redis  # unreachable: plain, retried
    namespace = f"dir-{uuid.uuid4().hex[:8]}"
    client = connect(cluster.url)
    reg = SharedRegistry(client, namespace, shards=SHARDS)
    directory = RemoteDirectory(client, namespace)
    card = AgentCard(5, "agent", b"md", "shape", 10, (Region(Tier.G2, "DRAM", 0, 4096, 4, 10),))
    reg.heartbeat(5)
    directory.publish_card(card)
    directory.update_blocks(5, [(11, BlockEntry(Tier.G2, 1, 111))], clear=True)
    assert directory.lookup(5, [11, 12]) == (card, [BlockEntry(Tier.G2, 1, 111), None])
    reg.release(5)  # the lease goes: the card is no longer trusted
    assert directory.lookup(5, [11])[0] is None
    reg.delete_namespace()


def _getkeys_asked(client: redis.RedisCluster) -> int:
    """``COMMAND GETKEYS`` calls the cluster's masters have answered so far."""
    asked = 0
    for node in client.get_primaries():  # type: ignore[no-untyped-call]
        stats = cast(dict[str, dict[str, int]], client.info("commandstats", target_nodes=node))
        asked += int(stats.get("cmdstat_command|getkeys", {}).get("calls", 0))
    return asked


def test_the_transport_routes_by_the_slot_map_and_asks_no_node_for_keys(
    cluster: LocalCluster,
) -> None:
    """Applies, read-only ``who_has`` calls, purges and plain reads of shards that sit on
    different masters each reach their shard's node and agree with the fold, and no node is
    asked ``COMMAND GETKEYS`` (redis-py's cluster pipeline asks its default node that for
    every script call: a round trip more, a permission the ACL roles lack, and a failure
    while that node is down)."""
    client = connect(cluster.url)
    assert isinstance(client, redis.RedisCluster)
    reg = SharedRegistry(client, f"route-{uuid.uuid4().hex[:8]}", shards=SHARDS)
    nodes = {
        client.get_node_from_key(k.index).name  # type: ignore[no-untyped-call]
        for k in reg.shard_keys
    }
    assert len(nodes) > 1
    streams = {w: worker_events(31, w, 120, prompt_pool(31)) for w in (1, 2)}
    asked = _getkeys_asked(client)
    for w, events in streams.items():
        for start in range(0, len(events), 50):
            assert reg.apply(w, events[start : start + 50]).gap_at is None
    every = [e for events in streams.values() for e in events]
    expected = holders_from_state(RegistryState.from_events(every))
    assert reg.snapshot() == expected
    hashes = sorted(expected)
    assert reg.who_has(hashes) == [expected[h] for h in hashes]
    assert [reg.applied_event_id(w) for w in streams] == [len(e) - 1 for e in streams.values()]
    assert reg.workers() == set(streams) and reg.heartbeat(1)
    assert reg.release(2) > 0 and reg.purge_expired() == {}
    reg.sweep()
    assert _getkeys_asked(client) == asked
    reg.delete_namespace()


def test_a_slot_moved_mid_run_loses_nothing(
    cluster: LocalCluster, tmp_path: Path, procs: dict[int, subprocess.Popen[str]]
) -> None:
    """``redis-cli --cluster reshard`` moves a master's lowest slot; the namespace is picked so
    that this slot holds its shard 0, which is then moved key by key while workers apply."""
    masters = sorted(cluster.masters())
    source, target = masters[1], masters[0]
    slot = cluster.lowest_slot(source)
    namespace = next(
        name
        for name in (f"reshard-{uuid.uuid4().hex[:6]}-{i}" for i in range(1_000_000))
        if key_slot(name.encode()) == slot
    )

    def move(reg: SharedRegistry) -> None:
        cluster.reshard(source, target)
        assert cluster.master_of(key_slot(reg.keys.index.encode())) == target

    reg, reports, after = _run_workers(
        cluster, namespace, tmp_path, procs, mid_run=move, requests=800
    )
    assert any(after[w] < int(str(reports[w]["last_event_id"])) for w in WORKERS)  # mid-run
    reg.delete_namespace()


def test_a_master_killed_mid_run_fails_over_and_workers_resync(
    own_cluster: LocalCluster, tmp_path: Path, procs: dict[int, subprocess.Popen[str]]
) -> None:
    namespace = f"failover-{uuid.uuid4().hex[:8]}"

    def kill(reg: SharedRegistry) -> None:
        """The replica's link is cut first, so the master dies with writes it confirmed that
        the promoted replica never received."""
        slot = key_slot(reg.shard_keys[1].index.encode())
        dead = own_cluster.master_of(slot)
        replica = own_cluster.replica_of(dead)
        before = {w: reg.applied_event_id(w) for w in WORKERS}
        own_cluster.cut_replica(replica)
        wait_until(
            lambda: all(reg.applied_event_id(w) > before[w] + 20 for w in WORKERS),
            "writes the replica misses",
            30,
        )
        own_cluster.kill_9(dead)
        assert own_cluster.wait_promoted(dead, slot) == replica

    _, reports, _ = _run_workers(
        own_cluster, namespace, tmp_path, procs, mid_run=kill, requests=800
    )
    assert any(int(str(r["outages"])) > 0 for r in reports.values())  # they saw it go
    assert any(int(str(r["caught_up"])) > 0 for r in reports.values())  # re-read from logs


def test_registry_equals_the_log_after_each_kill_on_a_cluster(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    """A worker SIGKILLed at 20 random moments while it publishes to a namespace split over
    the cluster's masters: after each restart its entries in every shard equal its log's
    replay (tests/worker_kills.py)."""
    namespace = f"kill-{uuid.uuid4().hex[:8]}"
    log = tmp_path / "w.db"
    command = partial(worker_command, cluster.url, namespace, 60, log, shards=SHARDS)
    reg = SharedRegistry(connect(cluster.url), namespace, shards=SHARDS)
    try:
        rounds = kill_rounds(reg, command, 60, log, rounds=20, seed=2)
        assert rounds[-1].last_event_id > rounds[0].last_event_id
    finally:
        reg.delete_namespace()
