"""The event codec: round trips, refusals with positions, fuzzing, and the replay fast path
agreeing with decode + fold on every record, good or bad."""

from __future__ import annotations

import math
import struct
import zlib
from collections.abc import Sequence
from typing import Any

import msgpack
import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from kvledger.events.chunk_decode import decode_chunk
from kvledger.events.codec import (
    LOG_RECORD_VERSION,
    CodecError,
    decode,
    decode_state,
    encode,
    encode_state,
    iter_decode,
)
from kvledger.events.log.reader import RowChunk
from kvledger.events.log.replay import fold_chunk
from kvledger.events.types import (
    AnyEvent,
    BlockInfo,
    Cleared,
    Lookup,
    Offloaded,
    Onboarded,
    Released,
    Removed,
    RunInfo,
    Stored,
    Tier,
)
from kvledger.registry.state import RegistryState

U64 = st.integers(0, 2**64 - 1)
U63 = st.integers(0, 2**63 - 1)


def seal(fields: Sequence[object]) -> bytes:
    """A version 3 record of ``fields`` in msgpack's smallest encoding, with its checksum."""
    data: bytes = msgpack.packb([*fields, 0])[:-1] + b"\xce"  # the array counts the check field
    return data + zlib.crc32(data).to_bytes(4, "little")


def reseal(data: bytes) -> bytes:
    """``data`` (a version 3 record) with its checksum made to match its bytes again."""
    return data[:-4] + zlib.crc32(data[:-4]).to_bytes(4, "little")


def unchecked(data: bytes) -> bytes:
    """The version 2 record (no checksum) of one that ``encode`` wrote."""
    return bytes([data[0] - 1, 2]) + data[2:-5]


TIERS = st.sampled_from(list(Tier))


I64 = st.integers(-(2**63), 2**63 - 1)


def common(event_id: int = 0, *, wide: bool = False) -> st.SearchStrategy[dict[str, Any]]:
    """The fields every event has; ``wide``: each over the whole range its record field holds
    (NaN and infinite ts included), where the default stays in the values engines make."""
    return st.fixed_dictionaries(
        {
            "event_id": st.just(event_id) if event_id >= 0 else (U64 if wide else U63),
            "worker_id": I64 if wide else st.integers(-(2**31), 2**31),
            "dp_rank": I64 if wide else st.integers(0, 64),
            "tier": TIERS,
            "ts": st.floats() if wide else st.floats(allow_nan=False, allow_infinity=False),
        }
    )


@st.composite
def events(draw: st.DrawFn, event_id: int = -1, *, wide: bool = False) -> AnyEvent:
    """One event of each kind; ``wide``: ``common``'s whole ranges and up to 40 blocks."""
    base = draw(common(event_id, wide=wide))
    most = 40 if wide else 6
    kind = draw(st.sampled_from(["stored", "removed", "copied", "cleared"]))
    if kind == "stored":
        blocks = tuple(draw(st.lists(st.tuples(U64, U64), min_size=1, max_size=most)))
        tokens = draw(
            st.none()
            | st.lists(
                st.lists(st.integers(0, 2**32 - 1), max_size=4).map(tuple),
                min_size=len(blocks),
                max_size=len(blocks),
            ).map(tuple)
        )
        return Stored(**base, parent_hash=draw(st.none() | U64), blocks=blocks, token_ids=tokens)
    if kind == "removed":
        hashes = draw(st.lists(U64, min_size=1, max_size=most))
        return Removed(**base, sequence_hashes=tuple(hashes))
    if kind == "cleared":
        return Cleared(**base)
    src = draw(TIERS.filter(lambda t: t != base["tier"]))
    infos = draw(
        st.lists(st.builds(BlockInfo, U64, U64, st.none() | U64), min_size=1, max_size=most)
    )
    cls = Offloaded if src < base["tier"] else Onboarded
    return cls(**base, src_tier=src, blocks=tuple(infos))


@given(events())
def test_round_trip(event: AnyEvent) -> None:
    data = encode(event)
    assert decode(data) == event
    assert msgpack.unpackb(data)[0] == LOG_RECORD_VERSION


