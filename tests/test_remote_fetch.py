"""G4 end to end: two worker processes, real Redis, real NIXL (UCX over loopback), real bytes.

The owner (worker 1) is a separate process (this file run as a script): a BlockManager whose
G2 is registered with its NIXL agent and exported through the remote directory, publishing its
events to the shared registry. The reader (worker 2) is a BlockManager in the test process that
finds the owner through ``who_has``, READs the blocks into its G2, checks their checksums and
onboards them to G1. Every failure (block evicted after the lookup, bytes that are not the
block, owner killed in the middle of a read) must end as a miss with nothing registered.

Run as ``python tests/test_remote_fetch.py owner ...`` it is the owner: it answers one JSON
line per command read from stdin (``prompt``, ``evict``, ``overwrite``, ``quit``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import selectors
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import pytest
import redis
import torch
from redis.backoff import NoBackoff
from redis.retry import Retry
from services import REDIS_URL

from kvledger.config import Settings
from kvledger.events.log import EventLog
from kvledger.events.shared.registry import SharedRegistry
from kvledger.events.types import AnyEvent, Onboarded, Stored, Tier
from kvledger.manager import BlockManager
from kvledger.tiers import HostTier
from kvledger.tiers.remote import (
    BlockExporter,
    RemoteAgent,
    RemoteDirectory,
    RemoteFetcher,
    nixl_unavailable_reason,
)

BLOCK = 4
OWNER, READER = 1, 2
LEASE_S = 5.0
TIMEOUT_S = 2.0
ANSWER = "@answer "  # NIXL logs to stdout too: the owner's answers carry this prefix

pytestmark = [
    pytest.mark.redis,
    pytest.mark.skipif(
        nixl_unavailable_reason() is not None, reason=str(nixl_unavailable_reason())
    ),
    pytest.mark.timeout(90),
]


def worker_settings(tmp: Path, worker_id: int, **extra: Any) -> Settings:
    return Settings.load(
        block_size=BLOCK,
        num_layers=2,
        outer_dim=2,
        inner_dim=64,
        dtype="float32",
        g1_blocks=16,
        g2_blocks=32,
        eviction_policy="lru",
        worker_id=worker_id,
        data_dir=tmp / f"w{worker_id}",
        event_log_url=f"sqlite:///{tmp / f'w{worker_id}.db'}",
        **extra,
    )


def prompt_tokens(prompt: int, blocks: int) -> list[int]:
    return [prompt * 10_000 + t for t in range(blocks * BLOCK)]


def block_bytes(sequence_hash: int, manager: BlockManager) -> torch.Tensor:
    """The KV the owner computes for a block: random, seeded by the block's hash."""
    gen = torch.Generator().manual_seed(sequence_hash & 0x7FFF_FFFF_FFFF_FFFF)
    shape = manager.shape
    return torch.rand((shape.num_layers, *shape.layer_shape), generator=gen)


def g1_block(manager: BlockManager, slot: int) -> torch.Tensor:
    return torch.stack(manager.g1.layout.block(slot))


# -- the owner process ---------------------------------------------------------------------


