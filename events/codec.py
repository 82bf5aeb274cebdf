"""msgpack encoding of events and registry snapshots.

One event is one self-contained record (a msgpack array) that starts with the schema version,
so a log row can be decoded without its columns and a record from a future layout is refused
instead of misread. Hashes travel as parallel integer arrays (all sequence hashes, then all
local hashes): packing and unpacking them is the hot part of appending and replaying, and
parallel arrays let replay fold a whole event with C-level ``zip``/``dict.update``.

Record layout, version 1::

    [1, kind, worker_id, event_id, dp_rank, tier, ts, *body]
    stored (1):              parent_hash|nil, [seq...], [local...], token_ids|nil
    removed (2):             [seq...]
    offloaded/onboarded (3/4): src_tier, [seq...], [local...], [parent|nil...]
    cleared (5):             (no body)
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator
from typing import Any

import msgpack

from kvledger.events.types import (
    AnyEvent,
    BlockInfo,
    Cleared,
    Offloaded,
    Onboarded,
    Removed,
    Stored,
    Tier,
)
from kvledger.registry.state import RegistryState

RECORD_VERSION = 1
SNAPSHOT_VERSION = 1

KIND_CODES: dict[type[AnyEvent], int] = {
    Stored: 1,
    Removed: 2,
    Offloaded: 3,
    Onboarded: 4,
    Cleared: 5,
}
KIND_NAMES: dict[type[AnyEvent], str] = {
    Stored: "stored",
    Removed: "removed",
    Offloaded: "offloaded",
    Onboarded: "onboarded",
    Cleared: "cleared",
}
_TIERS: dict[int, Tier] = {int(t): t for t in Tier}
_INT_ONLY = frozenset({int})
_INT_OR_NONE = frozenset({int, type(None)})
_HEADER_LEN = 7
_BODY_LEN = {1: 4, 2: 1, 3: 4, 4: 4, 5: 0}


_packers = threading.local()


def _pack(obj: object) -> bytes:
    """Pack with this thread's reusable Packer (half the cost of ``msgpack.packb``)."""
    try:
        packer = _packers.packer
    except AttributeError:
        packer = _packers.packer = msgpack.Packer(use_bin_type=True)
    return packer.pack(obj)  # type: ignore[no-any-return]


class CodecError(ValueError):
    """A record that cannot be decoded (or an event that cannot be encoded).

    ``position`` is where the record sits (a log row id, or an index in a stream) so that the
    message points at the bad record rather than only describing it.
    """

    def __init__(self, message: str, position: int | None = None) -> None:
        self.position = position
        where = "event" if position is None else f"event at position {position}"
        super().__init__(f"{where}: {message}")


def encode(event: AnyEvent) -> bytes:
    """One event as a version-1 record.

    Refuses (``CodecError``) whatever ``decode`` would refuse, so that no record is ever
    written that replay cannot read back.
    """
    try:
        return _pack(_to_record(event))
    except (OverflowError, TypeError) as exc:
        raise CodecError(f"cannot encode {event!r}: {exc}") from None


