"""Decode a whole chunk of log records at once, with array operations instead of Python per row.

Replay reads rows faster than Python code can look at them one by one. The writer lays every
record out with fixed-width fields (``codec.py``), so for a chunk of records joined into one
buffer each field sits at an offset the fields before it determine: numpy can check every
tag byte, length and cross-field rule of all records together and gather their hashes.

Every version 3 record's checksum is verified: its CRC-32 (one ``zlib.crc32`` call per record,
the only per-record Python work, about 0.2 us; computed by replay's compiled reader as it reads
the row, where that serves) compared with the CRC residue as an array. The rows'
``ts`` column, which replay uses to cut a ``--until-ts`` prefix and to date checkpoints, is
compared with the verified timestamp inside each record.

The decoder vouches only for what it fully checked. It returns None when any record of the
chunk is not in the writer's exact layout, fails its checksum, disagrees with its ``ts``
column or breaks the per-worker event-id sequence (a repeat or a gap); the caller then
decodes that chunk record by record, which accepts any valid encoding and raises the precise
error. So both paths agree on every input, good or bad (``tests/test_event_codec.py`` checks
this with hypothesis).
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
from numpy.lib.stride_tricks import as_strided

from kvledger.events.codec import (
    BIN32,
    BLOCK_WIDTH,
    CHECK_BYTES,
    CHECK_RESIDUE,
    CHECK_TAG,
    FIXARRAY,
    FLOAT64,
    HEADER_BYTES,
    INT64,
    LOG_RECORD_VERSION,
    LOOKUP_CODES,
    NIL,
    UINT64,
    UNCHECKED_VERSION,
)
from kvledger.events.types import Tier
from kvledger.registry.columns import BlockOps
from kvledger.registry.state import TierKey

Bytes = npt.NDArray[np.uint8]
Ints = npt.NDArray[np.int64]

# per kind code (index), a version 3 record's array header byte, or -1 (no byte) for codes
# that are not kinds; a version 2 record has one field (the checksum) fewer
_FIXARRAY = np.full(256, -1, np.int16)
for _kind, _byte in FIXARRAY.items():
    _FIXARRAY[_kind] = _byte
_TIER = np.zeros(256, np.bool_)
_TIER[[int(t) for t in Tier]] = True
# bytes per block, per kind code (a clear has no blocks; its entry only keeps arithmetic simple)
_WIDTH = np.array([8, *(BLOCK_WIDTH[kind] for kind in range(1, 5)), 8], np.int64)
# the smallest record of each kind: header, then nil parent + one block + nil tokens; one
# hash; source tier + one block + nil roots
_MIN_BYTES = np.zeros(256, np.int64)
_MIN_BYTES[1:6] = [
    HEADER_BYTES + 1 + 5 + 16 + 1,
    HEADER_BYTES + 5 + 8,
    HEADER_BYTES + 1 + 5 + 24 + 1,
    HEADER_BYTES + 1 + 5 + 24 + 1,
    HEADER_BYTES,
]
_MIN_BYTES[list(LOOKUP_CODES)] = HEADER_BYTES
_LOOKUP = np.zeros(256, np.bool_)
_LOOKUP[list(LOOKUP_CODES)] = True
_HEADER_TAGS = ((3, INT64), (12, UINT64), (21, INT64), (31, FLOAT64))


@dataclass(frozen=True, slots=True)
class Headers:
    """Every record's header fields, in chunk order (what ``inspect --check`` compares with
    the row's columns)."""

    version: npt.NDArray[np.uint8]
    kind: npt.NDArray[np.uint8]
    worker: Ints
    event_id: npt.NDArray[np.uint64]
    tier: npt.NDArray[np.uint8]


@dataclass(frozen=True, slots=True)
class DecodedChunk:
    ops: dict[TierKey, BlockOps]
    last_event_id: dict[int, int]  # per worker in the chunk, its last event id
    headers: Headers | None = None  # every record's, those after the event-id bound too
    events: int = 0  # event records folded (those within the event-id bound)

    @property
    def lookup_records(self) -> int:
        """How many of the chunk's records were lookup records (which fold nothing)."""
        return 0 if self.headers is None else int(_LOOKUP[self.headers.kind].sum())


def decode_chunk(
    payloads: Sequence[bytes],
    last_event_id: Mapping[int, int],
    ts: npt.NDArray[np.float64] | None = None,
    until_event_id: int | None = None,
) -> DecodedChunk | None:
    """The block operations of a chunk of records, or None where the chunk needs the
    record-by-record path. ``last_event_id`` is each worker's last event before the chunk;
    ``ts``, the rows' ``ts`` column, to be checked against the records. With
    ``until_event_id``, records of later events are checked but not folded."""
    joined, starts, ends, crcs = join_records(payloads)
    buf = np.frombuffer(joined, np.uint8)
    return decode_joined(buf, starts, ends, crcs, last_event_id, ts, until_event_id)