def owner_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--namespace", required=True)
    p.add_argument("--dir", type=Path, required=True)
    args = p.parse_args(argv)
    settings = worker_settings(args.dir, OWNER)
    client = redis.Redis.from_url(REDIS_URL)
    shared = SharedRegistry(client, args.namespace, lease_ttl_s=LEASE_S)
    log = EventLog(settings.log_url)
    from kvledger.events.shared.publish import RedisPublisher

    publisher = RedisPublisher(shared, OWNER, log=log).start()
    manager = BlockManager(settings, event_log=log)  # the publisher takes the log's commits
    g2 = cast(HostTier, manager.tier(Tier.G2))  # G2 is host memory
    agent = RemoteAgent(OWNER)
    agent.register(g2)
    directory = RemoteDirectory(client, args.namespace, ttl_s=LEASE_S)
    exporter = BlockExporter(directory, agent.card(manager.shape), g2)
    manager.export_g2(exporter)
    shared.heartbeat(OWNER, publisher.token)
    sequences: dict[int, Any] = {}

    def settle() -> None:
        manager.wait_idle(10)
        exporter.flush(10)
        publisher.wait_applied(10)

    def answer(**fields: Any) -> None:
        print(ANSWER + json.dumps(fields), flush=True)

    answer(ready=True, agent=agent.name, pid=os.getpid())
    for line in sys.stdin:
        cmd, *rest = line.split()
        if cmd == "prompt":  # compute a prompt's blocks on G1; write-through puts them on G2
            prompt, blocks = int(rest[0]), int(rest[1])
            seq = manager.sequence(prompt_tokens(prompt, blocks))
            sequences[prompt] = seq
            slots = manager.allocate(blocks)
            for slot, block in zip(slots, seq.blocks, strict=True):
                for layer, view in enumerate(manager.g1.layout.block(slot)):
                    view.copy_(block_bytes(block.sequence_hash, manager)[layer])
            held = manager.register(slots, seq, start=0)
            manager.wait_idle(10)
            manager.release(held)
            settle()
            answer(ok=True, hashes=seq.sequence_hashes)
        elif cmd == "evict":  # drop blocks from G2 (the bytes stay in their slots)
            prompt, first = int(rest[0]), int(rest[1])
            gone = manager.remove(Tier.G2, sequences[prompt].sequence_hashes[first:])
            settle()
            answer(ok=True, removed=len(gone))
        elif cmd == "overwrite":  # other bytes in a block's slot, as if it were reused
            prompt, index = int(rest[0]), int(rest[1])
            slot = cast(int, manager.slot_of(Tier.G2, sequences[prompt].sequence_hashes[index]))
            g2.layout.tensor[slot].fill_(-1.0)
            answer(ok=True, slot=slot)
        elif cmd == "quit":
            break
    exporter.close()
    publisher.stop()
    manager.close()
    agent.close()
    return 0


# -- the test side -------------------------------------------------------------------------


class Owner:
    """The owner process and a line-by-line JSON conversation with it."""

    def __init__(self, namespace: str, tmp: Path, env: dict[str, str] | None = None) -> None:
        self.stderr = open(tmp / "owner.stderr", "w+")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "owner", "--namespace", namespace, "--dir", str(tmp)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.stderr,
            text=True,
            env={**os.environ, "NIXL_LOG_LEVEL": "WARN", **(env or {})},
        )
        self.hello = self._read(60)

    def _read(self, timeout: float) -> dict[str, Any]:
        assert self.proc.stdout is not None
        sel = selectors.DefaultSelector()
        sel.register(self.proc.stdout, selectors.EVENT_READ)
        deadline = time.monotonic() + timeout
        while True:
            if not sel.select(max(0.0, deadline - time.monotonic())):
                self.stderr.seek(0)
                raise TimeoutError(f"owner said nothing in {timeout} s:\n{self.stderr.read()}")
            line = self.proc.stdout.readline()
            if not line:
                self.stderr.seek(0)
                raise RuntimeError(f"owner exited ({self.proc.poll()}):\n{self.stderr.read()}")
            if line.startswith(ANSWER):
                return dict(json.loads(line[len(ANSWER) :]))

    def ask(self, *words: object, timeout: float = 30) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(" ".join(map(str, words)) + "\n")
        self.proc.stdin.flush()
        return self._read(timeout)

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.write("quit\n")
                self.proc.stdin.flush()
                self.proc.wait(10)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait(10)
        self.stderr.close()


class Reader:
    """Worker 2 in this process: a BlockManager, its NIXL agent and a fetcher."""

    def __init__(self, namespace: str, tmp: Path, **settings: Any) -> None:
        from prometheus_client import CollectorRegistry

        self.client = redis.Redis.from_url(REDIS_URL)
        self.shared = SharedRegistry(self.client, namespace, lease_ttl_s=LEASE_S)
        self.events: list[AnyEvent] = []
        self.manager = BlockManager(
            worker_settings(tmp, READER, **settings), sinks=[self.events.append]
        )
        self.g2 = cast(HostTier, self.manager.tier(Tier.G2))  # G2 is host memory
        self.agent = RemoteAgent(READER)
        self.agent.register(self.g2)
        self.metrics = CollectorRegistry()
        self.fetcher = RemoteFetcher(
            self.agent,
            RemoteDirectory(self.client, namespace, ttl_s=LEASE_S),
            self.shared,
            self.g2,
            worker_id=READER,
            timeout_s=TIMEOUT_S,
            collector=self.metrics,
        )

    def failures(self, reason: str) -> float:
        value = self.metrics.get_sample_value(
            "kvbm_remote_fetch_failures_total", {"reason": reason}
        )
        return value or 0.0

    def remote_onboards(self) -> list[Onboarded]:
        return [e for e in self.events if isinstance(e, Onboarded) and e.src_tier is Tier.G4]

    def close(self) -> None:
        self.manager.close()
        self.agent.close()


