"""Our events as the ``KVEventBatch`` payloads vLLM's engines publish, and back.

Routers that read engines (Dynamo's KV router and its standalone indexer, vLLM-native routers)
understand three events: ``BlockStored`` (with the blocks' token ids, since they recompute
their own block hashes from tokens and the LoRA name), ``BlockRemoved`` and
``AllBlocksCleared``, each stored or removed block tagged with a ``medium``. Two of our
transitions have no direct counterpart, and both need to know what a tier held:

- a copy between tiers (``Offloaded``/``Onboarded``) is a ``BlockStored`` on the destination's
  medium, carrying the blocks' tokens (the pools keep them with every block);
- ``Cleared`` of one tier must leave a router with exactly that tier emptied, while
  ``AllBlocksCleared`` carries no medium and wipes every tier of the worker in Dynamo's indexer.
  So a ``Cleared`` becomes ``BlockRemoved`` of the blocks that tier held, or
  ``AllBlocksCleared`` when no other tier holds anything.

``VllmMapper`` keeps, per tier, the sequence hashes the stream has stored and not removed (a
set entry and an int per live block and tier; ``bench/zmq_bench.py`` measures it), which is
what the second rule needs. One mapper follows one worker's stream from its first event, or
from a registry state that the events before were folded to (``seed``).

Payloads are packed with msgspec (vLLM's own encoder, and the fastest at the long lists of token
ids), one call per vLLM event: the publisher packs one batch per event on its own thread, and
that is its whole cost besides the send.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from itertools import chain
from typing import Any

import msgpack
import msgspec

from kvledger.events.types import (
    AnyEvent,
    Cleared,
    HashKey,
    Offloaded,
    Onboarded,
    Removed,
    Stored,
    Tier,
)
from kvledger.registry.hashing import (
    block_seed,
    local_hashes,
    names_plain_block,
    token_bytes,
)

VLLM_MEDIA: Mapping[Tier, str] = {Tier.G1: "GPU", Tier.G2: "CPU", Tier.G3: "STORAGE"}
"""vLLM's medium names (``MEDIUM_GPU``, ``MEDIUM_CPU``, ``MEDIUM_STORAGE``); Dynamo's indexer
maps them to its gpu, cpu and disk tiers (it takes ``DISK`` for the last as well)."""
TIER_OF_MEDIUM: Mapping[str, Tier] = {"GPU": Tier.G1, "CPU": Tier.G2, "STORAGE": Tier.G3}
_MEDIUM_ALIASES = {"DISK": Tier.G3, "CPU_PINNED": Tier.G2}

# msgspec is what vLLM encodes with, and packs a list of token ids four times faster than msgpack
_pack: Callable[[Any], bytes] = msgspec.msgpack.Encoder().encode
_MEDIUM = _pack("medium")
_REMOVED = _pack("type") + _pack("BlockRemoved") + _pack("block_hashes")
_REMOVED_HEAD = b"\x83" + _REMOVED
_CLEARED = _pack({"type": "AllBlocksCleared"})


def _plain(blocks: Sequence[tuple[int, int]], tokens: Sequence[Sequence[int]]) -> bool:
    """Whether every block's tokens hash to its local hash with no LoRA name or salt."""
    return all(
        names_plain_block(token_bytes(ids), local)
        for (_, local), ids in zip(blocks, tokens, strict=True)
    )


def _extra_keys(key: HashKey | None) -> tuple[str, ...] | None:
    """vLLM's per-block extra keys: the LoRA name (if any), then the cache salt (if any)."""
    if key is None:
        return None
    out = tuple(k for k in key if k)
    return out or None


