"""The event codec: round trips, refusals with positions, fuzzing, and the replay fast path
agreeing with decode + fold on every record, good or bad."""

from __future__ import annotations

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvledger.events.codec import (
    RECORD_VERSION,
    CodecError,
    decode,
    decode_state,
    encode,
    encode_state,
    iter_decode,
)
from kvledger.events.replay import fold_chunk
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

U64 = st.integers(0, 2**64 - 1)
TIERS = st.sampled_from(list(Tier))


def common(event_id: int = 0) -> st.SearchStrategy[dict[str, object]]:
    return st.fixed_dictionaries(
        {
            "event_id": st.just(event_id) if event_id >= 0 else st.integers(0, 2**63 - 1),
            "worker_id": st.integers(-(2**31), 2**31),
            "dp_rank": st.integers(0, 64),
            "tier": TIERS,
            "ts": st.floats(allow_nan=False, allow_infinity=False),
        }
    )


@st.composite
def events(draw: st.DrawFn, event_id: int = -1) -> AnyEvent:
    base = draw(common(event_id))
    kind = draw(st.sampled_from(["stored", "removed", "copied", "cleared"]))
    if kind == "stored":
        blocks = tuple(draw(st.lists(st.tuples(U64, U64), min_size=1, max_size=6)))
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
        return Removed(**base, sequence_hashes=tuple(draw(st.lists(U64, min_size=1, max_size=6))))
    if kind == "cleared":
        return Cleared(**base)
    src = draw(TIERS.filter(lambda t: t != base["tier"]))
    infos = draw(st.lists(st.builds(BlockInfo, U64, U64, st.none() | U64), min_size=1, max_size=6))
    cls = Offloaded if src < base["tier"] else Onboarded  # type: ignore[operator]
    return cls(**base, src_tier=src, blocks=tuple(infos))


@given(events())
def test_round_trip(event: AnyEvent) -> None:
    data = encode(event)
    assert decode(data) == event
    assert msgpack.unpackb(data)[0] == RECORD_VERSION


def test_decode_stream_names_positions() -> None:
    good = encode(Cleared(event_id=0, worker_id=0, dp_rank=0, tier=Tier.G1, ts=1.0))
    with pytest.raises(CodecError, match="event at position 11: not a msgpack record"):
        list(iter_decode([good, b"\xc1"], first_position=10))


def test_unknown_version_is_refused_with_position() -> None:
    record = list(
        msgpack.unpackb(encode(Cleared(event_id=0, worker_id=0, dp_rank=0, tier=Tier.G1, ts=0.0)))
    )
    record[0] = 2
    with pytest.raises(CodecError, match=r"position 7: record version 2 is not supported"):
        decode(msgpack.packb(record), position=7)


@pytest.mark.parametrize(
    ("record", "message"),
    [
        ({"a": 1}, "expected an array"),
        ([1, 9, 0, 0, 0, 1, 0.0], "unknown event kind code 9"),
        ([1, 5, 0, 0, 0, 7, 0.0], "unknown tier 7"),
        ([1, 5, 0, -1, 0, 1, 0.0], "negative event_id"),
        ([1, 5, 0, True, 0, 1, 0.0], "must be integers"),
        ([1, 5, 0, 0, 0, 1, "now"], "timestamp must be a number"),
        ([1, 5, 0, 0, 0, 1, 0.0, 99], "kind 5 needs 7 fields, got 8"),
        ([1, 2, 0, 0, 0, 1, 0.0, []], "non-empty array of integers"),
        ([1, 2, 0, 0, 0, 1, 0.0, [1.5]], "non-empty array of integers"),
        ([1, 1, 0, 0, 0, 1, 0.0, None, [1, 2], [3], None], "differ in length"),
        ([1, 1, 0, 0, 0, 1, 0.0, "p", [1], [3], None], "parent hash"),
        ([1, 1, 0, 0, 0, 1, 0.0, None, [1], [3], [[1], [2]]], "token_ids"),
        ([1, 3, 0, 0, 0, 2, 0.0, 2, [1], [2], [None]], "bad source tier 2"),
        ([1, 3, 0, 0, 0, 2, 0.0, 1, [1], [2], []], "three equal non-empty arrays"),
    ],
)
def test_malformed_records_are_refused(record: object, message: str) -> None:
    with pytest.raises(CodecError, match=message):
        decode(msgpack.packb(record), position=3)