@pytest.fixture
def namespace(redis_client: redis.Redis) -> Iterator[str]:
    ns = f"t-remote-{uuid.uuid4().hex[:10]}"
    yield ns
    SharedRegistry(redis_client, ns).delete_namespace()


@pytest.fixture
def pair(namespace: str, tmp_path: Path) -> Iterator[tuple[Owner, Reader]]:
    owner = Owner(namespace, tmp_path)
    reader = Reader(namespace, tmp_path)
    yield owner, reader
    reader.close()
    owner.close()


def test_reader_onboards_the_owners_blocks_with_verified_bytes(pair: tuple[Owner, Reader]) -> None:
    owner, reader = pair
    hashes = owner.ask("prompt", 1, 6)["hashes"]
    mgr = reader.manager
    seq = mgr.sequence([*prompt_tokens(1, 6), 7, 7])  # plus a partial block nobody holds
    assert seq.sequence_hashes == hashes
    assert reader.shared.prefix_depths(hashes) == {OWNER: {Tier.G1: 6, Tier.G2: 6}}

    held = mgr.onboard_remote(seq, reader.fetcher)

    assert len(held) == 6
    for slot, seq_hash in zip(held, hashes, strict=True):
        assert torch.equal(g1_block(mgr, slot), block_bytes(seq_hash, mgr))
    [remote] = reader.remote_onboards()
    assert remote.tier is Tier.G2 and list(remote.sequence_hashes) == hashes
    assert remote.blocks[0].parent_hash is None and remote.blocks[1].parent_hash == hashes[0]
    up = [e for e in reader.events if isinstance(e, Onboarded) and e.src_tier is Tier.G2]
    assert [h for e in up for h in e.sequence_hashes] == hashes and up[0].tier is Tier.G1
    assert reader.fetcher.stats.blocks == 6 and not reader.fetcher.stats.failures
    mgr.release(held)

    # Now cached locally: a second onboard reads nothing remotely.
    again = mgr.onboard_remote(seq, reader.fetcher)
    assert len(again) == 6 and len(reader.remote_onboards()) == 1
    mgr.release(again)


def test_local_prefix_first_then_remote_rest(pair: tuple[Owner, Reader]) -> None:
    owner, reader = pair
    hashes = owner.ask("prompt", 2, 5)["hashes"]
    mgr = reader.manager
    seq = mgr.sequence(prompt_tokens(2, 5))
    mine = mgr.allocate(2)
    for slot, block in zip(mine, seq.blocks[:2], strict=True):
        for layer, view in enumerate(mgr.g1.layout.block(slot)):
            view.copy_(block_bytes(block.sequence_hash, mgr)[layer])
    mgr.release(mgr.register(mine, seq, start=0))
    mgr.wait_idle(10)

    held = mgr.onboard_remote(seq, reader.fetcher)

    assert len(held) == 5
    [remote] = reader.remote_onboards()
    assert list(remote.sequence_hashes) == hashes[2:]
    assert remote.blocks[0].parent_hash == hashes[1]
    for slot, seq_hash in zip(held, hashes, strict=True):
        assert torch.equal(g1_block(mgr, slot), block_bytes(seq_hash, mgr))
    mgr.release(held)