class VllmMapper:
    """Turns one worker's events, in order, into vLLM ``KVEventBatch`` events."""

    __slots__ = ("block_size", "held", "media", "_tokens")

    def __init__(
        self,
        block_size: int,
        *,
        media: Mapping[Tier, str] = VLLM_MEDIA,
        remember_tokens: bool = False,
    ) -> None:
        self.block_size = block_size
        self.media = media
        #: tier -> sequence hashes stored there and not removed since
        self.held: dict[Tier, set[int]] = {tier: set() for tier in media}
        # block -> its token ids, for copies read back from the durable log (which keeps the
        # tokens of Stored events only); only when asked, since it grows with the stream
        self._tokens: dict[int, tuple[int, ...]] | None = {} if remember_tokens else None

    def seed(self, held: Mapping[Tier, Iterable[int]]) -> None:
        """Start from a state the earlier events were folded to (a restart)."""
        for tier, seqs in held.items():
            if tier in self.held:
                self.held[tier].update(seqs)

    # -- one event -> packed vLLM events -----------------------------------------------------

    def packed(self, event: AnyEvent) -> list[bytes]:
        """The msgpack of each vLLM event ``event`` becomes (none for a tier vLLM lacks)."""
        medium = self.media.get(event.tier)
        if medium is None:
            return []
        held = self.held[event.tier]
        cls = type(event)
        if cls is Stored:
            return self._stored_event(event, held, medium)  # type: ignore[arg-type]
        if cls is Offloaded or cls is Onboarded:
            seqs, _, parents = zip(*event.blocks, strict=True)  # type: ignore[union-attr]
            held.update(seqs)
            tokens = event.token_ids  # type: ignore[union-attr]
            keys = event.hash_keys  # type: ignore[union-attr]
            if tokens is None and self._tokens is not None:
                known = self._tokens
                tokens = tuple(known.get(seq, ()) for seq in seqs)
            if keys is None and parents[1:] == seqs[:-1]:  # one chain: the common case
                flat = self._flat(tokens, len(seqs))
                return [self._stored(seqs, parents[0], flat, medium, None)]
            return [
                self._stored(run_seqs, parent, flat, medium, key)
                for parent, run_seqs, flat, key in self._runs(seqs, parents, tokens, keys)
            ]
        if cls is Removed:
            hashes = event.sequence_hashes  # type: ignore[union-attr]
            held.difference_update(hashes)
            return [self._removed(hashes, medium)]
        if cls is Cleared:
            gone = list(held)
            held.clear()
            if not any(self.held.values()):
                return [_CLEARED]
            return [self._removed(gone, medium)] if gone else []
        raise TypeError(f"not an event: {event!r}")

    def _stored_event(self, event: Stored, held: set[int], medium: str) -> list[bytes]:
        seqs = next(zip(*event.blocks, strict=True))
        held.update(seqs)
        tokens = event.token_ids
        size = self.block_size
        if tokens is not None and set(map(len, tokens)) != {size}:
            raise ValueError(
                f"event {event.event_id}: blocks of {sorted(set(map(len, tokens)))} token ids, "
                f"block_size is {size}"
            )
        key = (event.lora_name, event.salt) if event.lora_name or event.salt else None
        if self._tokens is not None and tokens is not None:
            # read back from the log, which keeps no LoRA name or salt: tokens that do not name
            # the block plainly had one, so they are not sent (a router then skips the block
            # rather than indexing it under the wrong name)
            if key is None and not _plain(event.blocks, tokens):
                tokens = None
            else:
                self._tokens.update(zip(seqs, tokens, strict=True))
        flat = list(chain.from_iterable(tokens)) if tokens is not None else []
        return [self._stored(seqs, event.parent_hash, flat, medium, key)]

    def _flat(self, tokens: Sequence[Sequence[int]] | None, n_blocks: int) -> list[int]:
        """A chain's token ids in one list; none unless every block's are known."""
        if tokens is None:
            return []
        flat = list(chain.from_iterable(tokens))
        return flat if len(flat) == n_blocks * self.block_size and all(tokens) else []

    def payload(self, event: AnyEvent, dp_rank: int | None = None) -> bytes:
        """One ``KVEventBatch`` holding what ``event`` becomes: ``[ts, [events], dp_rank]``."""
        parts = self.packed(event)
        rank = _pack(event.dp_rank if dp_rank is None else dp_rank)
        if len(parts) == 1:
            return b"".join((b"\x93", _pack(float(event.ts)), b"\x91", parts[0], rank))
        return b"".join([b"\x93", _pack(float(event.ts)), _array_header(len(parts)), *parts, rank])

    def _runs(
        self,
        seqs: Sequence[int],
        parents: Sequence[int | None],
        tokens: Sequence[Sequence[int]] | None,
        keys: Sequence[HashKey | None] | None,
    ) -> Iterator[tuple[int | None, list[int], list[int], HashKey | None]]:
        """Copied blocks as chains (each block the child of the one before, one hash key),
        with each chain's token ids."""
        start = 0
        for i in range(1, len(seqs) + 1):
            chained = i < len(seqs) and parents[i] == seqs[i - 1]
            if chained and (keys is None or keys[i] == keys[i - 1]):
                continue
            run_tokens = None if tokens is None else tokens[start:i]
            yield (
                parents[start],
                list(seqs[start:i]),
                self._flat(run_tokens, i - start),
                None if keys is None else keys[start],
            )
            start = i

    def _stored(
        self,
        seqs: Sequence[int],
        parent: int | None,
        tokens: list[int],
        medium: str,
        key: HashKey | None,
    ) -> bytes:
        extra = _extra_keys(key)
        fields: dict[str, Any] = {
            "type": "BlockStored",
            "block_hashes": seqs,
            "parent_block_hash": parent,
            "token_ids": tokens,
            "block_size": self.block_size,
            "lora_id": None,
            "medium": medium,
            "lora_name": None if key is None else key[0],
        }
        if extra is None:
            # msgspec sizes a struct's map header by how many fields it could have:
            # BlockStored has 16 with the tag, so vLLM writes a map16 header (0xde)
            return b"\xde\x00\x08" + _pack(fields)[1:]
        fields["extra_keys"] = [list(extra)] * len(seqs)
        return b"\xde\x00\x09" + _pack(fields)[1:]

    @staticmethod
    def _removed(seqs: Sequence[int], medium: str) -> bytes:
        return b"".join((_REMOVED_HEAD, _pack(seqs), _MEDIUM, _pack(medium)))


