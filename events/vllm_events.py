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

``VllmMapper`` keeps, per tier, the sequence hashes the stream has stored and not removed
(about 100 bytes per live block and tier: a dict entry and its int), which is what the second
rule needs. One mapper follows one worker's stream from its first event, or from a registry
state that the events before were folded to (``seed``).

Payloads are packed with precomputed key bytes rather than through dicts: the publisher packs
one per event on its own thread, and this is its whole cost besides the send.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from itertools import chain
from typing import Any

import msgpack

from kvledger.events.types import (
    AnyEvent,
    BlockInfo,
    Cleared,
    HashKey,
    Offloaded,
    Onboarded,
    Removed,
    Stored,
    Tier,
)

VLLM_MEDIA: Mapping[Tier, str] = {Tier.G1: "GPU", Tier.G2: "CPU", Tier.G3: "STORAGE"}
"""vLLM's medium names (``MEDIUM_GPU``, ``MEDIUM_CPU``, ``MEDIUM_STORAGE``); Dynamo's indexer
maps them to its gpu, cpu and disk tiers (it takes ``DISK`` for the last as well)."""
TIER_OF_MEDIUM: Mapping[str, Tier] = {"GPU": Tier.G1, "CPU": Tier.G2, "STORAGE": Tier.G3}
_MEDIUM_ALIASES = {"DISK": Tier.G3, "CPU_PINNED": Tier.G2}

_pack = msgpack.Packer(use_bin_type=True).pack
# msgspec sizes a struct's map header by how many fields it could have: BlockStored has 16 with
# the tag, so vLLM always writes a map16 header, however few fields are set.
_STORED_8 = b"\xde\x00\x08" + _pack("type") + _pack("BlockStored") + _pack("block_hashes")
_STORED_9 = b"\xde\x00\x09" + _STORED_8[3:]
_PARENT = _pack("parent_block_hash")
_TOKENS = _pack("token_ids")
_BLOCK_SIZE = _pack("block_size")
_LORA_ID_NIL = _pack("lora_id") + b"\xc0"
_MEDIUM = _pack("medium")
_LORA_NAME = _pack("lora_name")
_EXTRA_KEYS = _pack("extra_keys")
_REMOVED = _pack("type") + _pack("BlockRemoved") + _pack("block_hashes")
_REMOVED_HEAD = b"\x83" + _REMOVED
_CLEARED = _pack({"type": "AllBlocksCleared"})