def _to_record(event: AnyEvent) -> tuple[Any, ...]:
    cls = type(event)
    if cls not in KIND_CODES:
        raise CodecError(f"not an event: {event!r}")
    worker_id, event_id, dp_rank, tier, ts = (
        event.worker_id,
        event.event_id,
        event.dp_rank,
        event.tier,
        event.ts,
    )
    if (
        type(worker_id) is not int
        or type(event_id) is not int
        or type(dp_rank) is not int
        or event_id < 0
        or tier not in _TIERS
        or (type(ts) is not float and type(ts) is not int)
    ):
        raise CodecError(
            f"worker_id, dp_rank and event_id >= 0 must be integers, tier a Tier and ts a "
            f"number in {event!r}"
        )
    if cls is Stored:
        assert isinstance(event, Stored)
        blocks = event.blocks
        parent = event.parent_hash
        try:
            seqs, locals_ = zip(*blocks, strict=True)
        except ValueError:
            raise CodecError(
                f"stored blocks must be a non-empty chain of pairs: {event!r}"
            ) from None
        if (
            not _INT_ONLY.issuperset(map(type, seqs))
            or not _INT_ONLY.issuperset(map(type, locals_))
            or (parent is not None and type(parent) is not int)
        ):
            raise CodecError(f"stored blocks must be (int, int) pairs, parent an int: {event!r}")
        tokens = event.token_ids
        if tokens is not None:
            _check_tokens(tokens, len(blocks), None)
        return (
            RECORD_VERSION,
            1,
            worker_id,
            event_id,
            dp_rank,
            tier,
            ts,
            parent,
            seqs,
            locals_,
            tokens,
        )
    if cls is Removed:
        assert isinstance(event, Removed)
        hashes = event.sequence_hashes
        if not hashes or not _INT_ONLY.issuperset(map(type, hashes)):
            raise CodecError(f"removed hashes must be a non-empty sequence of ints: {event!r}")
        return (RECORD_VERSION, 2, worker_id, event_id, dp_rank, tier, ts, hashes)
    if cls is Offloaded or cls is Onboarded:
        assert isinstance(event, Offloaded | Onboarded)
        try:
            columns = tuple(zip(*event.blocks, strict=True))
            _check_copied(columns, None)
        except ValueError:
            raise CodecError(
                f"copied blocks must be non-empty BlockInfo triples: {event!r}"
            ) from None
        if event.src_tier not in _TIERS or event.src_tier == tier:
            raise CodecError(f"a copy needs two different tiers: {event!r}")
        kind = 3 if cls is Offloaded else 4
        return (
            RECORD_VERSION,
            kind,
            worker_id,
            event_id,
            dp_rank,
            tier,
            ts,
            event.src_tier,
            *columns,
        )
    if cls is Cleared:
        return (RECORD_VERSION, 5, worker_id, event_id, dp_rank, tier, ts)
    raise CodecError(f"not an event: {event!r}")


