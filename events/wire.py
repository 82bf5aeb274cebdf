"""Events on the wire: the shared registry's records, Dynamo's KvCacheEvent JSON, vLLM's
KVEventBatch.

Three audiences read the same transitions:
- our own consumers (routers reading the shared registry's Redis stream) read each event as
  its durable-log record (``codec.encode``, checksummed): the bytes the log stored, which the
  publisher is handed with each committed event. The Lua apply never decodes records: the
  Python side reduces a batch to packed hashes (``pack_hashes``: big-endian u64s in one
  string, since Redis's Lua has only doubles). A reset of a worker's entries puts a
  *baseline* record per tier on the stream (``encode_baseline``).
- Dynamo's KV router reads ``KvCacheEvent`` JSON (one tier: its radix tree has none);
- vLLM-native routers read a msgpack ``KVEventBatch``.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import msgpack

from kvledger.events.types import (
    AnyEvent,
    Baseline,
    BlockInfo,
    Cleared,
    Offloaded,
    Onboarded,
    Removed,
    Stored,
    Tier,
)
from kvledger.events.vllm_events import VLLM_MEDIA, VllmMapper, encode_events

BASELINE_VERSION = 1
"""The layout of a baseline record (``encode_baseline``)."""
_U64_MAX = (1 << 64) - 1


class WireFormatError(ValueError):
    """Bytes that are not a record of the expected format (names what is wrong)."""


# -- hash chains as bytes ----------------------------------------------------------------


def pack_hashes(hashes: Sequence[int]) -> bytes:
    """Concatenated big-endian u64s; a hash outside u64 is an error, not a wrap-around."""
    try:
        return struct.pack(f">{len(hashes)}Q", *hashes)
    except struct.error:
        bad = [h for h in hashes if not (isinstance(h, int) and 0 <= h <= _U64_MAX)]
        raise ValueError(f"hashes must be unsigned 64-bit integers, got {bad[:3]}") from None


def unpack_hashes(blob: bytes) -> tuple[int, ...]:
    if len(blob) % 8:
        raise WireFormatError(f"a hash chain is a multiple of 8 bytes, got {len(blob)} bytes")
    return struct.unpack(f">{len(blob) // 8}Q", blob)


def pack_stream_entry(records: Sequence[bytes]) -> bytes:
    """The events of one apply call as one stream entry: their log records in one msgpack array.

    One entry per call, not per event: an XADD costs Redis about as much as the index update of
    a one-block event, and a router reads and acknowledges the call's events together anyway."""
    packed: bytes = msgpack.packb(list(records))
    return packed


def unpack_stream_entry(entry: bytes) -> list[bytes]:
    """The log records of a stream entry (``pack_stream_entry``)."""
    try:
        records = msgpack.unpackb(entry)
    except (ValueError, msgpack.UnpackException) as exc:
        raise WireFormatError(f"a stream entry is one msgpack array of records: {exc}") from None
    if not isinstance(records, list) or not all(type(r) is bytes for r in records):
        raise WireFormatError(f"a stream entry is an array of records (bytes), got {records!r:.80}")
    return records


def hash_key(seq: int) -> bytes:
    """One hash as the 8 bytes the stream record and the Redis keys use."""
    return seq.to_bytes(8, "big")


# -- the baseline record -------------------------------------------------------------


BASELINE_CODE = 100
"""The kind code of a baseline record (``encode_baseline``), apart from the event kinds'."""


def encode_baseline(
    *,
    worker_id: int,
    dp_rank: int,
    tier: Tier,
    event_id: int,
    ts: float,
    seq: Sequence[int],
    local: Sequence[int],
    parent: Sequence[int | None],
) -> bytes:
    """The stream record of a ``Baseline``: ``[version, 100, event_id, worker_id, dp_rank,
    tier, ts, sequence hashes, [tier, local hashes, parents]]``, hashes packed as big-endian
    u64s, a parent as 8 bytes or nil; msgpack's old raw string type throughout."""
    parents = [None if p is None else hash_key(p) for p in parent]
    record = [
        BASELINE_VERSION,
        BASELINE_CODE,
        event_id,
        worker_id,
        dp_rank,
        int(tier),
        ts,
        pack_hashes(seq),
        [int(tier), pack_hashes(local), parents],
    ]
    return msgpack.packb(record, use_bin_type=False)  # type: ignore[no-any-return]


def decode_baseline(data: bytes) -> Baseline:
    """Inverse of ``encode_baseline``; malformed bytes raise ``WireFormatError``."""
    try:
        record = msgpack.unpackb(data, raw=True, use_list=True)
    except (ValueError, msgpack.UnpackException) as exc:
        raise WireFormatError(f"baseline record is not msgpack: {exc}") from None
    if not isinstance(record, list) or len(record) != 9 or record[1] != BASELINE_CODE:
        raise WireFormatError("a baseline record is a 9-item array of kind 100")
    version, _code, event_id, worker_id, dp_rank, tier_num, ts, seq_blob, body = record
    if version != BASELINE_VERSION:
        raise WireFormatError(f"baseline record version {version!r}")
    try:
        tier = Tier(tier_num)
    except ValueError:
        raise WireFormatError(f"unknown tier {tier_num!r} in baseline record") from None
    seqs = unpack_hashes(seq_blob)
    _tier, local_blob, parents = body
    locals_ = unpack_hashes(local_blob)
    if not (len(locals_) == len(parents) == len(seqs)):
        raise WireFormatError("sequence, local and parent hash lists differ in length")
    blocks = tuple(
        BlockInfo(s, loc, None if p is None else int.from_bytes(p, "big"))
        for s, loc, p in zip(seqs, locals_, parents, strict=True)
    )
    return Baseline(
        event_id=event_id, worker_id=worker_id, dp_rank=dp_rank, tier=tier, ts=ts, blocks=blocks
    )


