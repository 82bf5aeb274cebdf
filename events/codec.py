"""msgpack encoding of events and registry snapshots.

One event is one self-contained record (a msgpack array) that starts with the schema version
and ends with a checksum, so a log row can be decoded and verified without its columns, a
record from another layout is refused instead of misread, and a record whose bytes changed
after it was written is refused instead of replayed.

Record layout, version 3::

    [3, kind, worker_id, event_id, dp_rank, tier, ts, *body, check]
    stored (1):                parent_hash|nil, blocks: bin of (seq, local), token_ids: nil|bin
    removed (2):               hashes: bin of seq
    offloaded/onboarded (3/4): src_tier, blocks: bin of (seq, local, parent), roots: nil|bin
    cleared (5):               (no body)
    lookup (6):                request_id, num_tokens, start, hits G1, G2, G3, hashes: bin of seq
    release (7):               request_id
    run (8):                   g1_blocks, g2_blocks, g3_blocks, block_size, policy, offload_filter

Kinds 6 to 8 are lookup records (``types.Lookup``, ``Released``, ``RunInfo``): their worker
field holds ``lookup_stream(worker_id)`` (negative) and their ids count their own stream, so
they never mix with a worker's transitions. Replay verifies their checksum and skips them
without reading their body (``lookup_record_ts``).

Hashes are u64 and travel packed, big-endian, in one msgpack ``bin`` per event. ``roots``
holds one byte per copied block: 1 where the block has no parent (its parent word is then 0).
It is nil when every block has a parent. ``token_ids`` holds a u32 count per block, then every
block's token ids as u32.

``check`` is a msgpack uint32 (``0xce`` and four bytes) whose four bytes are the CRC-32
(zlib's, stored little-endian) of every byte of the record before them. So the CRC-32 of a
whole intact record is the constant ``CHECK_RESIDUE``: verifying a record is one ``crc32``
call over its bytes, with no slicing. CRC-32 rather than a faster hash such as xxhash because
its detection is guaranteed, not probable: every single-bit flip, every burst of up to 32
flipped bits, and every error of up to 4 bits in a record of up to 371 bytes (which is most
records) changes the CRC; a hash only makes a miss unlikely. Cutting a record short is
detected without the checksum: msgpack is prefix-free, so a cut record is not a complete
array of the length its first byte announces.

Version 2 records are the same without ``check``. They still decode (a log written before
checksums replays), with nothing to verify; version 1 is refused.

The writer always uses the same widths: int64 for ``worker_id`` and ``dp_rank``, uint64 for
``event_id`` and a parent, float64 for ``ts``, bin32 for hashes and token ids. So every field
of a record sits at an offset that the fields before it fix, and the checksum at a fixed
distance from its end. That is what lets replay verify, check and unpack a whole chunk of
records with array operations (``events/chunk_decode.py``) instead of running Python code per
record. Any msgpack reader still reads the records, and ``decode`` accepts any encoding of the
same values (a version 3 record as long as it ends with its checksum field).

Registry snapshots (checkpoints) end with the same kind of checksum field (snapshot version 3).
"""

from __future__ import annotations

import os
import struct
import zlib
from collections.abc import Callable, Iterable, Iterator
from itertools import chain
from typing import Any

import msgpack
import numpy as np

from kvledger.events.types import (
    BlockInfo,
    Cleared,
    LogRecord,
    Lookup,
    Offloaded,
    Onboarded,
    Released,
    Removed,
    RunInfo,
    Stored,
    Tier,
    lookup_stream,
)
from kvledger.registry.columns import BlockColumns
from kvledger.registry.state import RegistryState

LOG_RECORD_VERSION = 3
"""The durable log's record layout (``encode``), which the shared registry's Redis stream
carries too."""
UNCHECKED_VERSION = 2  # the layout before checksums: still read, nothing to verify
SNAPSHOT_VERSION = 3
COVERED_SNAPSHOT_VERSION = 4
"""A checkpoint's snapshot: version 3 and its checkpoint row's columns (``encode_state``)."""
CHECK_TAG = 0xCE  # msgpack uint32: the checksum field's first byte
CHECK_BYTES = 5  # the checksum field: its tag and the four CRC bytes
CHECK_RESIDUE = 0x2144DF1C  # crc32 of any byte string followed by its own CRC, little-endian