def writer_layout(fields: Sequence[Any]) -> bytes:
    """A record's values (its check field left out) in the widths the module docstring gives
    the writer, built field by field and sealed: what ``encode`` must write, byte for byte."""
    version, kind, worker, event_id, dp_rank, tier, ts, *body = fields
    out: bytes = bytes([0x90 + len(fields) + 1, version, kind])
    out += b"\xd3" + worker.to_bytes(8, "big", signed=True)
    out += b"\xcf" + event_id.to_bytes(8, "big")
    out += b"\xd3" + dp_rank.to_bytes(8, "big", signed=True)
    out += bytes([tier]) + b"\xcb" + struct.pack(">d", ts)
    for i, value in enumerate(body):
        if value is None:
            out += b"\xc0"
        elif type(value) is bytes:
            out += b"\xc6" + len(value).to_bytes(4, "big") + value
        elif i == 0 and kind in (3, 4):  # a copy's source tier
            out += bytes([value])
        else:  # a stored chain's parent
            out += b"\xcf" + value.to_bytes(8, "big")
    out += b"\xce"
    return out + zlib.crc32(out).to_bytes(4, "little")


@given(events())
def test_records_are_laid_out_as_documented(event: AnyEvent) -> None:
    """Byte for byte, whichever packer ``encode`` takes: a faster encoder must not move a byte
    (the chunk decoder and every existing log rely on the layout)."""
    data = encode(event)
    *fields, _check = msgpack.unpackb(data)
    assert data == writer_layout(fields)


def test_decode_stream_names_positions() -> None:
    good = encode(Cleared(event_id=0, worker_id=0, dp_rank=0, tier=Tier.G1, ts=1.0))
    with pytest.raises(CodecError, match="event at position 11: not a msgpack record"):
        list(iter_decode([good, b"\xc1"], first_position=10))


@pytest.mark.parametrize(("version", "writer"), [(1, "an older"), (4, "a newer")])
def test_unknown_version_is_refused_with_position(version: int, writer: str) -> None:
    record = list(
        msgpack.unpackb(encode(Cleared(event_id=0, worker_id=0, dp_rank=0, tier=Tier.G1, ts=0.0)))
    )
    record[0] = version
    with pytest.raises(
        CodecError, match=rf"position 7: record version {version} is not supported.*{writer}"
    ):
        decode(msgpack.packb(record), position=7)


def test_records_are_msgpack_with_fixed_width_fields() -> None:
    """Any msgpack reader sees the values; the widths are what the chunk decoder relies on."""
    event = Stored(
        event_id=3, worker_id=-2, dp_rank=1, tier=Tier.G2, ts=0.5, parent_hash=7, blocks=((1, 2),)
    )
    data = encode(event)
    *fields, check = msgpack.unpackb(data)
    assert fields == [
        3, 1, -2, 3, 1, 2, 0.5, 7, (1).to_bytes(8, "big") + (2).to_bytes(8, "big"), None
    ]  # fmt: skip
    assert len(data) == 40 + 9 + 5 + 16 + 1 + 5
    # the check field's four bytes are the CRC-32 of everything before them
    assert data[-5] == 0xCE
    assert check.to_bytes(4, "big") == zlib.crc32(data[:-4]).to_bytes(4, "little")
    # a record with the same values in msgpack's smallest encoding decodes to the same event
    assert decode(seal(fields)) == event
    # and so does the same record without its checksum, in version 2
    assert decode(msgpack.packb([2, *fields[1:]])) == event


ZERO_BLOCK = bytes(16)
ZERO_COPY = bytes(24)