# -- chains: both router formats want each stored run as parent + consecutive blocks ------


def _chains(blocks: Sequence[BlockInfo]) -> list[tuple[int | None, list[BlockInfo]]]:
    """Split copied blocks into runs whose every block is the child of the one before."""
    runs: list[tuple[int | None, list[BlockInfo]]] = []
    for info in blocks:
        if runs and runs[-1][1][-1].sequence_hash == info.parent_hash:
            runs[-1][1].append(info)
        else:
            runs.append((info.parent_hash, [info]))
    return runs


def _stored_runs(event: AnyEvent) -> list[tuple[int | None, list[BlockInfo]]]:
    if isinstance(event, Stored):
        return [(event.parent_hash, event.infos())]
    if isinstance(event, Offloaded | Onboarded):
        return _chains(event.blocks)
    return []


# -- Dynamo KvCacheEvent JSON ------------------------------------------------------------


def to_dynamo(event: AnyEvent, *, tier: Tier = Tier.G1) -> list[dict[str, Any]]:
    """The ``KvCacheEvent`` objects a Dynamo router should see for ``event`` on ``tier``.

    Dynamo's radix tree has no tiers, so one tier is published (G1 by default, what its router
    scores) and events on other tiers yield nothing. A copy whose blocks are not one chain
    becomes several stored events, each anchored to its own parent.

    Dynamo's tree (1.6.1) forgets a worker's whole subtree when one of its blocks is removed,
    and rejects a later removal of a forgotten descendant. Our registry keeps the descendants
    (the worker still holds them). The two agree when parents outlive their children, which the
    ``lineage`` eviction policy guarantees; under plain ``lru`` a Dynamo router can under-count.
    """
    if event.tier != tier:
        return []
    head = {"event_id": event.event_id, "dp_rank": event.dp_rank}
    if isinstance(event, Removed):
        return [{**head, "data": {"removed": {"block_hashes": list(event.sequence_hashes)}}}]
    if isinstance(event, Cleared):
        return [{**head, "data": "cleared"}]
    return [
        {
            **head,
            "data": {
                "stored": {
                    "parent_hash": parent,
                    "blocks": [
                        {"block_hash": b.sequence_hash, "tokens_hash": b.local_hash} for b in run
                    ],
                }
            },
        }
        for parent, run in _stored_runs(event)
    ]


def encode_dynamo(event: AnyEvent, *, tier: Tier = Tier.G1) -> list[bytes]:
    """``to_dynamo`` as the compact JSON bytes ``RadixTree.apply_event`` takes."""
    return [json.dumps(obj, separators=(",", ":")).encode() for obj in to_dynamo(event, tier=tier)]


# -- vLLM KVEventBatch msgpack -----------------------------------------------------------


def encode_vllm_batch(
    events: Iterable[AnyEvent],
    *,
    block_size: int,
    ts: float | None = None,
    dp_rank: int | None = None,
    tiers: Iterable[Tier] | None = None,
    media: Mapping[Tier, str] = VLLM_MEDIA,
    mapper: VllmMapper | None = None,
) -> bytes:
    """One ``KVEventBatch`` (``[ts, [events...], dp_rank]``) as vLLM's msgspec writes it.

    ``tiers`` selects which tiers are published; events on any other tier are left out on
    purpose. By default every event is published, and one vLLM cannot express is an error.
    ``ts`` defaults to the newest event's time and ``dp_rank`` to the events' own (they must
    agree); an empty batch has none (nil).

    ``mapper`` is the ``VllmMapper`` following this worker's stream: a ``Cleared`` of G2 or G3
    becomes the removal of what that tier held, which only a mapper that has seen the stream
    (or was seeded with the state) knows. Without one, such a ``Cleared`` is an error.
    """
    wanted = None if tiers is None else set(tiers)
    stateless = mapper is None
    if mapper is None:
        published = {t: m for t, m in media.items() if wanted is None or t in wanted}
        mapper = VllmMapper(block_size, media=published)
    elif mapper.block_size != block_size:
        raise ValueError(f"the mapper packs blocks of {mapper.block_size}, not {block_size}")
    chosen: list[AnyEvent] = []
    newest = 0.0
    ranks: set[int] = set()
    for event in events:
        newest = max(newest, event.ts)
        ranks.add(event.dp_rank)
        if wanted is not None and event.tier not in wanted:
            continue
        if event.tier not in mapper.media:
            raise ValueError(
                f"vLLM has no medium for tier {event.tier.name} (event {event.event_id}); "
                f"known: {', '.join(t.name for t in mapper.media)} -- filter it out with tiers="
            )
        if stateless and isinstance(event, Cleared) and event.tier != Tier.G1:
            raise ValueError(
                f"Cleared on {event.tier.name} (event {event.event_id}) becomes the removal of "
                "what that tier held: pass the VllmMapper that followed this worker's stream "
                "(mapper=), or filter the tier out with tiers="
            )
        chosen.append(event)
    if dp_rank is None and ranks:
        if len(ranks) > 1:
            raise ValueError(f"a vLLM batch has one dp rank; events carry {sorted(ranks)}")
        dp_rank = ranks.pop()
    return encode_events(chosen, mapper, ts=newest if ts is None else ts, dp_rank=dp_rank)