def _array_header(n: int) -> bytes:
    if n < 16:
        return bytes([0x90 + n])
    return b"\xdc" + n.to_bytes(2, "big") if n < 1 << 16 else b"\xdd" + n.to_bytes(4, "big")


# -- the other way: a vLLM-compatible stream into our events ---------------------------------


class VllmStreamError(ValueError):
    """A payload that is not a vLLM ``KVEventBatch`` (names what is wrong)."""


def decode_batch(payload: bytes) -> tuple[float, list[dict[str, Any]], int | None]:
    """``(ts, events, dp_rank)`` of one ``KVEventBatch`` payload; events as dicts.

    vLLM writes the batch as an array; each event as a map tagged by ``type`` (msgspec may also
    write tagged structs as arrays, ``[tag, *fields]``, which are read here too).
    """
    try:
        batch = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except Exception as exc:  # msgpack raises several unrelated types for bad input
        raise VllmStreamError(f"KVEventBatch payload is not msgpack: {exc}") from None
    if not isinstance(batch, list) or len(batch) not in (2, 3):
        raise VllmStreamError("a KVEventBatch is an array [ts, events, dp_rank]")
    ts, events = batch[0], batch[1]
    rank = batch[2] if len(batch) == 3 else None
    if not isinstance(ts, int | float) or not isinstance(events, list):
        raise VllmStreamError("a KVEventBatch is [ts: number, events: array, dp_rank]")
    out = []
    for item in events:
        if isinstance(item, list) and item and isinstance(item[0], str):
            item = _from_array(item)
        if not isinstance(item, dict) or "type" not in item:
            raise VllmStreamError(f"a KV event is a map with a 'type', got {item!r:.80}")
        out.append(item)
    return float(ts), out, rank


_ARRAY_FIELDS = {
    "BlockStored": (
        "block_hashes",
        "parent_block_hash",
        "token_ids",
        "block_size",
        "lora_id",
        "medium",
        "lora_name",
        "extra_keys",
    ),
    "BlockRemoved": ("block_hashes", "medium"),
    "AllBlocksCleared": (),
}


def _from_array(item: list[Any]) -> dict[str, Any]:
    fields = _ARRAY_FIELDS.get(item[0])
    if fields is None:
        raise VllmStreamError(f"unknown KV event type {item[0]!r}")
    return {"type": item[0], **dict(zip(fields, item[1:], strict=False))}


