"""The compiled encoders (events/_speedups.c) against the Python ones (codec.py): the same
record, byte for byte, and the same log row, for every event; and for whatever is not the
plain case, no answer of their own, so the Python encoder's record or error stands."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import given
from switches import python_with
from test_event_codec import G1, events

from kvledger.events import _speedups, codec
from kvledger.events.codec import CodecError
from kvledger.events.log import rows
from kvledger.events.types import (
    AnyEvent,
    BlockInfo,
    Offloaded,
    Onboarded,
    Removed,
    Stored,
    Tier,
    without_token_ids,
)

RECORDS: dict[type[AnyEvent], Callable[[Any], bytes | None]] = {
    Stored: _speedups.stored,
    Removed: _speedups.removed,
    Offloaded: _speedups.offloaded,
    Onboarded: _speedups.onboarded,
}
ROWS: dict[type[AnyEvent], Callable[[Any], tuple[Any, ...] | None]] = {
    Stored: _speedups.stored_row,
    Removed: _speedups.removed_row,
    Offloaded: _speedups.offloaded_row,
    Onboarded: _speedups.onboarded_row,
}


def python_row(event: AnyEvent) -> tuple[Any, ...]:
    """``rows.to_row`` as the Python encoders make it."""
    tier = int(event.tier)
    payload = codec.PYTHON_ENCODERS[type(event)](event)
    return (event.worker_id, event.event_id, codec.KIND_NAMES[type(event)], tier, event.ts, payload)


def test_this_install_built_them() -> None:
    """The build is optional (an install without a compiler goes on without it), so a broken
    build would pass unnoticed but for this: the suite's install has a compiler."""
    assert set(codec.COMPILED) == set(codec.COMPILED_ROWS) == set(RECORDS)
    assert codec.COMPILED_STORED_ROW_WITHOUT_TOKENS is _speedups.stored_row_without_tokens
    assert codec.ENCODERS[Stored] is not codec.PYTHON_ENCODERS[Stored]


@given(events() | events(wide=True))
def test_same_record_and_row_as_the_python_encoders(event: AnyEvent) -> None:
    kind = type(event)
    if kind not in RECORDS:  # a clear: Python only
        assert kind not in codec.COMPILED
        return
    record = codec.PYTHON_ENCODERS[kind](event)
    assert RECORDS[kind](event) == record
    assert codec.encode(event) == record
    assert ROWS[kind](event) == python_row(event)
    assert rows.to_row(event) == python_row(event)
    if kind is Stored:  # a log that keeps no prompts (the token_ids setting)
        bare = python_row(without_token_ids(event))
        assert _speedups.stored_row_without_tokens(event) == bare  # type: ignore[arg-type]
        assert rows.to_row_without_tokens(event) == bare


U64_EDGES = [0, 1, 2**30 - 1, 2**30, 2**60 - 1, 2**60, 2**63, 2**64 - 1]
"""Where an int's digits change (its 30-bit digits: one, two, three; the top one's four bits
that a u64 leaves), which the compiled reader takes apart by hand."""
NOT_U64 = [2**64, 2**64 + 1, 2**80, 2**90, 2**100, -1, -(2**30), -(2**64 - 1)]


@pytest.mark.parametrize("blocks", range(1, 41))
def test_every_record_length_is_checksummed_as_python_checksums_it(blocks: int) -> None:
    """Records of every length from 50 to about 1,000 bytes, each remainder modulo 16 among them
    (an offloaded record grows by 24 bytes a block, by 25 with root flags; a stored one by 4 a
    token): the CRC of a short record and of a long one, whose sixteen-byte blocks are folded
    where the CPU multiplies without carries, and of the tail after them."""
    infos = tuple(BlockInfo(i + 1, i + 2, None if i % 3 == 0 else i) for i in range(blocks))
    copied = Offloaded(**{**G1, "tier": Tier.G2}, src_tier=Tier.G1, blocks=infos)
    rooted = Offloaded(**{**G1, "tier": Tier.G2}, src_tier=Tier.G1, blocks=infos[1:] or infos)
    stored = Stored(**G1, parent_hash=None, blocks=((1, 2),), token_ids=(tuple(range(blocks * 5)),))
    for event in (copied, rooted, stored):
        record = codec.PYTHON_ENCODERS[type(event)](event)
        assert RECORDS[type(event)](event) == record
        assert codec.decode(record) == event


