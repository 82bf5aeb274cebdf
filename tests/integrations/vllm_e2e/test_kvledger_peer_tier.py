"""kvledger's G4 tier under vLLM's tiering layer: two worker processes, real Redis, real NIXL
agents (UCX over loopback), real bytes (runs in the vLLM test venv).

Each worker is vLLM's ``TieringOffloadingManager`` with vLLM's CPU tier as primary and
kvledger's ``KvledgerPeerTier`` as its secondary tier. Worker A (the owner, a separate process:
this file run as a script) stores blocks: vLLM cascades them into A's exported pool, which A
logs and publishes. Worker B (the test process) looks the same keys up: its CPU tier misses,
the shared registry names A, and vLLM's promotion reads them over NIXL into B's CPU rows,
byte-identical. A block A evicts (or overwrites) between B's lookup and B's read is a miss for
that key only, and B's engine goes on. Each worker's log replays to its live state.

Run as ``python test_kvledger_peer_tier.py owner NAMESPACE DIR`` it is the owner: one JSON
answer per command on stdin (``store FIRST COUNT``, ``evict ID``, ``overwrite ID``, ``state``,
``quit``).
"""

from __future__ import annotations

import json
import os
import selectors
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from unittest.mock import MagicMock

import numpy as np
import pytest
from vllm.v1.kv_offload.base import (
    LookupResult,
    OffloadKey,
    ReqContext,
    ScheduleEndContext,
    make_offload_key,
)
from vllm.v1.kv_offload.tiering.manager import (
    CPUPrimaryTierOffloadingManager,
    TieringOffloadingManager,
)

from kvledger import replay
from kvledger.integrations.vllm.keys import key_hash
from kvledger.integrations.vllm.peer_tier import KvledgerPeerTier
from kvledger.tiers.remote import nixl_unavailable_reason