@pytest.mark.parametrize(
    ("record", "message"),
    [
        ({"a": 1}, "expected an array"),
        ([2, 9, 0, 0, 0, 1, 0.0], "unknown event kind code 9"),
        ([2, 5, 0, 0, 0, 7, 0.0], "unknown tier 7"),
        ([2, 5, 0, -1, 0, 1, 0.0], "negative event_id"),
        ([2, 5, 0, True, 0, 1, 0.0], "must be integers"),
        ([2, 5, 0, 0, 0, 1, "now"], "timestamp must be a number"),
        ([2, 5, 0, 0, 0, 1, 0.0, 99], "kind 5 needs 7 fields, got 8"),
        ([2, 2, 0, 0, 0, 1, 0.0, b""], "non-empty bin of 8-byte blocks, got 0 bytes"),
        ([2, 2, 0, 0, 0, 1, 0.0, [1]], "non-empty bin of 8-byte blocks, got an array"),
        ([2, 1, 0, 0, 0, 1, 0.0, None, bytes(24), None], "16-byte blocks, got 24 bytes"),
        ([2, 1, 0, 0, 0, 1, 0.0, "p", ZERO_BLOCK, None], "parent hash"),
        ([2, 1, 0, 0, 0, 1, 0.0, -1, ZERO_BLOCK, None], "parent hash"),
        ([2, 1, 0, 0, 0, 1, 0.0, None, ZERO_BLOCK, [[1], [2]]], "token_ids must be nil or a bin"),
        ([2, 1, 0, 0, 0, 1, 0.0, None, ZERO_BLOCK, bytes(2)], "u32 counts and the u32 ids, got 2"),
        ([2, 1, 0, 0, 0, 1, 0.0, None, ZERO_BLOCK, bytes(4) + b"x"], "token_ids must be nil"),
        ([2, 3, 0, 0, 0, 2, 0.0, 2, ZERO_COPY, None], "bad source tier 2"),
        ([2, 3, 0, 0, 0, 2, 0.0, 1, bytes(20), None], "24-byte blocks"),
        ([2, 3, 0, 0, 0, 2, 0.0, 1, ZERO_COPY, b"\x00\x01"], "roots must be nil or one"),
        ([2, 3, 0, 0, 0, 2, 0.0, 1, ZERO_COPY, b"\x02"], "roots must be nil or one"),
    ],
)
def test_malformed_records_are_refused(record: object, message: str) -> None:
    with pytest.raises(CodecError, match=message):
        decode(msgpack.packb(record), position=3)


G1: dict[str, Any] = {"event_id": 0, "worker_id": 0, "dp_rank": 0, "tier": Tier.G1, "ts": 0.0}


@pytest.mark.parametrize(
    "event",
    [
        Stored(**G1, parent_hash=None, blocks=()),
        Stored(**G1, parent_hash=None, blocks=((1.5, 2),)),  # type: ignore[arg-type]
        Stored(**G1, parent_hash=None, blocks=((1, 2, 3),)),  # type: ignore[arg-type]
        Stored(**G1, parent_hash=None, blocks=((2**64, 2),)),
        Stored(**G1, parent_hash=-1, blocks=((1, 2),)),
        Stored(**G1, parent_hash=None, blocks=((1, 2),), token_ids=((2**32,),)),
        Stored(**G1, parent_hash=None, blocks=((1, 2),), token_ids=([1],)),  # type: ignore[arg-type]
        Removed(**{**G1, "event_id": -1}, sequence_hashes=(1,)),
        Removed(**G1, sequence_hashes=()),
        Removed(**{**G1, "worker_id": 2**63}, sequence_hashes=(1,)),
        Removed(**{**G1, "worker_id": True}, sequence_hashes=(1,)),
        Removed(**{**G1, "ts": "x"}, sequence_hashes=(1,)),
        Offloaded(**{**G1, "tier": Tier.G2}, src_tier=Tier.G2, blocks=(BlockInfo(1, 2, None),)),
        Offloaded(**{**G1, "tier": Tier.G2}, src_tier=Tier.G1, blocks=(BlockInfo(None, 2, 3),)),  # type: ignore[arg-type]
        Cleared(event_id=0, worker_id=0, dp_rank=0, tier=9, ts=0.0),  # type: ignore[arg-type]
    ],
)
def test_encode_refuses_what_decode_would(event: AnyEvent) -> None:
    with pytest.raises(CodecError):
        encode(event)