KIND_CODES: dict[type[LogRecord], int] = {
    Stored: 1,
    Removed: 2,
    Offloaded: 3,
    Onboarded: 4,
    Cleared: 5,
    Lookup: 6,
    Released: 7,
    RunInfo: 8,
}
KIND_NAMES: dict[type[LogRecord], str] = {
    Stored: "stored",
    Removed: "removed",
    Offloaded: "offloaded",
    Onboarded: "onboarded",
    Cleared: "cleared",
    Lookup: "lookup",
    Released: "release",
    RunInfo: "run",
}
LOOKUP_CODES = frozenset((6, 7, 8))
"""Kind codes of lookup records: verified and skipped by replay, read by ``whatif``."""
_TIERS: dict[int, Tier] = {int(t): t for t in Tier}
_HEADER_LEN = 7
_BODY_LEN = {1: 3, 2: 1, 3: 3, 4: 3, 5: 0, 6: 7, 7: 1, 8: 6}
# bytes per block in each kind's hash bin
BLOCK_WIDTH = {1: 16, 2: 8, 3: 24, 4: 24}

# The fixed-width header: fixarray, version, kind, int64 worker_id, uint64 event_id,
# int64 dp_rank, fixint tier, float64 ts -- HEADER_BYTES bytes, the same for every record.
_HEADER_FORMAT = ">BBBBqBQBqBBd"
HEADER_BYTES = struct.calcsize(_HEADER_FORMAT)
# the array header byte per kind, in a version 3 record (one field more than version 2)
FIXARRAY = {kind: 0x90 + _HEADER_LEN + n + 1 for kind, n in _BODY_LEN.items()}
_CRC_LE = struct.Struct("<I").pack
crc32 = zlib.crc32
NIL, UINT64, INT64, FLOAT64, BIN32 = 0xC0, 0xCF, 0xD3, 0xCB, 0xC6
_STORED_ARRAY = 0x90 + 7 + 3 + 1  # FIXARRAY[1], spelled out for the hot encoders
_REMOVED_ARRAY = 0x90 + 7 + 1 + 1  # FIXARRAY[2]


class _Packers(dict[int, struct.Struct]):
    """One record shape's packers by block count, built on first use (building a Struct
    costs more than using it)."""

    def __init__(self, body: str, kind: int) -> None:
        super().__init__()
        self.body = body  # the format after the header: {w} hash words, {n} blocks
        self.words_per_block = BLOCK_WIDTH[kind] // 8

    def __missing__(self, n: int) -> struct.Struct:
        body = self.body.format(n=n, w=self.words_per_block * n)
        packer = self[n] = struct.Struct(_HEADER_FORMAT + body + "B")  # + the check tag
        return packer


# stored: parent (nil or uint64), the (seq, local) words, nil token ids (a record with token
# ids drops that nil); removed: the seq words; a copy: its source tier and (seq, local,
# parent) words, then nil roots or a bin of n root flags; a clear: the header alone. Each
# packer ends with the checksum field's tag byte; ``encode`` appends the CRC.
_STORED_ROOT = _Packers("BBI{w}QB", 1)
_STORED = _Packers("BQBI{w}QB", 1)
_REMOVED = _Packers("BI{w}Q", 2)
_COPIED = _Packers("BBI{w}QB", 3)
_COPIED_ROOTS = _Packers("BBI{w}QBI{n}B", 3)
_CLEARED = struct.Struct(_HEADER_FORMAT + "B")
# a lookup: request id (uint64), then tokens, start and the three hit counts (uint32 each),
# then the asked hashes; a release: the request id
_LOOKUP = _Packers("BQBIBIBIBIBIBI{w}Q", 2)
_RELEASE = struct.Struct(_HEADER_FORMAT + "BQB")
_U32 = 0xCE


class CodecError(ValueError):
    """A record that cannot be decoded (or an event that cannot be encoded).

    ``position`` is where the record sits (a log row id, or an index in a stream) so that the
    message points at the bad record rather than only describing it.
    """

    def __init__(self, message: str, position: int | None = None) -> None:
        self.position = position
        self.last_good: int | None = None  # set by replay: the row before, which is intact
        where = "event" if position is None else f"event at position {position}"
        super().__init__(f"{where}: {message}")