def join_records(payloads: Sequence[bytes]) -> tuple[bytes, Ints, Ints, npt.NDArray[np.uint32]]:
    """``payloads`` end to end, where each starts and ends there, and each one's CRC-32: the
    form ``decode_joined`` reads (and replay's compiled reader builds as it reads)."""
    n = len(payloads)
    lengths = np.fromiter(map(len, payloads), np.int64, n)
    ends = np.cumsum(lengths)
    crcs = np.fromiter(map(zlib.crc32, payloads), np.uint32, n)
    return b"".join(payloads), ends - lengths, ends, crcs


def decode_joined(
    buf: Bytes,
    starts: Ints,
    ends: Ints,
    crcs: npt.NDArray[np.uint32],
    last_event_id: Mapping[int, int],
    ts: npt.NDArray[np.float64] | None = None,
    until_event_id: int | None = None,
) -> DecodedChunk | None:
    """``decode_chunk`` of records already laid in one buffer: record ``i`` is
    ``buf[starts[i]:ends[i]]`` and ``crcs[i]`` its CRC-32 (how replay's compiled reader hands
    a chunk over, ``reader.RowChunk``). The buffer may hold other bytes around them."""
    n = len(starts)
    if not n:
        return DecodedChunk({}, {})
    lengths = ends - starts
    if (lengths < HEADER_BYTES).any():
        return None
    head = _window(buf, HEADER_BYTES)[starts]
    kind = head[:, 2]
    checked = head[:, 1] == LOG_RECORD_VERSION
    if not checked.all() and not (checked | (head[:, 1] == UNCHECKED_VERSION)).all():
        return None
    # a version 3 record ends with its checksum field, which a version 2 record lacks
    tail = np.where(checked, CHECK_BYTES, 0)
    if (head[:, 0] != _FIXARRAY[kind] - (tail == 0)).any():
        return None
    if (lengths < _MIN_BYTES[kind] + tail).any():
        return None
    for at, byte in _HEADER_TAGS:
        if (head[:, at] != byte).any():
            return None
    if checked.any() and not _checksums_match(crcs, buf, ends, checked):
        return None
    if ts is not None and (np.ascontiguousarray(head[:, 32:40]).view(">f8").ravel() != ts).any():
        return None
    tier = head[:, 30]
    if not _TIER[tier].all():
        return None
    worker = np.ascontiguousarray(head[:, 4:12]).view(">i8").ravel()
    event_id = np.ascontiguousarray(head[:, 13:21]).view(">u8").ravel()
    headers = Headers(head[:, 1], kind, worker, event_id, tier)
    lookups = _LOOKUP[kind]
    if lookups.any():
        # lookup records fold nothing: verified above (checksum, header, ts), then left out
        if not checked[lookups].all():
            return None
        events = ~lookups
        if not events.any():
            return DecodedChunk({}, {}, headers)
        starts, ends, tail = starts[events], ends[events], tail[events]
        kind, tier, worker, event_id = kind[events], tier[events], worker[events], event_id[events]
        n = len(kind)
    body = _Body.parse(buf, starts + HEADER_BYTES, ends - tail, kind, tier)
    if body is None:
        return None
    if until_event_id is not None:
        keep = event_id <= until_event_id if until_event_id >= 0 else np.zeros(n, np.bool_)
        if not keep.all():
            body, worker, tier, event_id = body.only(keep), worker[keep], tier[keep], event_id[keep]
            if not len(worker):
                return DecodedChunk({}, {}, headers)
    new_last = _check_event_ids(worker, event_id, last_event_id)
    if new_last is None:
        return None
    return DecodedChunk(body.ops(buf, worker, tier), new_last, headers, len(worker))


def _checksums_match(
    crcs: npt.NDArray[np.uint32], buf: Bytes, ends: Ints, checked: npt.NDArray[np.bool_]
) -> bool:
    """Whether every version 3 record (``checked``) ends with its checksum field and passes
    it: the CRC-32 of a whole intact record (``crcs``) is the residue."""
    if (buf[ends[checked] - CHECK_BYTES] != CHECK_TAG).any():
        return False
    return bool((crcs[checked] == CHECK_RESIDUE).all())


def _window(buf: Bytes, width: int) -> Bytes:
    """Every ``width``-byte run of ``buf`` as a row (a view, no copy)."""
    rows = max(len(buf) - width + 1, 0)
    return as_strided(buf, shape=(rows, width), strides=(1, 1), writeable=False)