def test_encode_refuses_non_events() -> None:
    with pytest.raises(CodecError, match="not an event"):
        encode(object())  # type: ignore[arg-type]


@settings(max_examples=500)
@given(st.binary(max_size=64))
def test_random_bytes_decode_or_raise_codec_error(data: bytes) -> None:
    try:
        event = decode(data, position=1)
    except CodecError as exc:
        assert "position 1" in str(exc)
    else:
        assert decode(encode(event)) == event


LEAVES = (
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=3)
    | st.binary(max_size=3)
)
VALUES = st.recursive(
    LEAVES,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=2), inner, max_size=2)
    ),
    max_leaves=12,
)


@st.composite
def near_records(draw: st.DrawFn) -> bytes:
    """Records that look right at first: a current header and a random body."""
    head = [
        draw(st.sampled_from([LOG_RECORD_VERSION, 2])),
        draw(st.integers(0, 6)),
        draw(st.integers(0, 3) | VALUES),
        draw(st.integers(-1, 3) | VALUES),
        0,
        draw(st.integers(0, 5)),
        draw(st.floats(0, 10) | VALUES),
    ]
    hash_bins = st.integers(0, 4).flatmap(lambda n: st.binary(min_size=8 * n, max_size=8 * n))
    body = draw(st.lists(VALUES | hash_bins | st.binary(max_size=3), max_size=5))
    return seal(head + body) if head[0] == LOG_RECORD_VERSION else msgpack.packb(head + body)


@settings(max_examples=500)
@given(near_records())
def test_structured_garbage_decodes_or_raises_codec_error(data: bytes) -> None:
    try:
        event = decode(data)
    except CodecError:
        return
    again = decode(encode(event))
    # a NaN ts equals nothing, itself included: then the same record again is the same event
    assert again == event or (math.isnan(event.ts) and encode(again) == encode(event))


def fold_reference(
    rows: list[tuple[int, float, bytes]], until_event_id: int | None = None
) -> tuple[RegistryState, BaseException | None, int | None]:
    """Replay's rules one row at a time: decode (which verifies), the ts column must agree,
    events after the bound are skipped; the error and the position it names."""
    state = RegistryState()
    for position, ts, payload in rows:
        try:
            event = decode(payload, position)
            if event.ts != ts:
                raise CodecError("ts column", position)
            if isinstance(event, Lookup | Released | RunInfo):
                continue  # lookup records fold nothing
            if until_event_id is None or event.event_id <= until_event_id:
                state.apply(event)
        except ValueError as exc:
            return state, exc, position
    return state, None, None


