"""The compiled record makers (registry/_records.c) build what the dataclasses' own constructors
build: the same class, the same fields, still frozen, compared, hashed and shown alike."""

from __future__ import annotations

import dataclasses
import gc
import sys
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from switches import python_with

from kvledger.events.types import (
    Baseline,
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
from kvledger.registry import makers
from kvledger.registry.emitter import EventEmitter

pytestmark = pytest.mark.skipif(not makers.COMPILED_MAKERS, reason="registry/_records.c not built")

RECORDS = (Stored, Removed, Offloaded, Onboarded, Cleared, Baseline, Lookup, Released, RunInfo)

# what a field may hold: the makers store any object, as the dataclasses' __init__ does
values = st.one_of(
    st.none(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=False),
    st.sampled_from(list(Tier)),
    st.text(max_size=8),
    st.tuples(st.integers(0, 2**64 - 1), st.integers(0, 2**64 - 1)),
    st.lists(st.integers(0, 2**64 - 1), max_size=4).map(tuple),
    st.builds(BlockInfo, st.integers(0, 9), st.integers(0, 9), st.none() | st.integers(0, 9)),
)


def by_keyword(cls: type[Any], fields: list[Any]) -> Any:
    names = [f.name for f in dataclasses.fields(cls)]
    return cls(**dict(zip(names, fields, strict=True)))


@given(st.sampled_from(RECORDS), st.data())
def test_a_maker_builds_what_the_keyword_constructor_builds(cls: type[Any], data: Any) -> None:
    count = len(dataclasses.fields(cls))
    fields = data.draw(st.lists(values, min_size=count, max_size=count))
    made, expected = makers.maker(cls)(*fields), by_keyword(cls, fields)
    assert type(made) is cls
    assert made == expected
    assert repr(made) == repr(expected)
    assert hash(made) == hash(expected)
    # every field where the dataclass put it (equality skips the compare=False ones)
    for f, value in zip(dataclasses.fields(cls), fields, strict=True):
        assert getattr(made, f.name) is value
    assert dataclasses.replace(made) == expected
    with pytest.raises(dataclasses.FrozenInstanceError):
        made.event_id = 1


def test_the_emitter_puts_each_value_in_its_field() -> None:
    """The field order the emitter's positional calls rely on (registry/emitter.py), every
    field read back, the ones equality skips (names, token ids, hash keys) too."""
    out: list[Any] = []
    emitter = EventEmitter(out.append, worker_id=2, dp_rank=1, clock=lambda: 3.5)
    info = BlockInfo(8, 9, 7)
    emitter.stored(Tier.G2, 7, [(8, 9)], [[1, 2]], ("lora", "s"))
    emitter.removed(Tier.G1, [8])
    emitter.copied(Tier.G1, Tier.G3, [info], [[1, 2]], [("lora", None)])
    emitter.copied(Tier.G3, Tier.G1, [info])
    expected = [
        Stored(
            event_id=0,
            tier=Tier.G2,
            parent_hash=7,
            blocks=((8, 9),),
            token_ids=((1, 2),),
            lora_name="lora",
            salt="s",
            worker_id=2,
            dp_rank=1,
            ts=3.5,
        ),
        Removed(event_id=1, tier=Tier.G1, sequence_hashes=(8,), worker_id=2, dp_rank=1, ts=3.5),
        Offloaded(
            event_id=2,
            tier=Tier.G3,
            src_tier=Tier.G1,
            blocks=(info,),
            token_ids=((1, 2),),
            hash_keys=(("lora", None),),
            worker_id=2,
            dp_rank=1,
            ts=3.5,
        ),
        Onboarded(
            event_id=3,
            tier=Tier.G1,
            src_tier=Tier.G3,
            blocks=(info,),
            worker_id=2,
            dp_rank=1,
            ts=3.5,
        ),
    ]
    assert [type(e) for e in out] == [type(e) for e in expected]
    for made, wanted in zip(out, expected, strict=True):
        assert dataclasses.astuple(made) == dataclasses.astuple(wanted)


def test_a_maker_takes_exactly_its_fields_by_position() -> None:
    make = makers.maker(Removed)
    with pytest.raises(TypeError, match="Removed maker takes 6 values, got 5"):
        make(1, 2, 0, Tier.G1, 0.0)
    with pytest.raises(TypeError, match="by position"):
        make(1, 2, 0, Tier.G1, 0.0, sequence_hashes=())


def test_records_made_are_tracked_and_freed() -> None:
    """The maker holds a reference to each value it stores and the record gives them back."""
    value = (object(),)
    before = sys.getrefcount(value)
    made = [makers.maker(Removed)(1, 2, 0, Tier.G1, 0.0, value) for _ in range(100)]
    assert sys.getrefcount(value) == before + 100
    assert gc.is_tracked(made[0])
    del made
    assert sys.getrefcount(value) == before


@dataclasses.dataclass(frozen=True)
class WithDict:
    a: int


@dataclasses.dataclass(frozen=True, slots=True)
class Checked:
    a: int

    def __post_init__(self) -> None:
        raise AssertionError("skipped by a maker")


@dataclasses.dataclass(slots=True)
class Derived:
    a: int
    b: int = dataclasses.field(init=False, default=0)


class Plain:
    __slots__ = ("a",)


@pytest.mark.parametrize(
    "cls, message",
    [
        (Plain, "not a dataclass"),
        (WithDict, "must keep exactly its fields in slots"),
        (Checked, "every field must be set by __init__"),
        (Derived, "every field must be set by __init__"),
    ],
)
def test_a_class_a_maker_cannot_build_is_refused(cls: type[Any], message: str) -> None:
    with pytest.raises(TypeError, match=message):
        makers.maker(cls)


def test_the_compiled_maker_refuses_what_is_not_a_slot() -> None:
    _records = pytest.importorskip("kvledger.registry._records")
    with pytest.raises(ValueError, match="Stored has no slot 'sequence_hashes'"):
        _records.maker(Stored, ["event_id", "sequence_hashes"])  # a property
    with pytest.raises(ValueError, match="no __dict__"):
        _records.maker(WithDict, ["a"])
    with pytest.raises(TypeError, match="must be a class"):
        _records.maker(object(), [])


@pytest.mark.parametrize("value, compiled", [("1", False), ("0", True), ("", True)])
def test_the_switch_turns_the_compiled_makers_off(value: str, compiled: bool) -> None:
    """``KVLEDGER_PYTHON_RECORDS=1``: the dataclasses' own constructors, with the same
    records."""
    code = (
        "from kvledger.registry import makers; from kvledger.events import types as t; "
        "m = makers.maker(t.Removed); e = m(1, 2, 0, t.Tier.G1, 0.5, (3,)); "
        "print(makers.COMPILED_MAKERS, type(m).__name__, e == t.Removed(event_id=1, "
        "worker_id=2, dp_rank=0, tier=t.Tier.G1, ts=0.5, sequence_hashes=(3,)))"
    )
    out = python_with("KVLEDGER_PYTHON_RECORDS", value, code)
    assert out.stdout.split() == [str(compiled), "Maker" if compiled else "function", "True"]