def _u64(buf: Bytes, at: Ints) -> npt.NDArray[np.uint64]:
    return _window(buf, 8)[at].view(">u8").ravel().astype(np.uint64)


def _u32(buf: Bytes, at: Ints) -> Ints:
    return _window(buf, 4)[at].view(">u4").ravel().astype(np.int64)


def _check_event_ids(
    worker: Ints, event_id: npt.NDArray[np.uint64], last_event_id: Mapping[int, int]
) -> dict[int, int] | None:
    """Each worker's last id, if every worker's ids in the chunk continue its sequence by 1."""
    if (worker == worker[0]).all():
        groups = [(int(worker[0]), event_id)]
    else:
        order = np.argsort(worker, kind="stable")
        sorted_workers = worker[order]
        cuts = np.flatnonzero(sorted_workers[1:] != sorted_workers[:-1]) + 1
        groups = [
            (int(ids_of[0]), event_id[order[ids]])
            for ids, ids_of in zip(
                np.split(np.arange(len(order)), cuts), np.split(sorted_workers, cuts), strict=True
            )
        ]
    out: dict[int, int] = {}
    for w, ids in groups:
        first = last_event_id.get(w, -1) + 1
        if int(ids[0]) != first or (len(ids) > 1 and (np.diff(ids) != 1).any()):
            return None
        out[w] = first + len(ids) - 1
    return out


@dataclass(frozen=True, slots=True)
class _Body:
    """Where each record's blocks are, once every record's body has checked out."""

    kind: npt.NDArray[np.uint8]
    count: Ints  # blocks per record (0 for a clear)
    blocks_at: Ints  # offset of the first block's bytes
    parent_at: Ints  # stored: offset of the parent word, -1 for nil
    roots_at: Ints  # copies: offset of the root flags, -1 when roots is nil

    @classmethod
    def parse(
        cls,
        buf: Bytes,
        body: Ints,
        ends: Ints,
        kind: npt.NDArray[np.uint8],
        tier: npt.NDArray[np.uint8],
    ) -> _Body | None:
        last = len(buf) - 1
        stored, removed = kind == 1, kind == 2
        copied = (kind == 3) | (kind == 4)
        cleared = kind == 5
        if (cleared & (body != ends)).any():
            return None
        # where the hash bin starts: after a stored event's parent, a copy's source tier
        parent_tag = buf[np.minimum(body, last)]
        nil_parent = stored & (parent_tag == NIL)
        has_parent = stored & (parent_tag == UINT64)
        if (stored & ~nil_parent & ~has_parent).any():
            return None
        source = parent_tag  # the same byte, for copies
        if (copied & (~_TIER[source] | (source == tier))).any():
            return None
        bin_at = body + np.where(has_parent, 9, np.where(removed, 0, 1))
        with_blocks = ~cleared
        tags = buf[np.minimum(bin_at[with_blocks], last)]
        if (tags != BIN32).any():
            return None
        size = np.zeros(len(kind), np.int64)
        size[with_blocks] = _u32(buf, np.minimum(bin_at[with_blocks] + 1, last - 3))
        width = _WIDTH[kind]
        count = size // width
        if (with_blocks & ((size == 0) | (size % width != 0))).any():
            return None
        blocks_at = bin_at + 5
        after = blocks_at + size
        # what follows the blocks: nil or a token bin ending a stored record, nothing after
        # removed hashes, nil or a bin of one flag per block ending a copy
        tail = buf[np.minimum(after, last)]
        with_tokens = stored & (tail == BIN32)
        if (stored & ~with_tokens & ((tail != NIL) | (after + 1 != ends))).any():
            return None
        if with_tokens.any() and not _tokens_fit(buf, after, ends, count, with_tokens):
            return None
        if (removed & (after != ends)).any():
            return None
        roots_tagged = copied & (tail == BIN32)
        if (copied & ~roots_tagged & ((tail != NIL) | (after + 1 != ends))).any():
            return None
        roots_at = np.full(len(kind), -1, np.int64)
        if roots_tagged.any():
            tagged_at = after[roots_tagged]
            if (_u32(buf, np.minimum(tagged_at + 1, last - 3)) != count[roots_tagged]).any():
                return None
            if (tagged_at + 5 + count[roots_tagged] != ends[roots_tagged]).any():
                return None
            roots_at[roots_tagged] = tagged_at + 5
        parent_at = np.where(has_parent, body + 1, -1)
        body_ok = cls(kind, count, blocks_at, parent_at, roots_at)
        if roots_tagged.any() and (body_ok.root_flags(buf) > 1).any():
            return None
        return body_ok

    def only(self, keep: npt.NDArray[np.bool_]) -> _Body:
        """The records ``keep`` selects."""
        return _Body(
            self.kind[keep],
            self.count[keep],
            self.blocks_at[keep],
            self.parent_at[keep],
            self.roots_at[keep],
        )

    def root_flags(self, buf: Bytes) -> Bytes:
        """Every copied block's root flag in record order (records with roots only)."""
        tagged = self.roots_at >= 0
        counts = np.where(tagged, self.count, 0)
        return buf[_spread(self.roots_at, counts, 1)]

    def ops(self, buf: Bytes, worker: Ints, tier: npt.NDArray[np.uint8]) -> dict[TierKey, BlockOps]:
        kind, count = self.kind, self.count
        total = int(count.sum())
        block_kind = np.repeat(kind, count)
        width = _WIDTH[block_kind]
        index = _index_in_record(count)
        at = np.repeat(self.blocks_at, count) + index * width
        seq = _u64(buf, at)
        store = block_kind != 2
        local = np.zeros(total, np.uint64)
        local[store] = _u64(buf, at[store] + 8)
        parent = np.zeros(total, np.uint64)
        has_parent = np.zeros(total, np.bool_)
        # a copy carries each block's parent, with a root flag where it has none
        copied = block_kind >= 3
        parent[copied] = _u64(buf, at[copied] + 16)
        has_parent[copied] = True
        if (self.roots_at >= 0).any():
            roots = np.zeros(total, np.bool_)
            tagged = np.repeat(self.roots_at >= 0, count)
            roots[tagged] = self.root_flags(buf).astype(np.bool_)
            has_parent[roots] = False
        # a stored chain: each block's parent is the block before it, the first one's the
        # record's parent hash (or none)
        first = np.cumsum(count) - count
        chained = (block_kind == 1) & (index > 0)
        parent[chained] = seq[np.flatnonzero(chained) - 1]
        has_parent[chained] = True
        with_parent = self.parent_at >= 0
        parent[first[with_parent]] = _u64(buf, self.parent_at[with_parent])
        has_parent[first[with_parent]] = True
        return _split_by_tier(worker, tier, kind == 5, count, seq, local, parent, has_parent, store)