@pytest.mark.parametrize("value", U64_EDGES)
def test_hash_words_at_digit_edges_pack_as_python_packs_them(value: int) -> None:
    """Every place a u64 is read (a hash word of each kind, a parent, an event id) at each
    edge, built both by arithmetic and by parsing, as the trace's and the chain's ints are."""
    for word in (value, int(str(value))):
        for event in (
            Stored(**{**G1, "event_id": word}, parent_hash=word, blocks=((word, word),)),
            Removed(**G1, sequence_hashes=(word, 1)),
            Offloaded(
                **{**G1, "tier": Tier.G2}, src_tier=Tier.G1, blocks=(BlockInfo(word, word, word),)
            ),
        ):
            assert RECORDS[type(event)](event) == codec.PYTHON_ENCODERS[type(event)](event)


@pytest.mark.parametrize("value", NOT_U64)
def test_ints_outside_u64_are_left_to_python(value: int) -> None:
    for event in (
        Stored(**G1, parent_hash=None, blocks=((1, value),)),
        Stored(**{**G1, "event_id": value}, parent_hash=None, blocks=((1, 2),)),
        Removed(**G1, sequence_hashes=(1, value)),
        Offloaded(**{**G1, "tier": Tier.G2}, src_tier=Tier.G1, blocks=(BlockInfo(1, 2, value),)),
    ):
        assert RECORDS[type(event)](event) is None


BAD_HEADS: list[dict[str, Any]] = [
    {"event_id": -1},
    {"event_id": 2**64},
    {"event_id": True},
    {"worker_id": 2**63},
    {"worker_id": -(2**63) - 1},
    {"worker_id": True},
    {"dp_rank": 1.0},
    {"tier": 0},
    {"tier": 5},
    {"tier": 1.0},
    {"ts": "x"},
    {"ts": 3},  # an int ts packs (as a float): the Python encoder's case
]
ODD_STORED: list[Stored] = [
    Stored(**G1, parent_hash=None, blocks=()),
    Stored(**G1, parent_hash=-1, blocks=((1, 2),)),
    Stored(**G1, parent_hash=2**64, blocks=((1, 2),)),
    Stored(**G1, parent_hash=True, blocks=((1, 2),)),
    Stored(**G1, parent_hash=None, blocks=((1.5, 2),)),  # type: ignore[arg-type]
    Stored(**G1, parent_hash=None, blocks=((1, 2, 3),)),  # type: ignore[arg-type]
    Stored(**G1, parent_hash=None, blocks=((1,), (2, 3, 4))),  # type: ignore[arg-type]
    Stored(**G1, parent_hash=None, blocks=((2**64, 2),)),
    Stored(**G1, parent_hash=None, blocks=((True, 2),)),  # a bool packs: Python's case
    Stored(**G1, parent_hash=None, blocks=iter([(1, 2)])),  # type: ignore[arg-type]
    Stored(**G1, parent_hash=None, blocks=((1, 2),), token_ids=((2**32,),)),
    Stored(**G1, parent_hash=None, blocks=((1, 2),), token_ids=((-1,),)),
    Stored(**G1, parent_hash=None, blocks=((1, 2),), token_ids=([1],)),  # type: ignore[arg-type]
    Stored(**G1, parent_hash=None, blocks=((1, 2),), token_ids=()),
    Stored(**G1, parent_hash=None, blocks=((1, 2),), token_ids=[(1,)]),  # type: ignore[arg-type]
]
ODD_OTHERS: list[AnyEvent] = [
    Removed(**G1, sequence_hashes=()),
    Removed(**G1, sequence_hashes=(-1,)),
    Removed(**G1, sequence_hashes=(1, None)),  # type: ignore[arg-type]
    Removed(**G1, sequence_hashes={1}),  # type: ignore[arg-type]
    Offloaded(**{**G1, "tier": Tier.G2}, src_tier=Tier.G2, blocks=(BlockInfo(1, 2, None),)),
    Offloaded(**{**G1, "tier": Tier.G2}, src_tier=9, blocks=(BlockInfo(1, 2, None),)),  # type: ignore[arg-type]
    Offloaded(**{**G1, "tier": Tier.G2}, src_tier=Tier.G1, blocks=()),
    Offloaded(**{**G1, "tier": Tier.G2}, src_tier=Tier.G1, blocks=(BlockInfo(None, 2, 3),)),  # type: ignore[arg-type]
    Offloaded(**{**G1, "tier": Tier.G2}, src_tier=Tier.G1, blocks=(BlockInfo(1, 2, -3),)),
    Offloaded(**{**G1, "tier": Tier.G2}, src_tier=Tier.G1, blocks=((1, 2),)),  # type: ignore[arg-type]
    Onboarded(**G1, src_tier=Tier.G2, blocks=[[1, 2, 3]]),  # type: ignore[arg-type]
]