def test_remote_memory_is_preferred_to_the_local_disk(namespace: str, tmp_path: Path) -> None:
    owner = Owner(namespace, tmp_path)
    reader = Reader(namespace, tmp_path, g3_blocks=32, offload_filter="always")
    try:
        hashes = owner.ask("prompt", 8, 4)["hashes"]
        mgr = reader.manager
        seq = mgr.sequence(prompt_tokens(8, 4))
        mine = mgr.allocate(2)  # the reader computed the first two blocks once...
        for slot, block in zip(mine, seq.blocks[:2], strict=True):
            for layer, view in enumerate(mgr.g1.layout.block(slot)):
                view.copy_(block_bytes(block.sequence_hash, mgr)[layer])
        mgr.release(mgr.register(mine, seq, start=0))
        assert mgr.wait_idle(10)
        mgr.remove(Tier.G1, hashes[:2])  # ...and only its disk kept them
        mgr.remove(Tier.G2, hashes[:2])
        assert mgr.match(seq) == (0, 0, 2)

        held = mgr.onboard_remote(seq, reader.fetcher)

        assert len(held) == 4
        assert [h for e in reader.remote_onboards() for h in e.sequence_hashes] == hashes
        for slot, seq_hash in zip(held, hashes, strict=True):
            assert torch.equal(g1_block(mgr, slot), block_bytes(seq_hash, mgr))
        mgr.release(held)
    finally:
        reader.close()
        owner.close()


def test_block_evicted_after_lookup_is_a_clean_miss(pair: tuple[Owner, Reader]) -> None:
    owner, reader = pair
    hashes = owner.ask("prompt", 3, 6)["hashes"]
    plan = reader.fetcher.plan(hashes)
    assert plan is not None and len(plan) == 6
    assert owner.ask("evict", 3, 3)["removed"] == 3  # bytes still in place, entries withdrawn

    result = reader.fetcher.execute(plan, list(range(6)))

    assert (result.count, result.reason) == (3, "vanished")
    assert reader.failures("vanished") == 1
    # Through the manager: only the three blocks still listed arrive and are registered.
    held = reader.manager.onboard_remote(
        reader.manager.sequence(prompt_tokens(3, 6)), reader.fetcher
    )
    assert len(held) == 3
    assert [h for e in reader.remote_onboards() for h in e.sequence_hashes] == hashes[:3]
    reader.manager.release(held)


def test_checksum_mismatch_is_a_clean_miss(pair: tuple[Owner, Reader]) -> None:
    owner, reader = pair
    hashes = owner.ask("prompt", 4, 4)["hashes"]
    owner.ask("overwrite", 4, 0)  # the first block's slot now holds other bytes
    mgr = reader.manager
    free_before = mgr.num_free(Tier.G2)

    held = mgr.onboard_remote(mgr.sequence(prompt_tokens(4, 4)), reader.fetcher)

    assert held == []
    assert reader.failures("checksum") == 1
    assert not reader.remote_onboards()
    assert mgr.num_free(Tier.G2) == free_before and all(
        mgr.slot_of(Tier.G2, h) is None for h in hashes
    )

    hashes = owner.ask("prompt", 6, 4)["hashes"]
    owner.ask("overwrite", 6, 2)  # a later block: the two before it still arrive
    plan = reader.fetcher.plan(hashes)
    assert plan is not None
    assert reader.fetcher.execute(plan, [10, 11, 12, 13]).count == 2
    assert reader.failures("checksum") == 2