def decode(data: bytes, position: int | None = None) -> AnyEvent:
    """The event in ``data``; ``CodecError`` (naming ``position``) for anything else."""
    try:
        record = msgpack.unpackb(data, use_list=False, raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises several unrelated types for bad input
        raise CodecError(f"not a msgpack record ({type(exc).__name__}: {exc})", position) from None
    return from_record(record, position)


def from_record(record: object, position: int | None = None) -> AnyEvent:
    """Validate an unpacked record and build its event."""
    if type(record) is not tuple or len(record) < _HEADER_LEN:
        raise CodecError(f"expected an array of at least {_HEADER_LEN} fields", position)
    version, kind, worker_id, event_id, dp_rank, tier_code, ts = record[:_HEADER_LEN]
    if type(version) is not int or version != RECORD_VERSION:
        raise CodecError(
            f"record version {version!r} is not supported (this code reads version "
            f"{RECORD_VERSION}); was the log written by a newer kvledger?",
            position,
        )
    if type(kind) is not int or kind not in _BODY_LEN:
        raise CodecError(f"unknown event kind code {kind!r}", position)
    if len(record) != _HEADER_LEN + _BODY_LEN[kind]:
        raise CodecError(
            f"kind {kind} needs {_HEADER_LEN + _BODY_LEN[kind]} fields, got {len(record)}",
            position,
        )
    if not _INT_ONLY.issuperset(map(type, (worker_id, event_id, dp_rank))):
        raise CodecError("worker_id, event_id and dp_rank must be integers", position)
    if event_id < 0:
        raise CodecError(f"negative event_id {event_id}", position)
    tier = _TIERS.get(tier_code) if type(tier_code) is int else None
    if tier is None:
        raise CodecError(f"unknown tier {tier_code!r}", position)
    if type(ts) is not float and type(ts) is not int:
        raise CodecError(f"timestamp must be a number, got {ts!r}", position)
    common = {
        "event_id": event_id,
        "worker_id": worker_id,
        "dp_rank": dp_rank,
        "tier": tier,
        "ts": float(ts),
    }
    if kind == 1:
        parent, seqs, locals_, tokens = record[7:]
        _check_hashes(seqs, position)
        _check_hashes(locals_, position)
        if len(seqs) != len(locals_):
            raise CodecError("stored sequence and local hash arrays differ in length", position)
        if parent is not None and type(parent) is not int:
            raise CodecError(f"parent hash must be an integer or nil, got {parent!r}", position)
        return Stored(
            **common,
            parent_hash=parent,
            blocks=tuple(zip(seqs, locals_, strict=False)),
            token_ids=_check_tokens(tokens, len(seqs), position),
        )
    if kind == 2:
        (hashes,) = record[7:]
        _check_hashes(hashes, position)
        return Removed(**common, sequence_hashes=hashes)
    if kind == 5:
        return Cleared(**common)
    src_code, columns = record[7], record[8:]
    src = _TIERS.get(src_code) if type(src_code) is int else None
    if src is None or src == tier:
        raise CodecError(f"bad source tier {src_code!r} for a copy to {tier.name}", position)
    _check_copied(columns, position)
    infos = tuple(map(BlockInfo, *columns))
    cls = Offloaded if kind == 3 else Onboarded
    return cls(**common, src_tier=src, blocks=infos)


def _check_hashes(hashes: object, position: int | None) -> None:
    if type(hashes) is not tuple or not hashes or not _INT_ONLY.issuperset(map(type, hashes)):
        raise CodecError("hashes must be a non-empty array of integers", position)


def _check_copied(columns: Any, position: int | None) -> None:
    """(seqs, locals, parents): equal non-empty lengths; parents may hold nil."""
    if type(columns) is not tuple or len(columns) != 3:
        raise CodecError("copied blocks must be three arrays (seq, local, parent|nil)", position)
    seqs, locals_, parents = columns
    if (
        type(seqs) is not tuple
        or type(locals_) is not tuple
        or type(parents) is not tuple
        or not seqs
        or not len(seqs) == len(locals_) == len(parents)
        or not _INT_ONLY.issuperset(map(type, seqs))
        or not _INT_ONLY.issuperset(map(type, locals_))
        or not _INT_OR_NONE.issuperset(map(type, parents))
    ):
        raise CodecError(
            "copied blocks must be three equal non-empty arrays (seq, local, parent|nil)", position
        )


def _check_tokens(tokens: Any, n_blocks: int, position: int | None) -> Any:
    if tokens is None:
        return None
    if (
        type(tokens) is not tuple
        or len(tokens) != n_blocks
        or not all(type(t) is tuple and _INT_ONLY.issuperset(map(type, t)) for t in tokens)
    ):
        raise CodecError(f"token_ids must be nil or {n_blocks} arrays of integers", position)
    return tokens


def iter_decode(records: Iterable[bytes], first_position: int = 0) -> Iterator[AnyEvent]:
    """Decode a sequence of records, numbering positions from ``first_position``."""
    for position, data in enumerate(records, first_position):
        yield decode(data, position)


# -- registry snapshots (checkpoints) ---------------------------------------------------------


def encode_state(state: RegistryState) -> bytes:
    """A registry snapshot: every worker's last event id and its blocks per tier."""
    tiers = []
    for (worker, tier), blocks in sorted(state.tiers.items()):
        if not blocks:
            continue
        flat = [v for seq, (local, parent) in blocks.items() for v in (seq, local, parent)]
        tiers.append((worker, int(tier), flat))
    last = [v for item in sorted(state.last_event_id.items()) for v in item]
    return msgpack.packb(  # type: ignore[no-any-return]
        (SNAPSHOT_VERSION, last, tiers), use_bin_type=True
    )


def decode_state(data: bytes) -> RegistryState:
    """Inverse of ``encode_state``; ``CodecError`` when the snapshot is not one."""
    try:
        version, last, tiers = msgpack.unpackb(data, use_list=False, raw=False)
        if version != SNAPSHOT_VERSION:
            raise CodecError(f"snapshot version {version!r} is not supported")
        state = RegistryState()
        it = iter(last)
        state.last_event_id = dict(zip(it, it, strict=True))
        for worker, tier_code, flat in tiers:
            blocks = state.tiers[(worker, _TIERS[tier_code])] = {}
            for i in range(0, len(flat), 3):
                blocks[flat[i]] = (flat[i + 1], flat[i + 2])
        return state
    except CodecError:
        raise
    except Exception as exc:
        raise CodecError(f"not a registry snapshot ({type(exc).__name__}: {exc})") from None
