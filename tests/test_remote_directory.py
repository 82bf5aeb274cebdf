"""The remote directory (agent cards and block tables in Redis) and the block exporter.

Real Redis, real host tier bytes; no NIXL needed: cards are data, and the exporter only reads
its own tier's bytes and writes Redis.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import msgpack
import pytest
import redis
import torch
import xxhash
from services import REDIS_URL

from kvledger.events.shared.keys import KeySpace
from kvledger.events.shared.registry import SharedRegistry
from kvledger.events.types import AnyEvent, BlockInfo, Cleared, Offloaded, Removed, Stored, Tier
from kvledger.tiers.host.tier import HostTier
from kvledger.tiers.layout import BlockShape
from kvledger.tiers.remote.directory import (
    AgentCard,
    BlockEntry,
    Region,
    RemoteDirectory,
    shape_key,
)
from kvledger.tiers.remote.export import BlockExporter, block_checksum

pytestmark = [pytest.mark.redis, pytest.mark.timeout(60)]
SHAPE = BlockShape(2, 2, 4, 16, torch.float16)
WORKER = 7


@pytest.fixture
def client(redis_client: redis.Redis) -> redis.Redis:
    return redis_client


@pytest.fixture
def namespace(client: redis.Redis) -> Iterator[str]:
    ns = f"t-dir-{uuid.uuid4().hex[:10]}"
    yield ns
    SharedRegistry(client, ns).delete_namespace()


def card(tier: HostTier | None = None) -> AgentCard:
    address = tier.layout.tensor.data_ptr() if tier is not None else 0x7F00_0000_0000
    region = Region(Tier.G2, "DRAM", 0, address, 8, SHAPE.block_bytes)
    return AgentCard(
        WORKER, "agent-7", b"\x00nixl\xff", shape_key(SHAPE), SHAPE.block_bytes, (region,)
    )


def test_card_and_entry_round_trip() -> None:
    c = card()
    assert AgentCard.decode(c.encode()) == c
    assert c.region(Tier.G2) is not None and c.region(Tier.G1) is None
    assert c.regions[0].slot_address(3) == 0x7F00_0000_0000 + 3 * SHAPE.block_bytes
    with pytest.raises(IndexError, match="slot 8"):
        c.regions[0].slot_address(8)
    entry = BlockEntry(Tier.G2, 5, 2**64 - 1)
    assert BlockEntry.decode(entry.encode()) == entry
    assert shape_key(SHAPE) == "2x2x4x16:float16"


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (b"\xc1", "not msgpack"),
        (msgpack.packb({"v": 99}), "version 99"),
        (msgpack.packb([1, 2]), "version None"),
        (msgpack.packb({"v": 1, "worker": 1}), "malformed"),
        (
            msgpack.packb(
                {
                    "v": 1,
                    "worker": 1,
                    "agent": "a",
                    "md": b"",
                    "shape": "s",
                    "block_bytes": 1,
                    "regions": [[9, "DRAM", 0, 0, 1, 1]],
                }
            ),
            "malformed",
        ),
    ],
)
def test_bad_cards_are_refused_with_the_cause(raw: bytes, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        AgentCard.decode(raw)


def test_bad_entries_and_settings_are_refused(client: redis.Redis) -> None:
    with pytest.raises(ValueError, match="12 bytes"):
        BlockEntry.decode(b"\x00" * 12)
    with pytest.raises(ValueError, match="namespace"):
        RemoteDirectory(client, "bad space")
    with pytest.raises(ValueError, match="ttl_s"):
        RemoteDirectory(client, "ok", ttl_s=0)
    with pytest.raises(ValueError, match="decode_responses"):
        RemoteDirectory(redis.Redis.from_url(REDIS_URL, decode_responses=True), "ok")


def test_lookup_needs_the_workers_lease(client: redis.Redis, namespace: str) -> None:
    directory = RemoteDirectory(client, namespace, ttl_s=5)
    shared = SharedRegistry(client, namespace, lease_ttl_s=5)
    directory.publish_card(card())
    directory.update_blocks(WORKER, [(11, BlockEntry(Tier.G2, 1, 111))])
    assert directory.lookup(WORKER, [11]) == (None, [BlockEntry(Tier.G2, 1, 111)])
    shared.heartbeat(WORKER)
    found, entries = directory.lookup(WORKER, [11, 12])
    assert found == card() and entries == [BlockEntry(Tier.G2, 1, 111), None]
    assert 0 < client.pttl(f"kvl:{{{namespace}}}:nixl:{WORKER}") <= 5000
    assert 0 < client.pttl(f"kvl:{{{namespace}}}:nixl:{WORKER}:blocks") <= 5000
    shared.release(WORKER)  # the lease goes with the worker's entries: the card is not trusted
    assert directory.lookup(WORKER, [11])[0] is None
    shared.heartbeat(WORKER)
    directory.withdraw(WORKER)
    assert directory.lookup(WORKER, [11]) == (None, [None])


def test_one_key_space_names_every_key_of_a_namespace(client: redis.Redis, namespace: str) -> None:
    """The shared registry (and its scripts) and the G4 directory write only keys that
    ``KeySpace`` names, so the layout is described in one place."""
    keys = KeySpace(namespace)
    directory = RemoteDirectory(client, namespace, ttl_s=5)
    shared = SharedRegistry(client, namespace, lease_ttl_s=5)
    assert shared.keys == directory.keys == keys
    events = [_event(Stored, Tier.G2, [100 + i], i) for i in range(3)]
    shared.apply(WORKER, [*events, _event(Cleared, Tier.G2, [], 3)])
    shared.heartbeat(WORKER)
    directory.publish_card(card())
    directory.update_blocks(WORKER, [(11, BlockEntry(Tier.G2, 1, 111))])
    named = {
        keys.index,
        keys.generations,
        keys.held,
        keys.applied,
        keys.count,
        keys.workers,
        keys.stream,
        keys.stream_size,
        keys.sweep,
        keys.fence,
        keys.tips,
        keys.claim(WORKER),
        keys.tokens,
        keys.shard_count,
        keys.lease(WORKER),
        keys.agent_card(WORKER),
        keys.block_table(WORKER),
    }
    written = {k.decode() for k in client.scan_iter(match=keys.all_keys(), count=1000)}
    assert written <= named
    assert {keys.applied, keys.stream, keys.lease(WORKER), keys.agent_card(WORKER)} <= written
    with pytest.raises(ValueError, match="namespace"):
        KeySpace("bad space")


def test_update_blocks_clears_then_deletes_then_puts(client: redis.Redis, namespace: str) -> None:
    directory = RemoteDirectory(client, namespace)
    SharedRegistry(client, namespace).heartbeat(WORKER)
    directory.publish_card(card())
    directory.update_blocks(
        WORKER, [(1, BlockEntry(Tier.G2, 1, 1)), (2, BlockEntry(Tier.G2, 2, 2))]
    )
    directory.update_blocks(WORKER, [(3, BlockEntry(Tier.G2, 3, 3))], [2])
    assert directory.lookup(WORKER, [1, 2, 3])[1] == [
        BlockEntry(Tier.G2, 1, 1),
        None,
        BlockEntry(Tier.G2, 3, 3),
    ]
    directory.update_blocks(WORKER, [(4, BlockEntry(Tier.G2, 4, 4))], clear=True)
    assert directory.lookup(WORKER, [1, 3, 4])[1] == [None, None, BlockEntry(Tier.G2, 4, 4)]


def _event(kind: type[AnyEvent], tier: Tier, hashes: list[int], eid: int) -> AnyEvent:
    common: dict[str, Any] = dict(event_id=eid, worker_id=WORKER, dp_rank=0, tier=tier, ts=0.0)
    if kind is Offloaded:
        blocks = tuple(BlockInfo(h, h + 1000, None) for h in hashes)
        return Offloaded(src_tier=Tier.G1, blocks=blocks, **common)
    if kind is Stored:
        return Stored(parent_hash=None, blocks=tuple((h, h + 1000) for h in hashes), **common)
    if kind is Removed:
        return Removed(sequence_hashes=tuple(hashes), **common)
    return Cleared(**common)


def test_exporter_publishes_checksums_and_withdraws_in_order(
    client: redis.Redis, namespace: str
) -> None:
    tier = HostTier(SHAPE, 8, pin=False)
    gen = torch.Generator().manual_seed(3)
    tier.layout.tensor.copy_(torch.rand(tier.layout.tensor.shape, generator=gen))
    slots = {101: 0, 102: 5, 103: 2}
    directory = RemoteDirectory(client, namespace, ttl_s=5)
    SharedRegistry(client, namespace, lease_ttl_s=5).heartbeat(WORKER)
    exporter = BlockExporter(directory, card(tier), tier)
    with pytest.raises(RuntimeError, match="bind"):
        exporter(_event(Offloaded, Tier.G2, [101], 0))
    exporter.bind(slots.get).start()
    try:
        exporter(_event(Offloaded, Tier.G2, [101, 102, 999], 1))  # 999: no slot, not published
        exporter(_event(Stored, Tier.G2, [103], 2))
        exporter(_event(Stored, Tier.G1, [104], 3))  # another tier: ignored
        assert exporter.flush(5)
        found, entries = directory.lookup(WORKER, [101, 102, 103, 104, 999])
        assert found is not None and found.agent_name == "agent-7"
        rows = tier.layout.block_bytes_view()
        expected = [
            BlockEntry(Tier.G2, s, xxhash.xxh3_64_intdigest(rows[s].numpy().tobytes()))
            for s in (0, 5, 2)
        ]
        assert entries == [*expected, None, None]
        assert expected[1].checksum == block_checksum(tier.layout, 5)

        exporter(_event(Removed, Tier.G2, [102], 4))
        assert exporter.flush(5)
        assert directory.lookup(WORKER, [101, 102])[1] == [expected[0], None]
        # A block removed and stored again in one batch ends up published (order kept).
        exporter(_event(Removed, Tier.G2, [101], 5))
        exporter(_event(Offloaded, Tier.G2, [101], 6))
        exporter(_event(Cleared, Tier.G1, [], 7))  # another tier's clear: ignored
        assert exporter.flush(5)
        assert directory.lookup(WORKER, [101])[1] == [expected[0]]
        exporter(_event(Cleared, Tier.G2, [], 8))
        assert exporter.flush(5)
        assert directory.lookup(WORKER, [101, 103])[1] == [None, None]
        assert exporter.redis_errors == 0
    finally:
        exporter.close()
    assert directory.lookup(WORKER, [101]) == (None, [None])  # withdrawn on close


def test_exporter_refuses_what_it_cannot_export(client: redis.Redis, namespace: str) -> None:
    directory = RemoteDirectory(client, namespace)
    tier = HostTier(SHAPE, 8, pin=False)
    no_g2 = AgentCard(WORKER, "a", b"", shape_key(SHAPE), SHAPE.block_bytes, ())
    with pytest.raises(ValueError, match="no G2"):
        BlockExporter(directory, no_g2, tier)