def encode(event: LogRecord) -> bytes:
    """One event as a version-3 record, checksum included.

    Refuses (``CodecError``) whatever ``decode`` would refuse, so that no record is ever
    written that replay cannot read back. ``struct`` checks the type and range of every
    hash, id and token id as it packs them (a negative event id fails ``Q``, a ts that is not
    a number fails ``d``); what it would take that ``decode`` refuses (a bool or another int
    subclass for an id, a tier it does not know) is checked before.

    Each kind has its own encoder (``ENCODERS``), found by the event's exact type: one
    dictionary look-up where a chain of kind tests cost the hot kinds (stored, removed) a
    third of their encode. The hot kinds' encoders check and pack the header themselves and
    append the CRC, one Python call per event (profiled: the header helper and the CRC step
    were each a call of their own, together a third of an encode).
    """
    encoder = ENCODERS.get(type(event))
    if encoder is None:
        raise CodecError(f"not an event: {event!r}")
    try:
        return encoder(event)
    except (OverflowError, TypeError, struct.error) as exc:
        raise CodecError(f"cannot encode {event!r}: {exc}") from None


def _bad_head(event: LogRecord) -> CodecError:
    return CodecError(
        f"worker_id, dp_rank and event_id >= 0 must be integers, tier a Tier and ts a "
        f"number in {event!r}"
    )


def _head(event: LogRecord, kind: int) -> tuple[Any, ...]:
    """The header's fields (array length, version, kind, then each value after its msgpack
    tag), checked: what the packers of the rarer kinds pack first."""
    worker_id = event.worker_id
    event_id = event.event_id
    dp_rank = event.dp_rank
    tier = event.tier
    ts = event.ts
    if (
        type(worker_id) is not int
        or type(event_id) is not int
        or type(dp_rank) is not int
        or event_id < 0
        or tier not in _TIERS
        or (type(ts) is not float and type(ts) is not int)
    ):
        raise _bad_head(event)
    if kind in LOOKUP_CODES:
        worker_id = lookup_stream(worker_id)
    # fmt: off
    return (FIXARRAY[kind], LOG_RECORD_VERSION, kind, INT64, worker_id, UINT64, event_id,
            INT64, dp_rank, tier, FLOAT64, ts)
    # fmt: on


def _stored(event: Stored) -> bytes:
    """A stored event's whole record (``encode`` without the dispatch)."""
    worker_id = event.worker_id
    event_id = event.event_id
    dp_rank = event.dp_rank
    tier = event.tier
    if (
        type(worker_id) is not int
        or type(event_id) is not int
        or type(dp_rank) is not int
        or tier not in _TIERS
    ):
        raise _bad_head(event)
    blocks = event.blocks
    n = len(blocks)
    # struct checks the word count; with more than one block, a short block and a long one
    # could make up for each other
    if not n or (n > 1 and min(map(len, blocks)) != 2):
        raise CodecError(f"stored blocks must be a non-empty chain of pairs: {event!r}")
    parent = event.parent_hash
    words = chain.from_iterable(blocks)
    # fmt: off
    if parent is None:
        data = _STORED_ROOT[n].pack(
            _STORED_ARRAY, 3, 1, INT64, worker_id, UINT64, event_id, INT64, dp_rank, tier,
            FLOAT64, event.ts, NIL, BIN32, 16 * n, *words, NIL, CHECK_TAG)
    else:
        data = _STORED[n].pack(
            _STORED_ARRAY, 3, 1, INT64, worker_id, UINT64, event_id, INT64, dp_rank, tier,
            FLOAT64, event.ts, UINT64, parent, BIN32, 16 * n, *words, NIL, CHECK_TAG)
    # fmt: on
    tokens = event.token_ids
    if tokens is not None:
        data = data[:-2] + _token_bin(tokens, n) + data[-1:]
    return data + _CRC_LE(crc32(data))


def _removed(event: Removed) -> bytes:
    """A removed event's whole record (``encode`` without the dispatch)."""
    worker_id = event.worker_id
    event_id = event.event_id
    dp_rank = event.dp_rank
    tier = event.tier
    if (
        type(worker_id) is not int
        or type(event_id) is not int
        or type(dp_rank) is not int
        or tier not in _TIERS
    ):
        raise _bad_head(event)
    hashes = event.sequence_hashes
    n = len(hashes)
    if not n:
        raise CodecError(f"removed hashes must be a non-empty sequence: {event!r}")
    # fmt: off
    data = _REMOVED[n].pack(
        _REMOVED_ARRAY, 3, 2, INT64, worker_id, UINT64, event_id, INT64, dp_rank, tier,
        FLOAT64, event.ts, BIN32, 8 * n, *hashes, CHECK_TAG)
    # fmt: on
    return data + _CRC_LE(crc32(data))