def odd_events() -> list[AnyEvent]:
    heads = [
        cls(**{**G1, **bad}, **body)  # type: ignore[arg-type]
        for bad in BAD_HEADS
        for cls, body in [
            (Stored, {"parent_hash": None, "blocks": ((1, 2),)}),
            (Removed, {"sequence_hashes": (1,)}),
            (Offloaded, {"src_tier": Tier.G2, "blocks": (BlockInfo(1, 2, None),)}),
        ]
    ]
    return [*heads, *ODD_STORED, *ODD_OTHERS]


@pytest.mark.parametrize("event", odd_events())
def test_what_is_not_the_plain_case_is_left_to_python(event: AnyEvent) -> None:
    """No record and no row of their own: the Python encoder's answer (a record, or the error
    it raises) is ``encode``'s and ``to_row``'s."""
    kind = type(event)
    assert RECORDS[kind](event) is None
    assert ROWS[kind](event) is None
    try:
        expected = codec.PYTHON_ENCODERS[kind](event)
    except Exception:
        with pytest.raises(CodecError):
            codec.encode(event)
        with pytest.raises(CodecError):
            rows.to_row(event)
    else:
        assert codec.encode(event) == expected
        assert rows.to_row(event)[5] == expected


@pytest.mark.parametrize("event", [e for e in odd_events() if type(e) is Stored])
def test_without_token_ids_the_python_path_decides_the_rest(event: Stored) -> None:
    """Leaving the token ids out, the compiled row ignores them (a stored event whose only
    fault is its token ids is written, as ``without_token_ids`` then ``to_row`` writes it);
    anything else is left to that Python path."""
    try:
        expected: tuple[Any, ...] | None = python_row(without_token_ids(event))
    except Exception:
        expected = None
    compiled = _speedups.stored_row_without_tokens(event)
    assert compiled is None or compiled == expected
    if expected is None:
        with pytest.raises(CodecError):
            rows.to_row_without_tokens(event)
    else:
        assert rows.to_row_without_tokens(event) == expected


def test_blocks_as_lists_pack_as_tuples() -> None:
    """What the Python encoder accepts of a list (of pairs, of hashes) the compiled one packs
    the same, so an engine handing lists gets the same record."""
    pairs = ((1, 2), (3, 2**64 - 1))
    as_tuples = Stored(**G1, parent_hash=5, blocks=pairs)
    as_lists = Stored(**G1, parent_hash=5, blocks=[list(p) for p in pairs])  # type: ignore[arg-type]
    assert _speedups.stored(as_lists) == _speedups.stored(as_tuples) == codec._stored(as_tuples)
    hashes = Removed(**G1, sequence_hashes=[1, 2**64 - 1])  # type: ignore[arg-type]
    assert _speedups.removed(hashes) == codec._removed(hashes)