def _plain(blocks: Sequence[tuple[int, int]], tokens: Sequence[Sequence[int]]) -> bool:
    """Whether every block's tokens hash to its local hash with no LoRA name or salt."""
    from kvledger.registry.hashing import names_plain_block, token_bytes

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
        #: tier -> sequence hashes stored there and not removed since, oldest first
        self.held: dict[Tier, dict[int, None]] = {tier: {} for tier in media}
        # block -> its token ids, for copies read back from the durable log (which keeps the
        # tokens of Stored events only); only when asked, since it grows with the stream
        self._tokens: dict[int, tuple[int, ...]] | None = {} if remember_tokens else None

    def seed(self, held: Mapping[Tier, Iterable[int]]) -> None:
        """Start from a state the earlier events were folded to (a restart)."""
        for tier, seqs in held.items():
            if tier in self.held:
                self.held[tier].update(dict.fromkeys(seqs))

    # -- one event -> packed vLLM events -----------------------------------------------------

    def packed(self, event: AnyEvent) -> list[bytes]:
        """The msgpack of each vLLM event ``event`` becomes (none for a tier vLLM lacks)."""
        medium = self.media.get(event.tier)
        if medium is None:
            return []
        held = self.held[event.tier]
        if isinstance(event, Stored):
            seqs = [seq for seq, _ in event.blocks]
            held.update(dict.fromkeys(seqs))
            tokens = event.token_ids
            if tokens is not None and any(len(t) != self.block_size for t in tokens):
                sizes = sorted({len(t) for t in tokens})
                raise ValueError(
                    f"event {event.event_id}: blocks of {sizes} token ids, block_size is "
                    f"{self.block_size}"
                )
            key = (event.lora_name, event.salt) if event.lora_name or event.salt else None
            if self._tokens is not None and tokens is not None:
                # read back from the log, which keeps no LoRA name or salt: tokens that do not
                # name the block plainly had one, so they are not sent (a router then skips
                # the block rather than indexing it under the wrong name)
                if key is None and not _plain(event.blocks, tokens):
                    tokens = None
                else:
                    self._tokens.update(zip(seqs, tokens, strict=True))
            flat = list(chain.from_iterable(tokens)) if tokens is not None else []
            return [self._stored(seqs, event.parent_hash, flat, medium, key, len(seqs))]
        if isinstance(event, Offloaded | Onboarded):
            held.update(dict.fromkeys(b.sequence_hash for b in event.blocks))
            return [
                self._stored([b.sequence_hash for b in run], parent, flat, medium, key, len(run))
                for parent, run, flat, key in self._runs(event)
            ]
        if isinstance(event, Removed):
            for seq in event.sequence_hashes:
                held.pop(seq, None)
            return [self._removed(list(event.sequence_hashes), medium)]
        if isinstance(event, Cleared):
            gone = list(reversed(held))  # children before their parents
            held.clear()
            if not any(self.held.values()):
                return [_CLEARED]
            return [self._removed(gone, medium)] if gone else []
        raise TypeError(f"not an event: {event!r}")

    def payload(self, event: AnyEvent, dp_rank: int | None = None) -> bytes:
        """One ``KVEventBatch`` holding what ``event`` becomes: ``[ts, [events], dp_rank]``."""
        parts = self.packed(event)
        return b"".join(
            [
                b"\x93",
                _pack(float(event.ts)),
                _array_header(len(parts)),
                *parts,
                _pack(event.dp_rank if dp_rank is None else dp_rank),
            ]
        )

    def _runs(
        self, event: Offloaded | Onboarded
    ) -> Iterator[tuple[int | None, list[BlockInfo], list[int], HashKey | None]]:
        """Copied blocks as chains (each block the child of the one before, one hash key),
        with the chain's tokens flattened."""
        infos = event.blocks
        tokens = event.token_ids
        if tokens is None and self._tokens is not None:
            known = self._tokens
            tokens = tuple(known.get(b.sequence_hash, ()) for b in infos)
        keys = event.hash_keys
        run: list[BlockInfo] = []
        run_tokens: list[int] = []
        complete = True
        key: HashKey | None = None
        for i, info in enumerate(infos):
            block_key = None if keys is None else keys[i]
            if run and (run[-1].sequence_hash != info.parent_hash or block_key != key):
                yield run[0].parent_hash, run, run_tokens if complete else [], key
                run, run_tokens, complete = [], [], True
            key = block_key
            run.append(info)
            block_tokens = () if tokens is None else tokens[i]
            complete = complete and len(block_tokens) == self.block_size
            run_tokens.extend(block_tokens)
        if run:
            yield run[0].parent_hash, run, run_tokens if complete else [], key

    def _stored(
        self,
        seqs: list[int],
        parent: int | None,
        tokens: list[int],
        medium: str,
        key: HashKey | None,
        n_blocks: int,
    ) -> bytes:
        extra = _extra_keys(key)
        parts = [
            _STORED_8 if extra is None else _STORED_9,
            _pack(seqs),
            _PARENT,
            _pack(parent),
            _TOKENS,
            _pack(tokens),
            _BLOCK_SIZE,
            _pack(self.block_size),
            _LORA_ID_NIL,
            _MEDIUM,
            _pack(medium),
            _LORA_NAME,
            _pack(None if key is None else key[0]),
        ]
        if extra is not None:
            parts += [_EXTRA_KEYS, _pack([list(extra)] * n_blocks)]
        return b"".join(parts)

    @staticmethod
    def _removed(seqs: list[int], medium: str) -> bytes:
        return b"".join([_REMOVED_HEAD, _pack(seqs), _MEDIUM, _pack(medium)])


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
    from kvledger.registry.hashing import block_seed, local_hashes

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