REDIS_URL = os.environ.get("KVLEDGER_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
ROW = 4096
CPU_CHUNKS = 16
POOL = 8  # each worker's exported pool
OWNER, READER = 1, 2
ANSWER = "@answer "
STEP = ScheduleEndContext(new_req_ids=[], preempted_req_ids=())

pytestmark = pytest.mark.skipif(
    nixl_unavailable_reason() is not None, reason=str(nixl_unavailable_reason())
)


def key(i: int) -> OffloadKey:
    return make_offload_key(f"block-{i}".encode(), 0)


def row(i: int) -> np.ndarray:
    """The bytes of block ``i`` as the owner computed them."""
    return np.random.default_rng(i).integers(0, 255, ROW, dtype=np.uint8)


class Worker:
    """vLLM's tiering manager over a CPU tier in real memory, with kvledger's peer tier."""

    def __init__(self, worker_id: int, namespace: str, folder: Path) -> None:
        raw = np.zeros(CPU_CHUNKS * ROW + 4096, dtype=np.uint8)
        start = -raw.ctypes.data % 4096
        self.rows = raw[start : start + CPU_CHUNKS * ROW].reshape(CPU_CHUNKS, ROW)
        region = MagicMock()
        region.create_kv_memoryview.return_value = memoryview(self.rows)
        self.cpu = CPUPrimaryTierOffloadingManager(CPU_CHUNKS, mmap_region=region)
        spec = MagicMock()
        spec.kv_events_config.enable_kv_cache_events = False
        self.log_url = f"sqlite:///{folder / f'w{worker_id}.db'}"
        self.tier = KvledgerPeerTier(
            spec,
            self.cpu.get_kv_memoryview(),
            "KvledgerPeerTier",
            num_blocks=POOL,
            worker_id=worker_id,
            log_url=self.log_url,
            redis_url=REDIS_URL,
            redis_namespace=namespace,
            timeout_s=2.0,
        )
        self.manager = TieringOffloadingManager(self.cpu, [self.tier])
        self.requests = 0

    def settle(self) -> None:
        """Steps until every job is done and what the tier made is in Redis."""
        for _ in range(2000):
            self.manager.on_schedule_end(STEP)
            if not self.manager.has_pending_work():
                break
            time.sleep(0.002)
        self.tier.flush_log()
        publisher = self.tier.worker.publisher
        assert publisher is not None and publisher.wait_applied(10)
        assert self.tier.parts.exporter.flush(10)

    def store(self, ids: list[int]) -> None:
        ctx = self.request()
        keys = [key(i) for i in ids]
        out = self.manager.prepare_store(keys, ctx)
        assert out is not None
        for k, chunk in zip(out.keys_to_store, out.store_spec.chunk_ids, strict=True):
            self.rows[chunk] = row(ids[keys.index(k)])
        if out.keys_to_store:
            self.manager.complete_store(out.keys_to_store, ctx)
        self.manager.on_request_finished(ctx)
        self.settle()

    def request(self) -> ReqContext:
        self.requests += 1
        ctx = ReqContext(req_id=f"w{self.tier.worker.worker_id}-r{self.requests}")
        self.manager.on_new_request(ctx)
        return ctx

    def close(self) -> None:
        self.settle()
        self.manager.shutdown()


# -- the owner process ---------------------------------------------------------------------


def serve(commands: dict[str, Callable[..., dict[str, Any]]], close: Callable[[], None]) -> None:
    """The owner's side of ``Owner``: each line on stdin is a command and its words, each
    answered with one JSON line after ``ANSWER``; ``quit`` closes and ends."""

    def answer(fields: dict[str, Any]) -> None:
        print(ANSWER + json.dumps(fields), flush=True)

    answer({"ready": True})
    for line in sys.stdin:
        words = line.split()
        if not words:
            continue
        if words[0] == "quit":
            close()
            answer({"bye": True})
            return
        answer(commands[words[0]](*words[1:]))


def owner_main(namespace: str, folder: Path) -> None:
    worker = Worker(OWNER, namespace, folder)

    def store(first: str, count: str) -> dict[str, Any]:
        worker.store(list(range(int(first), int(first) + int(count))))
        return {"held": sorted(worker.tier.pool.resident_blocks())}

    def evict(block: str) -> dict[str, Any]:  # dropped from the exported pool, as eviction does
        assert worker.tier.pool.remove([key_hash(key(int(block)))])
        worker.settle()
        return {"ok": True}

    def overwrite(block: str) -> dict[str, Any]:  # its slot reused before the directory knows
        slot = worker.tier.pool.lookup(key_hash(key(int(block))))
        assert slot is not None
        worker.tier._g2_rows[slot] = 7
        return {"ok": True}

    def state() -> dict[str, Any]:
        worker.settle()
        return {"replays": replay(worker.log_url) == worker.tier.worker.state()}

    commands = {"store": store, "evict": evict, "overwrite": overwrite, "state": state}
    serve(commands, worker.close)


class Owner:
    """Worker A in a process of its own: ``script`` run as ``script owner NAMESPACE DIR``, one
    JSON answer (a line after ``ANSWER``) per command on its stdin."""

    def __init__(self, namespace: str, folder: Path, script: str = __file__) -> None:
        self.stderr = open(folder / "owner.stderr", "w+")  # noqa: SIM115
        root = str(Path(script).resolve().parents[2])  # vLLM's test tree: tests.* imports
        path = os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))
        self.proc = subprocess.Popen(
            [sys.executable, script, "owner", namespace, str(folder)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.stderr,
            text=True,
            env={**os.environ, "NIXL_LOG_LEVEL": "WARN", "PYTHONPATH": path},
        )
        self.read(60)

    def read(self, timeout: float) -> dict[str, Any]:
        assert self.proc.stdout is not None
        sel = selectors.DefaultSelector()
        sel.register(self.proc.stdout, selectors.EVENT_READ)
        deadline = time.monotonic() + timeout
        while True:
            if not sel.select(max(0.0, deadline - time.monotonic())):
                self.stderr.seek(0)
                raise TimeoutError(f"the owner said nothing in {timeout} s:\n{self.stderr.read()}")
            line = self.proc.stdout.readline()
            if not line:
                self.stderr.seek(0)
                raise RuntimeError(f"the owner exited ({self.proc.poll()}):\n{self.stderr.read()}")
            if line.startswith(ANSWER):
                return dict(json.loads(line[len(ANSWER) :]))

    def ask(self, *words: object) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(" ".join(map(str, words)) + "\n")
        self.proc.stdin.flush()
        return self.read(30)

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.ask("quit")
                self.proc.wait(10)
            except (OSError, TimeoutError, RuntimeError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait(10)
        self.stderr.close()


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Owner, Worker]]:
    """One owner and one reader for the module (starting a worker process with vLLM and
    NIXL takes seconds); each test uses block ids of its own."""
    tmp_path = tmp_path_factory.mktemp("g4")
    redis = pytest.importorskip("redis")
    try:
        redis.Redis.from_url(REDIS_URL).ping()
    except redis.RedisError as exc:
        pytest.skip(f"no Redis at {REDIS_URL}: {exc}")
    namespace = f"kvl-vllm-g4-{uuid.uuid4().hex[:8]}"
    owner = Owner(namespace, tmp_path)
    reader = Worker(READER, namespace, tmp_path)
    try:
        yield owner, reader
    finally:
        reader.close()
        owner.close()
        client = redis.Redis.from_url(REDIS_URL)
        for k in client.scan_iter(match=f"kvl:{{{namespace}}}*"):
            client.delete(k)


def promote(reader: Worker, ids: list[int]) -> tuple[ReqContext, list[LookupResult]]:
    """B's scheduler: look the keys up (promotions start), end the step (they are read), and
    look again until none is pending."""
    ctx = reader.request()
    first = [reader.manager.lookup(key(i), ctx) for i in ids]
    for _ in range(2000):
        reader.manager.on_schedule_end(STEP)
        results = [reader.manager.lookup(key(i), ctx) for i in ids]
        if LookupResult.HIT_PENDING not in results and LookupResult.RETRY not in results:
            return ctx, results
        time.sleep(0.002)
    raise AssertionError(f"promotions never finished: {first}")