def test_what_the_directory_says_can_end_a_fetch_before_any_read(
    namespace: str, tmp_path: Path
) -> None:
    """No owner process: worker 9's events and cards are written straight into Redis."""
    reader = Reader(namespace, tmp_path)
    try:
        seq = reader.manager.sequence(prompt_tokens(7, 2))
        hashes = seq.sequence_hashes
        stored = Stored(
            event_id=0,
            worker_id=9,
            dp_rank=0,
            tier=Tier.G2,
            ts=0.0,
            parent_hash=None,
            blocks=tuple((b.sequence_hash, b.local_hash) for b in seq.blocks),
        )
        reader.shared.apply(9, [stored])
        directory = RemoteDirectory(reader.client, namespace, ttl_s=LEASE_S)
        fetcher = reader.fetcher
        assert fetcher.plan(hashes) is None and reader.failures("no_agent") == 1  # no card

        key = f"kvl:{{{namespace}}}:nixl:9"
        reader.client.set(key, b"not a card")
        assert fetcher.plan(hashes) is None and reader.failures("bad_card") == 1

        card = reader.agent.card(reader.manager.shape)
        other = dataclasses.replace(card, worker_id=9, block_shape="1x1x1x1:uint8")
        directory.publish_card(other)
        assert fetcher.plan(hashes) is None and reader.failures("shape") == 1

        directory.publish_card(dataclasses.replace(card, worker_id=9))
        assert fetcher.plan(hashes) is None and reader.failures("vanished") == 1  # no entries

        reader.client.delete(f"kvl:{{{namespace}}}:lease:9")  # lease lapsed
        assert fetcher.plan(hashes) is None and reader.failures("no_agent") == 2

        dead = redis.Redis(port=1, socket_connect_timeout=0.2, retry=Retry(NoBackoff(), 0))
        offline = RemoteFetcher(
            reader.agent,
            RemoteDirectory(dead, namespace),
            SharedRegistry(dead, namespace),
            reader.g2,
            worker_id=READER,
        )
        assert offline.plan(hashes) is None and offline.stats.failures == {"registry": 1}
        assert reader.manager.onboard_remote(seq, offline) == []
        assert not reader.remote_onboards()
    finally:
        reader.close()


@pytest.fixture
def tcp_pair(
    namespace: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[Owner, Reader, list[int]]]:
    """Owner and reader over TCP only: a shared-memory read (CMA) needs nothing from the owner
    and finishes even while it is stopped; over TCP the owner's progress thread serves it.
    Yields the hashes of an 8-block prompt the owner holds, with the connection warmed up."""
    monkeypatch.setenv("UCX_TLS", "tcp")
    owner = Owner(namespace, tmp_path, env={"UCX_TLS": "tcp"})
    reader = Reader(namespace, tmp_path)
    try:
        hashes = owner.ask("prompt", 5, 8)["hashes"]
        warm = reader.fetcher.plan(hashes[:1])  # connect while the owner is healthy
        assert warm is not None and reader.fetcher.execute(warm, [31]).count == 1
        yield owner, reader, hashes
    finally:
        if owner.proc.poll() is None:
            os.kill(owner.proc.pid, signal.SIGCONT)
        reader.close()
        owner.close()


def onboard_in_thread(
    reader: Reader, prompt: int, blocks: int
) -> tuple[threading.Thread, dict[str, Any]]:
    mgr = reader.manager
    out: dict[str, Any] = {}
    seq = mgr.sequence(prompt_tokens(prompt, blocks))
    thread = threading.Thread(
        target=lambda: out.update(held=mgr.onboard_remote(seq, reader.fetcher))
    )
    thread.start()
    return thread, out


def test_stalled_owner_times_out_and_its_slots_wait_for_the_read(
    tcp_pair: tuple[Owner, Reader, list[int]],
) -> None:
    owner, reader, hashes = tcp_pair
    free_before = reader.manager.num_free(Tier.G2)
    os.kill(owner.proc.pid, signal.SIGSTOP)

    started = time.monotonic()
    thread, out = onboard_in_thread(reader, 5, 8)
    thread.join(TIMEOUT_S + 10)

    assert not thread.is_alive() and time.monotonic() - started < TIMEOUT_S + 3
    assert out["held"] == [] and reader.failures("timeout") == 1
    # The read may still land: its 8 slots stay allocated, unregistered.
    assert reader.manager.num_free(Tier.G2) == free_before - 8 and all(
        reader.manager.slot_of(Tier.G2, h) is None for h in hashes
    )
    assert reader.agent.stalled_workers() == {OWNER}
    # While that read hangs, the owner is not asked again.
    assert (
        reader.manager.onboard_remote(reader.manager.sequence(prompt_tokens(5, 8)), reader.fetcher)
        == []
    )
    assert reader.failures("timeout") == 1 and reader.manager.num_free(Tier.G2) == free_before - 8

    os.kill(owner.proc.pid, signal.SIGCONT)  # the owner resumes and the late bytes arrive
    deadline = time.monotonic() + 10
    freed: list[int] = []
    while len(freed) < 8 and time.monotonic() < deadline:
        freed += reader.fetcher.reclaim()
        time.sleep(0.05)
    assert len(freed) == 8 and not reader.agent.stalled_workers()
    reader.manager.release_slots(Tier.G2, freed)
    assert reader.manager.num_free(Tier.G2) == free_before and not reader.remote_onboards()
    # Healthy again: the next onboard reads the blocks.
    held = reader.manager.onboard_remote(
        reader.manager.sequence(prompt_tokens(5, 8)), reader.fetcher
    )
    assert len(held) == 8
    reader.manager.release(held)


