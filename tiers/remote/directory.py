"""Where another worker's blocks can be read: NIXL agent cards and block tables in Redis.

The shared registry (``kvledger.events.shared.registry``) says *which* worker holds a prefix on
which tier; a remote read also needs *where*: the worker's NIXL agent metadata, the address of
its registered host memory, and the slot and checksum of each block. Those live here, under the
shared registry's namespace and hash tag (both name their keys through
``kvledger.events.shared.keys.KeySpace``), in keys the registry's scripts never touch:

- ``nixl:<worker>``         string  msgpack ``AgentCard`` (agent name and metadata, regions)
- ``nixl:<worker>:blocks``  hash    8-byte sequence hash -> 13 bytes: u8 tier, u32 slot,
                                    u64 xxh3-64 of the block's bytes

Both keys carry the lease TTL and are refreshed with it, and a reader trusts them only while
the worker's ``lease:<worker>`` key (the shared registry's) exists, so a dead worker's cards
disappear with its lease. Descriptors are plain integers in msgpack, not NIXL's pickled
descriptor lists: a reader never unpickles what another process wrote into Redis.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import msgpack

from kvledger.events.shared.client import Client
from kvledger.events.shared.keys import KeySpace
from kvledger.events.types import Tier
from kvledger.tiers.layout import BlockShape

CARD_VERSION = 1
_ENTRY = struct.Struct(">BIQ")


def shape_key(shape: BlockShape) -> str:
    """A block shape as text, compared between workers before any bytes move."""
    dtype = str(shape.dtype).removeprefix("torch.")
    return f"{shape.num_layers}x{shape.outer_dim}x{shape.page_size}x{shape.inner_dim}:{dtype}"


@dataclass(frozen=True, slots=True)
class Region:
    """One registered run of memory holding ``num_slots`` blocks, ``stride`` bytes apart."""

    tier: Tier
    mem_type: str  # NIXL's "DRAM" or "VRAM"
    device_id: int
    address: int
    num_slots: int
    stride: int

    def slot_address(self, slot: int) -> int:
        if not 0 <= slot < self.num_slots:
            raise IndexError(f"slot {slot} is outside the {self.num_slots} slots of {self.tier}")
        return self.address + slot * self.stride


@dataclass(frozen=True, slots=True)
class AgentCard:
    """What a reader needs to open a NIXL connection to a worker and address its blocks."""

    worker_id: int
    agent_name: str
    metadata: bytes
    block_shape: str
    block_bytes: int
    regions: tuple[Region, ...]

    def region(self, tier: Tier) -> Region | None:
        return next((r for r in self.regions if r.tier == tier), None)

    def encode(self) -> bytes:
        packed: bytes = msgpack.packb(
            {
                "v": CARD_VERSION,
                "worker": self.worker_id,
                "agent": self.agent_name,
                "md": self.metadata,
                "shape": self.block_shape,
                "block_bytes": self.block_bytes,
                "regions": [
                    [int(r.tier), r.mem_type, r.device_id, r.address, r.num_slots, r.stride]
                    for r in self.regions
                ],
            }
        )
        return packed

    @classmethod
    def decode(cls, raw: bytes) -> AgentCard:
        """Parse a card; raises ValueError naming what is wrong with it."""
        try:
            d = msgpack.unpackb(raw)
        except Exception as exc:
            raise ValueError(f"agent card is not msgpack: {exc}") from None
        if not isinstance(d, dict) or d.get("v") != CARD_VERSION:
            version = d.get("v") if isinstance(d, dict) else None
            raise ValueError(f"agent card version {version!r}; this reader knows {CARD_VERSION}")
        try:
            regions = tuple(
                Region(Tier(t), str(m), int(dev), int(a), int(n), int(s))
                for t, m, dev, a, n, s in d["regions"]
            )
            return cls(
                int(d["worker"]),
                str(d["agent"]),
                bytes(d["md"]),
                str(d["shape"]),
                int(d["block_bytes"]),
                regions,
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"malformed agent card: {exc!r}") from None


@dataclass(frozen=True, slots=True)
class BlockEntry:
    """Where one block sits on its worker, and the checksum its bytes must have."""

    tier: Tier
    slot: int
    checksum: int

    def encode(self) -> bytes:
        return _ENTRY.pack(int(self.tier), self.slot, self.checksum)

    @classmethod
    def decode(cls, raw: bytes) -> BlockEntry:
        if len(raw) != _ENTRY.size:
            raise ValueError(f"block entry of {len(raw)} bytes, expected {_ENTRY.size}")
        tier, slot, checksum = _ENTRY.unpack(raw)
        return cls(Tier(tier), slot, checksum)


class RemoteDirectory:
    """The agent cards and block tables of one shared-registry namespace.

    ``ttl_s`` should equal the shared registry's lease TTL: ``heartbeat`` keeps the keys alive
    as long as the worker lives, and they expire soon after it stops.
    """

    def __init__(self, client: Client, namespace: str, *, ttl_s: float = 10.0) -> None:
        keys = KeySpace(namespace)
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be positive, got {ttl_s}")
        if client.get_connection_kwargs().get("decode_responses"):
            raise ValueError(
                "the remote directory needs a Redis client with decode_responses=False"
            )
        self.client = client
        self.keys = keys
        self.ttl_ms = int(ttl_s * 1000)

    # -- the worker that owns the blocks -----------------------------------------------------

    def publish_card(self, card: AgentCard) -> None:
        self.client.set(self.keys.agent_card(card.worker_id), card.encode(), px=self.ttl_ms)

    def update_blocks(
        self,
        worker_id: int,
        put: Iterable[tuple[int, BlockEntry]] = (),
        delete: Iterable[int] = (),
        *,
        clear: bool = False,
    ) -> None:
        """Apply one batch of block-table changes (clear first, then deletes, then puts)."""
        key = self.keys.block_table(worker_id)
        pipe = self.client.pipeline(transaction=True)
        if clear:
            pipe.delete(key)
        gone = [_hash_field(h) for h in delete]
        if gone:
            pipe.hdel(key, *gone)
        items = [x for h, e in put for x in (_hash_field(h), e.encode())]
        if items:
            pipe.hset(key, items=items)
        pipe.pexpire(key, self.ttl_ms)
        pipe.execute()

    def heartbeat(self, worker_id: int) -> None:
        pipe = self.client.pipeline(transaction=False)
        pipe.pexpire(self.keys.agent_card(worker_id), self.ttl_ms)
        pipe.pexpire(self.keys.block_table(worker_id), self.ttl_ms)
        pipe.execute()

    def withdraw(self, worker_id: int) -> None:
        """Remove the worker's card and block table (clean shutdown)."""
        self.client.delete(self.keys.agent_card(worker_id), self.keys.block_table(worker_id))

    # -- readers -----------------------------------------------------------------------------

    def lookup(
        self, worker_id: int, sequence_hashes: Sequence[int]
    ) -> tuple[AgentCard | None, list[BlockEntry | None]]:
        """The worker's card and the entries of ``sequence_hashes``, in one round trip.

        The card is None when the worker's lease has lapsed or it never published one; an entry
        is None when the worker does not (or no longer) list the block.
        """
        pipe = self.client.pipeline(transaction=False)
        pipe.exists(self.keys.lease(int(worker_id)))
        pipe.get(self.keys.agent_card(worker_id))
        if sequence_hashes:
            pipe.hmget(self.keys.block_table(worker_id), [_hash_field(h) for h in sequence_hashes])
        replies = pipe.execute()
        alive, raw_card = replies[0], replies[1]
        raw_entries = replies[2] if sequence_hashes else []
        card = AgentCard.decode(raw_card) if alive and raw_card is not None else None
        entries = [None if r is None else BlockEntry.decode(r) for r in raw_entries]
        return card, entries


def _hash_field(sequence_hash: int) -> bytes:
    return int(sequence_hash).to_bytes(8, "big")