def _copied(event: Offloaded | Onboarded) -> bytes:
    head = _head(event, KIND_CODES[type(event)])
    infos = event.blocks
    n = len(infos)
    if not n or min(map(len, infos)) != 3:
        raise CodecError(f"copied blocks must be non-empty BlockInfo triples: {event!r}")
    src = event.src_tier
    if src not in _TIERS or src == event.tier:
        raise CodecError(f"a copy needs two different tiers: {event!r}")
    flat = list(chain.from_iterable(infos))
    if None in flat:  # a parentless block (a None elsewhere fails to pack)
        parents = flat[2::3]
        roots = [p is None for p in parents]
        flat[2::3] = [0 if p is None else p for p in parents]
        return _COPIED_ROOTS[n].pack(*head, src, BIN32, 24 * n, *flat, BIN32, n, *roots, CHECK_TAG)
    return _COPIED[n].pack(*head, src, BIN32, 24 * n, *flat, NIL, CHECK_TAG)


def _cleared(event: Cleared) -> bytes:
    return _CLEARED.pack(*_head(event, 5), CHECK_TAG)


def _lookup(event: Lookup) -> bytes:
    head = _head(event, 6)
    hashes, hits = event.sequence_hashes, event.hits
    if type(hits) is not tuple or len(hits) != 3:
        raise CodecError(f"lookup hits must be three counts (G1, G2, G3): {event!r}")
    n = len(hashes)
    # fmt: off
    return _LOOKUP[n].pack(
        *head, UINT64, event.request_id, _U32, event.num_tokens, _U32, event.start,
        _U32, hits[0], _U32, hits[1], _U32, hits[2], BIN32, 8 * n, *hashes, CHECK_TAG,
    )
    # fmt: on


def _released(event: Released) -> bytes:
    return _RELEASE.pack(*_head(event, 7), UINT64, event.request_id, CHECK_TAG)


def _run(event: RunInfo) -> bytes:
    head = _head(event, 8)
    fields = (event.g1_blocks, event.g2_blocks, event.g3_blocks, event.block_size)
    if {*map(type, fields)} != {int} or min(fields) < 0:
        raise CodecError(f"run capacities and block size must be integers >= 0: {event!r}")
    if type(event.policy) is not str or type(event.offload_filter) is not str:
        raise CodecError(f"run policy and offload filter must be strings: {event!r}")
    body = b"".join(msgpack.packb(v) for v in (*fields, event.policy, event.offload_filter))
    return _CLEARED.pack(*head, CHECK_TAG)[:-1] + body + bytes([CHECK_TAG])


def _with_crc(packer: Callable[[Any], bytes]) -> Callable[[Any], bytes]:
    """A rarer kind's packer (``_head`` and its body) with the CRC appended."""

    def encoder(event: Any) -> bytes:
        data = packer(event)
        return data + _CRC_LE(crc32(data))

    return encoder


COMPILED: dict[type[LogRecord], Callable[[Any], bytes | None]] = {}
"""The kinds ``events/_speedups.c`` encodes (the hot ones): the same bytes as the Python
encoders at a third to a fifth of their cost (``tests/test_codec_compiled.py`` holds them to
the same records). Each returns None where it leaves the event to the Python encoder: all but
the plain case (exact ints in range, a float ts), so every error and its message stay in one
place. Empty where the module was not built (no C compiler at install) or
``KVLEDGER_PYTHON_ENCODERS=1`` is in the environment (to measure it, or to rule it out)."""
LogRow = tuple[int, int, str, int, float, bytes]
"""A log row's columns (``rows.Row``: worker, event id, kind, tier, ts, record), as the
compiled encoders build them."""
COMPILED_ROWS: dict[type[LogRecord], Callable[[Any], LogRow | None]] = {}
"""The same kinds' whole log rows (``rows.to_row``), built in the same call."""
COMPILED_STORED_ROW_WITHOUT_TOKENS: Callable[[Stored], LogRow | None] | None = None
"""A stored event's row with its token ids left out (``rows.to_row_without_tokens``)."""
try:
    from kvledger.events import _speedups