@st.composite
def log_rows(draw: st.DrawFn) -> list[tuple[int, float, bytes]]:
    """Two workers' events (some with reused hashes), with now and then a corrupt,
    repeated or out-of-order record slipped in."""
    rows = []
    next_id = {0: 0, 1: 0}
    pool = draw(st.lists(U64, min_size=1, max_size=6))
    hashes = st.sampled_from(pool)
    for position in range(1, draw(st.integers(0, 25)) + 1):
        worker = draw(st.sampled_from([0, 1]))
        event = draw(events(event_id=next_id[worker]))
        event = type(event)(**_fields(event, worker))
        if isinstance(event, Stored) and draw(st.booleans()):
            event = Stored(
                **_base(event),
                parent_hash=draw(st.none() | hashes),
                blocks=tuple((draw(hashes), 1) for _ in event.blocks),
            )
        next_id[worker] += 1
        version = draw(st.sampled_from([LOG_RECORD_VERSION] * 3 + [2]))
        payload = encode(event) if version == LOG_RECORD_VERSION else unchecked(encode(event))
        ts = event.ts
        corruption = draw(
            st.sampled_from(
                ["none"] * 12 + ["garbage", "near", "repeat", "gap", "flip", "bit", "cut", "ts"]
            )
        )
        if corruption == "flip":
            # one byte of a well-formed record changed: the chunk decoder's checks must catch
            # exactly what decode catches, and read the same event where decode reads one
            at = draw(st.integers(0, len(payload) - 1))
            payload = payload[:at] + bytes([draw(st.integers(0, 255))]) + payload[at + 1 :]
        elif corruption == "bit":
            at = draw(st.integers(0, 8 * len(payload) - 1))
            payload = bytes(b ^ (1 << at % 8 if i == at // 8 else 0) for i, b in enumerate(payload))
        elif corruption == "ts":
            ts = draw(st.floats(allow_nan=False))
        elif corruption == "cut":
            payload = payload[: draw(st.integers(0, len(payload) - 1))]
        elif corruption == "gap":
            payload = encode(type(event)(**{**_fields(event, worker), "event_id": next_id[worker]}))
        elif corruption == "garbage":
            payload = draw(st.binary(max_size=12))
        elif corruption == "near":
            payload = draw(near_records())
        elif corruption == "repeat":
            payload = encode(type(event)(**{**_fields(event, worker), "event_id": 0}))
        rows.append((position, ts, payload))
    return rows


def _base(event: AnyEvent) -> dict[str, Any]:
    return {f: getattr(event, f) for f in ("event_id", "worker_id", "dp_rank", "tier", "ts")}


def _fields(event: AnyEvent, worker: int) -> dict[str, Any]:
    names = [f for cls in type(event).__mro__ for f in getattr(cls, "__slots__", ())]
    out = {f: getattr(event, f) for f in names if not f.startswith("_")}
    out["worker_id"] = worker
    return out


# a lookup record one field short whose checksum no longer matches: both paths must name the
# same fault (the fast path once said "damaged", decode the missing fields)
SHORT_LOOKUP = (
    b"\x9c\x03\x06\x00\x00\x00\x00\xcb\x00\x00\x00\x00\x00\x00\x00\x00\xc4\x00\xc4\x03"
    b"\x00\x00\x00\xc0\x81\xa0\xcb\x00\x00\x00\x00\x00\x00\x00\x00\xceT!Z\xd3"
)


@settings(max_examples=400)
@given(log_rows(), st.integers(1, 7), st.none() | st.integers(-1, 12), st.booleans())
@example(rows=[(1, 0.0, SHORT_LOOKUP)], chunk=1, until_event_id=None, shared=False)
def test_chunk_fold_agrees_with_decode_and_apply(
    rows: list[tuple[int, float, bytes]], chunk: int, until_event_id: int | None, shared: bool
) -> None:
    """Folded in chunks of tuples, or of slices of one ``RowChunk`` whose buffer holds the
    other chunks' records around theirs (how replay folds what its reader read)."""
    expected, error, position = fold_reference(rows, until_event_id)
    state = RegistryState()
    whole = RowChunk.from_rows(rows)
    try:
        for start in range(0, len(rows), chunk):
            piece = whole[start : start + chunk] if shared else rows[start : start + chunk]
            fold_chunk(state, piece, until_event_id)
    except ValueError as exc:
        assert error is not None, f"fast fold raised {exc!r}, reference did not"
        assert isinstance(exc, type(error))
        assert exc.position == position  # type: ignore[attr-defined]
        if "ts column" not in str(error):
            assert str(error) in str(exc) or str(exc).endswith(str(error).split(": ", 1)[-1])
        return
    assert error is None, f"reference raised {error!r}, fast fold did not"
    assert state == expected
    assert state.last_event_id == expected.last_event_id


@given(st.lists(events(), max_size=10))
def test_state_snapshot_round_trip(evs: list[AnyEvent]) -> None:
    state = RegistryState.from_events(evs, strict=False)
    back = decode_state(encode_state(state))
    assert back == state
    assert back.last_event_id == state.last_event_id
    assert back.digest() == state.digest()


def test_bad_snapshot_is_refused() -> None:
    with pytest.raises(CodecError, match="not a registry snapshot"):
        decode_state(b"\x93\x01")
    with pytest.raises(CodecError, match="snapshot version 9"):
        decode_state(msgpack.packb([9, [], []]))


@given(st.lists(events(), min_size=1, max_size=12))
def test_chunk_decoder_reads_what_the_writer_writes(evs: list[AnyEvent]) -> None:
    """Records straight from ``encode`` never need the per-row path."""
    evs = [type(e)(**{**_fields(e, 5), "event_id": i}) for i, e in enumerate(evs)]
    decoded = decode_chunk([encode(e) for e in evs], {}, np.array([e.ts for e in evs]))
    assert decoded is not None
    # and of a log written before checksums
    assert decode_chunk([unchecked(encode(e)) for e in evs], {}) is not None
    assert decoded.last_event_id == {5: len(evs) - 1}
    state = RegistryState()
    for key, ops in decoded.ops.items():
        state.fold_ops(key, ops)
    expected = RegistryState.from_events(evs)
    assert state == expected
    assert state.digest() == expected.digest()
    # an event-id bound: the later records are verified, not folded, and need no slow path
    until = len(evs) // 2
    bounded = decode_chunk([encode(e) for e in evs], {}, until_event_id=until)
    assert bounded is not None
    state = RegistryState()
    for key, ops in bounded.ops.items():
        state.fold_ops(key, ops)
    assert state == RegistryState.from_events(evs[: until + 1])


def test_chunk_decoder_declines_what_it_cannot_vouch_for() -> None:
    def stored(event_id: int, **extra: object) -> Stored:
        fields: dict[str, object] = {"parent_hash": None, "blocks": ((1, 2),), **extra}
        return Stored(event_id=event_id, worker_id=0, dp_rank=0, tier=Tier.G1, ts=0.0, **fields)  # type: ignore[arg-type]

    good = [encode(stored(0)), encode(stored(1))]
    assert decode_chunk(good, {}) is not None
    assert decode_chunk(good, {0: 0}) is None  # a repeat
    assert decode_chunk(good, {0: -2}) is None  # after a gap
    assert decode_chunk([good[0], encode(stored(2))], {}) is None  # a gap inside
    with_tokens = encode(stored(1, token_ids=((3, 4),)))
    assert decode(with_tokens).token_ids == ((3, 4),)  # type: ignore[union-attr]
    assert decode_chunk([good[0], with_tokens], {}) is not None
    # a token bin whose counts do not add up: decode refuses it, the chunk decoder declines
    # (in a record without a checksum, and in one whose checksum was made to match)
    v2 = unchecked(with_tokens)
    bad_v2 = v2[:-12] + (5).to_bytes(4, "big") + v2[-8:]
    bad_v3 = reseal(with_tokens[:-17] + (5).to_bytes(4, "big") + with_tokens[-13:])
    for bad_count in (bad_v2, bad_v3):
        with pytest.raises(CodecError, match="token_ids must be nil or a bin of 1 u32 counts"):
            decode(bad_count)
        assert decode_chunk([good[0], bad_count], {}) is None
    # the same record without the checksum goes the fast way too
    assert decode_chunk([unchecked(good[0]), v2], {}) is not None
    # a damaged record: decode refuses it, the chunk decoder declines
    damaged = with_tokens[:-17] + (5).to_bytes(4, "big") + with_tokens[-13:]
    with pytest.raises(CodecError, match="damaged: its checksum does not match"):
        decode(damaged)
    assert decode_chunk([good[0], damaged], {}) is None
    # a kind that is none, whatever the array header byte says
    clear = encode(Cleared(event_id=1, worker_id=0, dp_rank=0, tier=Tier.G1, ts=0.0))
    for first, version in ((0xFF, 2), (0x00, 2), (0x00, 3)):
        body = b"\x01\xc6" + (8).to_bytes(4, "big") + bytes(8) + b"\xc0"  # a copy's shape
        odd = bytes([first, version, 7]) + clear[3:40] + body
        assert decode_chunk([good[0], odd], {}) is None
    smallest = seal(msgpack.unpackb(good[1])[:-1])  # valid, but not the writer's widths
    assert decode(smallest) == stored(1)
    assert decode_chunk([good[0], smallest], {}) is None