def test_owner_killed_mid_transfer_is_a_clean_miss(
    tcp_pair: tuple[Owner, Reader, list[int]],
) -> None:
    owner, reader, hashes = tcp_pair
    mgr = reader.manager
    free_before = mgr.num_free(Tier.G2)
    os.kill(owner.proc.pid, signal.SIGSTOP)  # the read below cannot finish...

    started = time.monotonic()
    thread, out = onboard_in_thread(reader, 5, 8)
    time.sleep(0.5)
    os.kill(owner.proc.pid, signal.SIGKILL)  # ...and the owner dies in the middle of it
    thread.join(TIMEOUT_S + 10)

    assert not thread.is_alive(), "onboard_remote hung after the owner died"
    assert time.monotonic() - started < TIMEOUT_S + 3
    assert out["held"] == []
    assert reader.failures("disconnected") + reader.failures("timeout") == 1
    assert not reader.remote_onboards() and all(mgr.slot_of(Tier.G2, h) is None for h in hashes)
    # Whether UCX reported the death at once or the read hit its deadline first, a dead owner
    # writes nothing more: every slot comes back (a later onboard reclaims held-back ones).
    deadline = time.monotonic() + 10
    while mgr.num_free(Tier.G2) < free_before and time.monotonic() < deadline:
        assert mgr.onboard_remote(mgr.sequence(prompt_tokens(5, 8)), reader.fetcher) == []
        time.sleep(0.1)
    assert mgr.num_free(Tier.G2) == free_before
    assert mgr.wait_idle(5)


if __name__ == "__main__" and len(sys.argv) > 1 and sys.argv[1] == "owner":
    sys.exit(owner_main(sys.argv[2:]))


def test_g4_setting_wires_the_exporter_and_the_fetcher(tmp_path: Path) -> None:
    """With ``g4`` on, two managers share G2 with no wiring by hand: the owner's blocks are
    exported as they land and the reader's ``onboard_remote`` reads them with its own fetcher."""
    ns = f"t-g4-{uuid.uuid4().hex[:10]}"
    common: dict[str, Any] = {"g4": True, "redis_url": REDIS_URL, "redis_namespace": ns}
    owner = BlockManager(worker_settings(tmp_path, OWNER, **common))
    events: list[AnyEvent] = []
    reader = BlockManager(worker_settings(tmp_path, READER, **common), sinks=[events.append])
    try:
        assert owner.g4 is not None and reader.g4 is not None
        seq = owner.sequence(prompt_tokens(3, 4))
        slots = owner.allocate(4)
        for slot, block in zip(slots, seq.blocks, strict=True):
            for layer, view in enumerate(owner.g1.layout.block(slot)):
                view.copy_(block_bytes(block.sequence_hash, owner)[layer])
        owner.release(owner.register(slots, seq, start=0))
        assert owner.wait_idle(10)
        assert owner.g4.exporter.flush(10)
        assert owner.publisher is not None and owner.publisher.wait_applied(10)

        held = reader.onboard_remote(reader.sequence(prompt_tokens(3, 4)))

        assert len(held) == 4
        for slot, block in zip(held, seq.blocks, strict=True):
            assert torch.equal(g1_block(reader, slot), block_bytes(block.sequence_hash, owner))
        remote = [e for e in events if isinstance(e, Onboarded) and e.src_tier is Tier.G4]
        assert sum(len(e.blocks) for e in remote) == 4
        reader.release(held)
    finally:
        reader.close()
        owner.close()


def test_g4_setting_needs_g2_and_redis(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="g4 needs a G2"):
        worker_settings(tmp_path, OWNER, g4=True)