def test_a_missing_field_raises_as_an_attribute_error() -> None:
    with pytest.raises(AttributeError):
        _speedups.stored(object())  # type: ignore[arg-type]


def test_a_field_the_class_does_not_keep_in_its_slot_is_read_as_python_reads_it() -> None:
    """A subclass whose field is a property, and a class changed after its events were
    encoded: the compiled encoder reads what attribute access gives, as the Python one does
    (the slot's offset is not used where the attribute is not that slot)."""

    class Shown(Removed):
        __slots__ = ()

        @property
        def sequence_hashes(self) -> tuple[int, ...]:
            return (7, 8)

    shown = Shown.__new__(Shown)
    for name, value in {**G1, "sequence_hashes": (1,)}.items():  # the slots, past the property
        slot = next(vars(c)[name] for c in Removed.__mro__ if name in vars(c))
        slot.__set__(shown, value)
    assert _speedups.removed(shown) == codec.PYTHON_ENCODERS[Removed](shown)
    assert codec.decode(_speedups.removed(shown) or b"").sequence_hashes == (7, 8)  # type: ignore[union-attr]

    class Later(Removed):
        __slots__ = ()

    later = Later(**G1, sequence_hashes=(1,))
    assert codec.decode(_speedups.removed(later) or b"").sequence_hashes == (1,)  # type: ignore[union-attr]
    name = "sequence_hashes"  # set and deleted on the class by name, past the type checker
    setattr(Later, name, property(lambda self: (9,)))
    assert codec.decode(_speedups.removed(later) or b"").sequence_hashes == (9,)  # type: ignore[union-attr]
    delattr(Later, name)  # the slot again
    assert codec.decode(_speedups.removed(later) or b"").sequence_hashes == (1,)  # type: ignore[union-attr]


def test_many_classes_and_an_empty_slot() -> None:
    """More classes than the compiled encoder keeps offsets for, each encoded twice, then the
    first again; and an event whose slot was never set raises the AttributeError that
    attribute access raises."""
    classes = [type(f"Removed{i}", (Removed,), {"__slots__": ()}) for i in range(20)]
    for cls in [*classes, *classes, classes[0]]:
        event = cls(**G1, sequence_hashes=(3, 4))
        assert _speedups.removed(event) == codec.PYTHON_ENCODERS[Removed](event)
    headless = Removed.__new__(Removed)
    with pytest.raises(AttributeError, match="worker_id"):
        _speedups.removed(headless)
    for name, value in G1.items():
        object.__setattr__(headless, name, value)
    with pytest.raises(AttributeError, match="sequence_hashes"):
        _speedups.removed(headless)


def test_the_environment_turns_them_off() -> None:
    """``KVLEDGER_PYTHON_ENCODERS=1``: the Python encoders alone, writing the same records."""
    event = Stored(
        event_id=3, worker_id=1, dp_rank=0, tier=Tier.G2, ts=1.5, parent_hash=7,
        blocks=((1, 2), (3, 4)), token_ids=((5,), (6, 7)),
    )  # fmt: skip
    script = (
        "import sys; from kvledger.events import codec; "
        "from kvledger.events.types import Stored, Tier; "
        "assert not codec.COMPILED and not codec.COMPILED_ROWS; "
        "assert codec.COMPILED_STORED_ROW_WITHOUT_TOKENS is None; "
        "e = Stored(event_id=3, worker_id=1, dp_rank=0, tier=Tier.G2, ts=1.5, parent_hash=7, "
        "blocks=((1, 2), (3, 4)), token_ids=((5,), (6, 7))); "
        "sys.stdout.write(codec.encode(e).hex())"
    )
    out = python_with("KVLEDGER_PYTHON_ENCODERS", "1", script)
    assert bytes.fromhex(out.stdout) == codec.encode(event)