except ImportError:  # the Python encoders serve
    pass
else:
    if os.environ.get("KVLEDGER_PYTHON_ENCODERS", "") in ("", "0"):
        COMPILED = {
            Stored: _speedups.stored,
            Removed: _speedups.removed,
            Offloaded: _speedups.offloaded,
            Onboarded: _speedups.onboarded,
        }
        COMPILED_ROWS = {
            Stored: _speedups.stored_row,
            Removed: _speedups.removed_row,
            Offloaded: _speedups.offloaded_row,
            Onboarded: _speedups.onboarded_row,
        }
        COMPILED_STORED_ROW_WITHOUT_TOKENS = _speedups.stored_row_without_tokens


def _compiled_or(kind: type[LogRecord], python: Callable[[Any], bytes]) -> Callable[[Any], bytes]:
    """``kind``'s encoder: the compiled one where there is one, which leaves all but the plain
    case (exact ints in range, a float ts) to ``python``, and so every error and its message."""
    compiled = COMPILED.get(kind)
    if compiled is None:
        return python

    def encoder(event: Any) -> bytes:
        return compiled(event) or python(event)

    return encoder


PYTHON_ENCODERS: dict[type[LogRecord], Callable[[Any], bytes]] = {
    Stored: _stored,
    Removed: _removed,
    Offloaded: _with_crc(_copied),
    Onboarded: _with_crc(_copied),
    Cleared: _with_crc(_cleared),
    Lookup: _with_crc(_lookup),
    Released: _with_crc(_released),
    RunInfo: _with_crc(_run),
}
"""Each kind's whole record by Python, CRC included; every kind of ``KIND_CODES`` has one.
They raise ``struct.error``, ``TypeError`` or ``OverflowError`` for what does not pack:
``encode`` turns those into ``CodecError``."""
ENCODERS: dict[type[LogRecord], Callable[[Any], bytes]] = {
    kind: _compiled_or(kind, python) for kind, python in PYTHON_ENCODERS.items()
}
"""What ``encode`` looks up (and is the error for): ``PYTHON_ENCODERS``, the compiled one in
front where there is one (``COMPILED``)."""


def decode(data: bytes, position: int | None = None) -> LogRecord:
    """The event in ``data``; ``CodecError`` (naming ``position``) for anything else, and
    for a version 3 record whose checksum does not match its bytes."""
    intact = (
        len(data) > CHECK_BYTES
        and data[-CHECK_BYTES] == CHECK_TAG
        and zlib.crc32(data) == CHECK_RESIDUE
    )
    try:
        try:
            record = msgpack.unpackb(data, use_list=False, raw=False, strict_map_key=True)
        except Exception as exc:  # msgpack raises several unrelated types for bad input
            raise CodecError(
                f"not a msgpack record ({type(exc).__name__}: {exc})", position
            ) from None
        return _from_record(record, position, intact)
    except CodecError:
        if not intact and len(data) > HEADER_BYTES and data[-CHECK_BYTES] == CHECK_TAG:
            # it ends like a checksummed record: whatever broke, its bytes changed
            raise CodecError(DAMAGED, position) from None
        raise


DAMAGED = "damaged: its checksum does not match its bytes (they changed after it was written)"