def _tokens_fit(buf: Bytes, at: Ints, ends: Ints, count: Ints, mine: npt.NDArray[np.bool_]) -> bool:
    """Whether each token bin at ``at`` (records ``mine``) ends its record and holds what its
    counts say: one u32 count per block, then as many u32 ids as the counts add up to."""
    at, ends, count = at[mine], ends[mine], count[mine]
    size = _u32(buf, np.minimum(at + 1, len(buf) - 4))
    words = size // 4
    if (at + 5 + size != ends).any() or (size % 4 != 0).any() or (words < count).any():
        return False
    counts = _u32(buf, _spread(at + 5, count, 4))
    per_record = np.add.reduceat(counts, np.cumsum(count) - count)
    return bool((per_record == words - count).all())


def _index_in_record(count: Ints) -> Ints:
    """For blocks laid out record after record, each block's index within its record."""
    total = int(count.sum())
    first = np.cumsum(count) - count
    return np.arange(total) - np.repeat(first, count)


def _spread(start: Ints, count: Ints, width: int) -> Ints:
    """Byte offsets of ``count[i]`` items ``width`` apart from ``start[i]``, record by record."""
    return np.repeat(start, count) + _index_in_record(count) * width


def _split_by_tier(
    worker: Ints,
    tier: npt.NDArray[np.uint8],
    clears: npt.NDArray[np.bool_],
    count: Ints,
    seq: npt.NDArray[np.uint64],
    local: npt.NDArray[np.uint64],
    parent: npt.NDArray[np.uint64],
    has_parent: npt.NDArray[np.bool_],
    store: npt.NDArray[np.bool_],
) -> dict[TierKey, BlockOps]:
    """One batch per (worker, tier), in log order; a clear drops that tier's earlier blocks."""
    workers, worker_index = np.unique(worker, return_inverse=True)
    record_key = worker_index.astype(np.int64) * 256 + tier
    block_key = np.repeat(record_key, count)
    block_record = np.repeat(np.arange(len(count)), count)
    out: dict[TierKey, BlockOps] = {}
    for key in np.unique(record_key).tolist():
        mine = block_key == key
        cleared_by = np.flatnonzero(clears & (record_key == key))
        if len(cleared_by):
            mine &= block_record > cleared_by[-1]
        out[(int(workers[key // 256]), Tier(key % 256))] = BlockOps(
            seq[mine],
            local[mine],
            parent[mine],
            has_parent[mine],
            store[mine],
            cleared=bool(len(cleared_by)),
        )
    return out