@pytest.mark.parametrize(
    "event",
    [
        Stored(
            event_id=0, worker_id=0, dp_rank=0, tier=Tier.G1, ts=0.0, parent_hash=None, blocks=()
        ),
        Stored(
            event_id=0,
            worker_id=0,
            dp_rank=0,
            tier=Tier.G1,
            ts=0.0,
            parent_hash=None,
            blocks=((1.5, 2),),
        ),  # type: ignore[arg-type]
        Stored(
            event_id=0,
            worker_id=0,
            dp_rank=0,
            tier=Tier.G1,
            ts=0.0,
            parent_hash=None,
            blocks=((1, 2, 3),),
        ),  # type: ignore[arg-type]
        Stored(
            event_id=0,
            worker_id=0,
            dp_rank=0,
            tier=Tier.G1,
            ts=0.0,
            parent_hash=None,
            blocks=((2**64, 2),),
        ),
        Removed(event_id=-1, worker_id=0, dp_rank=0, tier=Tier.G1, ts=0.0, sequence_hashes=(1,)),
        Removed(event_id=0, worker_id=True, dp_rank=0, tier=Tier.G1, ts=0.0, sequence_hashes=(1,)),
        Removed(event_id=0, worker_id=0, dp_rank=0, tier=Tier.G1, ts="x", sequence_hashes=(1,)),  # type: ignore[arg-type]
        Offloaded(
            event_id=0,
            worker_id=0,
            dp_rank=0,
            tier=Tier.G2,
            ts=0.0,
            src_tier=Tier.G2,
            blocks=(BlockInfo(1, 2, None),),
        ),
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
    """Records that look right at first: a version-1 header and a random body."""
    head = [
        1,
        draw(st.integers(0, 6)),
        draw(st.integers(0, 3) | VALUES),
        draw(st.integers(-1, 3) | VALUES),
        0,
        draw(st.integers(0, 5)),
        draw(st.floats(0, 10) | VALUES),
    ]
    body = draw(st.lists(VALUES | st.lists(st.integers(0, 2**64 - 1), max_size=3), max_size=5))
    return msgpack.packb(head + body)


@settings(max_examples=500)
@given(near_records())
def test_structured_garbage_decodes_or_raises_codec_error(data: bytes) -> None:
    try:
        event = decode(data)
    except CodecError:
        return
    assert decode(encode(event)) == event


def fold_reference(
    rows: list[tuple[int, float, bytes]],
) -> tuple[RegistryState, BaseException | None]:
    state = RegistryState()
    try:
        for position, _ts, payload in rows:
            state.apply(decode(payload, position))
    except ValueError as exc:
        return state, exc
    return state, None


@st.composite
def log_rows(draw: st.DrawFn) -> list[tuple[int, float, bytes]]:
    """A worker's events (some with reused hashes), with now and then a corrupt or
    out-of-order record slipped in."""
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
        payload = encode(event)
        corruption = draw(st.sampled_from(["none"] * 12 + ["garbage", "near", "repeat"]))
        if corruption == "garbage":
            payload = draw(st.binary(max_size=12))
        elif corruption == "near":
            payload = draw(near_records())
        elif corruption == "repeat":
            payload = encode(type(event)(**{**_fields(event, worker), "event_id": 0}))
        rows.append((position, float(position), payload))
    return rows


def _base(event: AnyEvent) -> dict[str, object]:
    return {f: getattr(event, f) for f in ("event_id", "worker_id", "dp_rank", "tier", "ts")}


def _fields(event: AnyEvent, worker: int) -> dict[str, object]:
    names = [f for cls in type(event).__mro__ for f in getattr(cls, "__slots__", ())]
    out = {f: getattr(event, f) for f in names if not f.startswith("_")}
    out["worker_id"] = worker
    return out


@settings(max_examples=300)
@given(log_rows(), st.integers(1, 7))
def test_fast_fold_agrees_with_decode_and_apply(
    rows: list[tuple[int, float, bytes]], chunk: int
) -> None:
    expected, error = fold_reference(rows)
    state = RegistryState()
    try:
        for start in range(0, len(rows), chunk):
            fold_chunk(state, rows[start : start + chunk])
    except ValueError as exc:
        assert error is not None, f"fast fold raised {exc!r}, reference did not"
        assert type(exc) is type(error)
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