def _from_record(record: object, position: int | None, intact: bool) -> LogRecord:
    """Validate an unpacked record and build its event; ``intact``: whether the record's
    bytes pass the checksum (required of version 3, which then loses its check field)."""
    if type(record) is not tuple or not record:
        raise CodecError(f"expected an array of at least {_HEADER_LEN} fields", position)
    version = record[0]
    if type(version) is int and version == LOG_RECORD_VERSION:
        if not intact or type(record[-1]) is not int:
            raise CodecError(DAMAGED, position)
        record = record[:-1]
    elif type(version) is not int or version != UNCHECKED_VERSION:
        written_by = (
            "an older" if type(version) is int and version < LOG_RECORD_VERSION else "a newer"
        )
        raise CodecError(
            f"record version {version!r} is not supported (this code reads versions "
            f"{UNCHECKED_VERSION} and {LOG_RECORD_VERSION}); was the log written by {written_by} "
            f"kvledger?",
            position,
        )
    if len(record) < _HEADER_LEN:
        raise CodecError(f"expected an array of at least {_HEADER_LEN} fields", position)
    _version, kind, worker_id, event_id, dp_rank, tier_code, ts = record[:_HEADER_LEN]
    if type(kind) is not int or kind not in _BODY_LEN:
        raise CodecError(f"unknown event kind code {kind!r}", position)
    if kind in LOOKUP_CODES and version != LOG_RECORD_VERSION:
        raise CodecError(f"a lookup record (kind {kind}) must be version 3", position)
    if len(record) != _HEADER_LEN + _BODY_LEN[kind]:
        raise CodecError(
            f"kind {kind} needs {_HEADER_LEN + _BODY_LEN[kind]} fields, got {len(record)}",
            position,
        )
    if type(worker_id) is not int or type(event_id) is not int or type(dp_rank) is not int:
        raise CodecError("worker_id, event_id and dp_rank must be integers", position)
    if event_id < 0:
        raise CodecError(f"negative event_id {event_id}", position)
    tier = _TIERS.get(tier_code) if type(tier_code) is int else None
    if tier is None:
        raise CodecError(f"unknown tier {tier_code!r}", position)
    if type(ts) is not float and type(ts) is not int:
        raise CodecError(f"timestamp must be a number, got {ts!r}", position)
    common: dict[str, Any] = {
        "event_id": event_id,
        "worker_id": worker_id,
        "dp_rank": dp_rank,
        "tier": tier,
        "ts": float(ts),
    }
    if kind == 5:
        return Cleared(**common)
    if kind in LOOKUP_CODES:
        common["worker_id"] = lookup_stream(worker_id)
        return _lookup_from(kind, record[_HEADER_LEN:], common, position)
    if kind == 1:
        parent, blob, tokens = record[7:]
        if parent is not None and (type(parent) is not int or not 0 <= parent < 2**64):
            raise CodecError(f"parent hash must be a u64 or nil, got {parent!r}", position)
        words = _words(blob, BLOCK_WIDTH[1], position)
        return Stored(
            **common,
            parent_hash=parent,
            blocks=tuple(zip(words[0::2], words[1::2], strict=True)),
            token_ids=_tokens(tokens, len(words) // 2, position),
        )
    if kind == 2:
        return Removed(**common, sequence_hashes=_words(record[7], BLOCK_WIDTH[2], position))
    src_code, blob, roots = record[7:]
    src = _TIERS.get(src_code) if type(src_code) is int else None
    if src is None or src == tier:
        raise CodecError(f"bad source tier {src_code!r} for a copy to {tier.name}", position)
    words = _words(blob, BLOCK_WIDTH[kind], position)
    parents: tuple[int | None, ...] = words[2::3]
    if roots is not None:
        if type(roots) is not bytes or len(roots) != len(parents) or not set(roots) <= {0, 1}:
            raise CodecError(
                f"roots must be nil or one 0/1 byte per block ({len(parents)})", position
            )
        parents = tuple(None if root else p for p, root in zip(parents, roots, strict=True))
    infos = tuple(map(BlockInfo, words[0::3], words[1::3], parents))
    cls = Offloaded if kind == 3 else Onboarded
    return cls(**common, src_tier=src, blocks=infos)


def _lookup_from(
    kind: int, body: tuple[Any, ...], common: dict[str, Any], position: int | None
) -> LogRecord:
    """A lookup record's body, checked field by field."""
    if kind == 8:
        *sizes, policy, offload_filter = body
        if {*map(type, sizes)} != {int} or min(sizes) < 0:
            raise CodecError(f"run sizes must be integers >= 0, got {sizes!r}", position)
        if type(policy) is not str or type(offload_filter) is not str:
            raise CodecError("run policy and offload filter must be strings", position)
        g1, g2, g3, block_size = sizes
        return RunInfo(
            **common,
            g1_blocks=g1,
            g2_blocks=g2,
            g3_blocks=g3,
            block_size=block_size,
            policy=policy,
            offload_filter=offload_filter,
        )
    request_id = body[0]
    if type(request_id) is not int or not 0 <= request_id < 2**64:
        raise CodecError(f"request id must be a u64, got {request_id!r}", position)
    if kind == 7:
        return Released(**common, request_id=request_id)
    *counts, blob = body[1:]
    if {*map(type, counts)} != {int} or min(counts) < 0:
        raise CodecError(f"lookup counts must be integers >= 0, got {counts!r}", position)
    if type(blob) is not bytes or len(blob) % 8:
        raise CodecError(f"lookup hashes must be a bin of 8-byte words, got {_describe(blob)}",
                         position)  # fmt: skip
    num_tokens, start, g1, g2, g3 = counts
    hashes = struct.unpack(f">{len(blob) // 8}Q", blob)
    if g1 + g2 + g3 > len(hashes):
        raise CodecError(f"lookup hits {g1 + g2 + g3} exceed its {len(hashes)} blocks", position)
    return Lookup(
        **common,
        request_id=request_id,
        num_tokens=num_tokens,
        start=start,
        sequence_hashes=hashes,
        hits=(g1, g2, g3),
    )


def lookup_record_ts(data: bytes, position: int | None = None) -> float | None:
    """The timestamp of an intact lookup record, without reading its body; None when ``data``
    is not a lookup record (then ``decode`` it). What replay does with a lookup record: its
    bytes verified, it folds nothing. ``CodecError`` for a damaged one."""
    if len(data) < HEADER_BYTES or data[2] not in LOOKUP_CODES or data[1] != LOG_RECORD_VERSION:
        return None
    if (
        data[0] != FIXARRAY[data[2]]
        or data[-CHECK_BYTES] != CHECK_TAG
        or zlib.crc32(data) != CHECK_RESIDUE
    ):
        decode(data, position)  # a bad record gets decode's error, whichever path reads it
        raise CodecError(DAMAGED, position)
    header = struct.unpack_from(_HEADER_FORMAT, data)
    tags = (header[3], header[5], header[7], header[10])
    if tags != (INT64, UINT64, INT64, FLOAT64) or header[9] not in _TIERS:
        decode(data, position)
        raise CodecError(f"not a lookup record in the writer's layout: {tags}", position)
    ts: float = header[11]
    return ts


def _words(blob: object, width: int, position: int | None) -> tuple[int, ...]:
    """The big-endian u64 words of a hash bin holding ``width``-byte blocks."""
    if type(blob) is not bytes or not blob or len(blob) % width:
        raise CodecError(
            f"hashes must be a non-empty bin of {width}-byte blocks, got {_describe(blob)}",
            position,
        )
    return struct.unpack(f">{len(blob) // 8}Q", blob)


def _describe(value: object) -> str:
    if type(value) is bytes:
        return f"{len(value)} bytes"
    return "an array" if type(value) is tuple else repr(value)[:40]


def _token_bin(tokens: Any, n_blocks: int) -> bytes:
    """Token ids as one bin: a u32 count per block, then every block's ids as u32."""
    # the ids themselves are checked by struct: anything but an int in 0..2**32-1 fails to pack
    if type(tokens) is not tuple or len(tokens) != n_blocks or {*map(type, tokens)} != {tuple}:
        raise CodecError(f"token_ids must be None or {n_blocks} tuples of integers")
    counts = list(map(len, tokens))
    words = n_blocks + sum(counts)
    return struct.pack(f">BI{words}I", BIN32, 4 * words, *counts, *chain.from_iterable(tokens))


def _tokens(blob: object, n_blocks: int, position: int | None) -> Any:
    """Inverse of ``_token_bin``; None for nil."""
    if blob is None:
        return None
    if type(blob) is bytes and len(blob) % 4 == 0 and len(blob) >= 4 * n_blocks:
        words = struct.unpack(f">{len(blob) // 4}I", blob)
        counts = words[:n_blocks]
        if sum(counts) == len(words) - n_blocks:
            out, start = [], n_blocks
            for count in counts:
                out.append(words[start : start + count])
                start += count
            return tuple(out)
    raise CodecError(
        f"token_ids must be nil or a bin of {n_blocks} u32 counts and the u32 ids, got "
        f"{_describe(blob)}",
        position,
    )


def iter_decode(records: Iterable[bytes], first_position: int = 0) -> Iterator[LogRecord]:
    """Decode a sequence of records, numbering positions from ``first_position``."""
    for position, data in enumerate(records, first_position):
        yield decode(data, position)


# -- registry snapshots (checkpoints) ---------------------------------------------------------


Cover = tuple[int, int, float]
"""A checkpoint row's columns that its snapshot repeats under its checksum: position,
max_event_id, max_ts."""


def encode_state(state: RegistryState, cover: Cover | None = None) -> bytes:
    """A registry snapshot: every worker's last event id and its blocks per tier.

    Each tier is its four columns packed as bins (big-endian u64 words, parent flags as
    bytes), sorted by sequence hash, so that a checkpoint loads without a Python object per
    block. With ``cover`` (a checkpoint's position, max_event_id and max_ts), the snapshot is
    version 4 and holds them too, under its checksum: a checkpoint row whose columns were
    changed no longer matches its snapshot (``decode_checkpoint``).
    """
    tiers = []
    try:
        for (worker, tier), columns in state.iter_columns():
            tiers.append(
                (
                    worker,
                    int(tier),
                    columns.seq.astype(">u8").tobytes(),
                    columns.local.astype(">u8").tobytes(),
                    columns.parent.astype(">u8").tobytes(),
                    columns.has_parent.tobytes(),
                )
            )
    except (OverflowError, TypeError) as exc:
        raise CodecError(
            f"cannot snapshot a state holding a hash that is not a u64: {exc}"
        ) from None
    last = [v for item in sorted(state.last_event_id.items()) for v in item]
    # one field more, the checksum, as in an event record: the array grows by one
    if cover is None:
        packed: bytes = msgpack.packb((SNAPSHOT_VERSION, last, tiers), use_bin_type=True)
        data = b"\x94" + packed[1:] + bytes([CHECK_TAG])
    else:
        position, max_event_id, max_ts = cover
        fields = (COVERED_SNAPSHOT_VERSION, last, tiers, position, max_event_id, float(max_ts))
        packed = msgpack.packb(fields, use_bin_type=True)
        data = b"\x97" + packed[1:] + bytes([CHECK_TAG])
    return data + _CRC_LE(zlib.crc32(data))


def decode_state(data: bytes) -> RegistryState:
    """Inverse of ``encode_state``; ``CodecError`` when the snapshot is not one, or is
    damaged."""
    return decode_checkpoint(data)[0]


def decode_checkpoint(data: bytes) -> tuple[RegistryState, Cover | None]:
    """A snapshot and what it covers of its checkpoint row (None for version 3, which covers
    nothing); ``CodecError`` when it is not one, or is damaged."""
    try:
        version, *fields = msgpack.unpackb(data, use_list=False, raw=False)
        if version not in (SNAPSHOT_VERSION, COVERED_SNAPSHOT_VERSION):
            raise CodecError(f"snapshot version {version!r} is not supported")
        if zlib.crc32(data) != CHECK_RESIDUE:
            raise CodecError(f"snapshot {DAMAGED}")
        cover: Cover | None = None
        if version == SNAPSHOT_VERSION:
            last, tiers, _check = fields
        else:
            last, tiers, position, max_event_id, max_ts, _check = fields
            if type(position) is not int or type(max_event_id) is not int:
                raise CodecError("snapshot: position and max_event_id must be integers")
            cover = (position, max_event_id, float(max_ts))
        state = RegistryState()
        it = iter(last)
        state.last_event_id = dict(zip(it, it, strict=True))
        for worker, tier_code, *blobs in tiers:
            state.set_columns((worker, _TIERS[tier_code]), _columns(*blobs))
        return state, cover
    except CodecError:
        raise
    except Exception as exc:
        raise CodecError(f"not a registry snapshot ({type(exc).__name__}: {exc})") from None


def _columns(seq: bytes, local: bytes, parent: bytes, has_parent: bytes) -> BlockColumns:
    n = len(has_parent)
    if not len(seq) == len(local) == len(parent) == 8 * n:
        raise ValueError(f"columns of unequal length for {n} blocks")
    flags = np.frombuffer(has_parent, np.uint8)
    columns = BlockColumns(
        np.frombuffer(seq, ">u8").astype(np.uint64),
        np.frombuffer(local, ">u8").astype(np.uint64),
        np.frombuffer(parent, ">u8").astype(np.uint64),
        flags.astype(np.bool_),
    )
    if (flags > 1).any() or (columns.seq[1:] <= columns.seq[:-1]).any():
        raise ValueError("sequence hashes must be sorted and unique, parent flags 0 or 1")
    return columns