def test_worker_b_loads_worker_as_blocks_over_nixl(pair: tuple[Owner, Worker]) -> None:
    owner, reader = pair
    held = owner.ask("store", 0, 4)["held"]
    assert held == sorted(key_hash(key(i)) for i in range(4))
    ctx, results = promote(reader, [0, 1, 2, 3])
    assert results == [LookupResult.HIT] * 4
    spec = reader.manager.prepare_load([key(i) for i in range(4)], ctx)
    for i, chunk in enumerate(spec.chunk_ids):
        assert np.array_equal(reader.rows[chunk], row(i)), f"block {i}"
    reader.manager.complete_load([key(i) for i in range(4)], ctx)
    reader.manager.on_request_finished(ctx)
    # B's exported pool holds them now too: read from A, named Onboarded(G4 -> G2)
    assert set(reader.tier.pool.resident_blocks()) == set(held)
    reader.settle()
    assert replay(reader.log_url) == reader.tier.worker.state()
    assert owner.ask("state")["replays"]


@pytest.mark.parametrize("how", ["evict", "overwrite"])
def test_a_block_a_drops_between_bs_lookup_and_read_is_a_miss_and_b_goes_on(
    pair: tuple[Owner, Worker], how: str
) -> None:
    owner, reader = pair
    base = 10 if how == "evict" else 20
    owner.ask("store", base, 3)
    ctx = reader.request()
    ids = [base, base + 1, base + 2]
    # B's lookups find A holding all three; the promotions wait for the step's end
    assert [reader.manager.lookup(key(i), ctx) for i in ids] == [LookupResult.HIT_PENDING] * 3
    owner.ask(how, base + 1)  # A drops the middle block (or reuses its slot) before B reads
    for _ in range(2000):
        reader.manager.on_schedule_end(STEP)
        if not reader.manager.has_pending_work():
            break
        time.sleep(0.002)
    results = [reader.manager.lookup(key(i), ctx) for i in ids]
    assert results[0] is LookupResult.HIT and results[2] is LookupResult.HIT
    assert results[1] is not LookupResult.HIT  # a miss: B recomputes it
    spec = reader.manager.prepare_load([key(base), key(base + 2)], ctx)
    assert np.array_equal(reader.rows[spec.chunk_ids[0]], row(base))
    assert np.array_equal(reader.rows[spec.chunk_ids[1]], row(base + 2))
    reader.manager.complete_load([key(base), key(base + 2)], ctx)
    reader.manager.on_request_finished(ctx)
    if how == "overwrite":  # the eviction that reused the slot reaches the directory
        owner.ask("evict", base + 1)
    reader.settle()  # a promotion the last lookups started again ends (as a miss) too
    # B's engine goes on: it stores the block itself, and its next request finds it locally
    reader.store([base + 1])
    again = reader.request()
    assert reader.manager.lookup(key(base + 1), again) is LookupResult.HIT
    reader.manager.on_request_finished(again)
    reader.settle()
    assert replay(reader.log_url) == reader.tier.worker.state()
    assert owner.ask("state")["replays"]


def test_nobody_holds_it_is_a_plain_miss(pair: tuple[Owner, Worker]) -> None:
    _, reader = pair
    ctx = reader.request()
    assert reader.manager.lookup(key(999), ctx) is LookupResult.MISS


def test_the_peer_tier_refuses_settings_it_cannot_run_with(tmp_path: Path) -> None:
    spec = MagicMock()
    view = memoryview(np.zeros((4, ROW), dtype=np.uint8))
    with pytest.raises(ValueError, match="log_url and redis_url"):
        KvledgerPeerTier(spec, view, "KvledgerPeerTier", num_blocks=4)
    with pytest.raises(ValueError, match="num_blocks"):
        KvledgerPeerTier(spec, view, "KvledgerPeerTier", num_blocks=0)


def test_the_peer_tier_listens_where_kvledger_g4_interface_says(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    redis = pytest.importorskip("redis")
    try:
        redis.Redis.from_url(REDIS_URL).ping()
    except redis.RedisError as exc:
        pytest.skip(f"no Redis at {REDIS_URL}: {exc}")
    monkeypatch.setenv("KVLEDGER_G4_INTERFACE", "all")  # every device (the default: lo)
    spec = MagicMock()
    spec.kv_events_config.enable_kv_cache_events = False
    view = memoryview(np.zeros((4, ROW), dtype=np.uint8))
    tier = KvledgerPeerTier(
        spec,
        view,
        "KvledgerPeerTier",
        num_blocks=4,
        worker_id=77,
        log_url=f"sqlite:///{tmp_path / 'w77.db'}",
        redis_url=REDIS_URL,
        redis_namespace=f"kvl-vllm-g4-{uuid.uuid4().hex[:8]}",
    )
    try:
        assert tier.parts.agent.devices is None  # UCX's own default: every device
    finally:
        tier.shutdown()


if __name__ == "__main__" and sys.argv[1:2] == ["owner"]:
    owner_main(sys.argv[2], Path(sys.argv[3]))