def tier_of_medium(medium: object) -> Tier:
    """Our tier for a vLLM medium (None, as older engines send, is the GPU)."""
    if medium is None:
        return Tier.G1
    if isinstance(medium, str):
        name = medium.upper()
        tier = TIER_OF_MEDIUM.get(name) or _MEDIUM_ALIASES.get(name)
        if tier is not None:
            return tier
    raise VllmStreamError(f"unknown medium {medium!r}; known: GPU, CPU, STORAGE/DISK")


def _hash(value: object) -> int:
    if isinstance(value, bytes):  # vLLM's ExternalBlockHash may be bytes
        return int.from_bytes(value[-8:], "big")
    if isinstance(value, int) and not isinstance(value, bool):
        return value & ((1 << 64) - 1)
    raise VllmStreamError(f"a block hash is an integer or bytes, got {value!r:.40}")


def local_hashes_of(event: Mapping[str, Any]) -> list[int]:
    """The local hash of each block of a ``BlockStored``, recomputed from its token ids and
    LoRA name as Dynamo does (the engine's block hashes name prefixes, not tokens)."""
    hashes = event.get("block_hashes") or []
    tokens = event.get("token_ids") or []
    size = event.get("block_size")
    if not isinstance(size, int) or size < 1:
        raise VllmStreamError(f"BlockStored needs a positive block_size, got {size!r}")
    if len(tokens) != size * len(hashes):
        return [0] * len(hashes)  # no (or not all) tokens: the blocks cannot be hashed
    salt = None
    extra = event.get("extra_keys")
    if extra and extra[0]:
        strings = [k for k in extra[0] if isinstance(k, str)]
        lora = event.get("lora_name")
        rest = strings[1:] if lora and strings and strings[0] == lora else strings
        salt = rest[-1] if rest else None
    seed = block_seed(lora_name=event.get("lora_name"), salt=salt)
    return local_hashes(tokens, size, seed=seed)


def to_events(
    worker_id: int,
    first_event_id: int,
    batch: tuple[float, list[dict[str, Any]], int | None],
) -> list[AnyEvent]:
    """Our events for one decoded batch, numbered from ``first_event_id`` (a vLLM batch has
    no per-event ids; a reader numbers them as it reads). ``AllBlocksCleared`` is a
    ``Cleared`` of every tier."""
    ts, events, rank = batch
    common: dict[str, Any] = {"worker_id": worker_id, "dp_rank": rank or 0, "ts": ts}
    out: list[AnyEvent] = []
    eid = first_event_id
    for item in events:
        kind = item["type"]
        if kind == "AllBlocksCleared":
            for tier in (Tier.G1, Tier.G2, Tier.G3):
                out.append(Cleared(event_id=eid, tier=tier, **common))
                eid += 1
            continue
        tier = tier_of_medium(item.get("medium"))
        seqs = [_hash(h) for h in item.get("block_hashes") or []]
        if kind == "BlockRemoved":
            if seqs:
                out.append(Removed(event_id=eid, tier=tier, sequence_hashes=tuple(seqs), **common))
                eid += 1
        elif kind == "BlockStored":
            if not seqs:
                continue
            parent = item.get("parent_block_hash")
            locals_ = local_hashes_of(item)
            size = item["block_size"]
            tokens = item.get("token_ids") or []
            token_ids = (
                tuple(tuple(tokens[i * size : (i + 1) * size]) for i in range(len(seqs)))
                if len(tokens) == size * len(seqs)
                else None
            )
            out.append(
                Stored(
                    event_id=eid,
                    tier=tier,
                    parent_hash=None if parent is None else _hash(parent),
                    blocks=tuple(zip(seqs, locals_, strict=True)),
                    token_ids=token_ids,
                    lora_name=item.get("lora_name"),
                    **common,
                )
            )
            eid += 1
        else:
            raise VllmStreamError(f"unknown KV event type {kind!r}")
    return out


def encode_events(
    events: Sequence[AnyEvent], mapper: VllmMapper, *, ts: float, dp_rank: int | None
) -> bytes:
    """Several events as one ``KVEventBatch`` (what ``wire.encode_vllm_batch`` returns)."""
    parts = [p for event in events for p in mapper.packed(event)]
    return b"".join([b"\x93", _pack(float(ts)), _array_header(len(parts)), *parts, _pack(dp_rank)])
