"""Positional constructors of the event records, for the code that builds them by the thousand.

An event's dataclass ``__init__`` takes its fields by keyword and sets each through
``object.__setattr__``, as a frozen class must: a ``Stored`` built (and dropped) that way costs
about 21,700 instructions, paid for every transition the registry reports to a log or a
router's feed. ``maker(cls)`` gives a constructor that takes every field by position, in the
dataclass's field order; where ``registry/_records.c`` is built it stores the values straight
into the record's slots, which is what ``__init__`` leaves behind: about 2,500 instructions.
The record is the same either way: the same class, frozen, compared and shown by its dataclass
methods (``tests/test_makers_compiled.py``).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from typing import Any, TypeVar

try:
    from kvledger.registry import _records
except ImportError:  # not built: the dataclass's own __init__ serves
    COMPILED_MAKERS = False
else:
    COMPILED_MAKERS = os.environ.get("KVLEDGER_PYTHON_RECORDS", "") in ("", "0")
"""Whether ``maker`` builds records through ``registry/_records.c``: built, and
``KVLEDGER_PYTHON_RECORDS=1`` not in the environment (to measure it, or to rule it out)."""

R = TypeVar("R")


def field_names(cls: type[Any]) -> tuple[str, ...]:
    """The fields of the slotted dataclass ``cls`` in the order a maker takes them; a
    ``TypeError`` for a class a maker cannot build (not a dataclass, a field that ``__init__``
    does not take, a ``__post_init__`` that would be skipped, fields not all in slots)."""
    if not dataclasses.is_dataclass(cls) or not isinstance(cls, type):
        raise TypeError(f"{cls!r} is not a dataclass")
    fields = dataclasses.fields(cls)
    if any(not f.init for f in fields) or hasattr(cls, "__post_init__"):
        raise TypeError(f"{cls.__name__}: every field must be set by __init__ and nothing else")
    names = tuple(f.name for f in fields)
    slots = {name for klass in cls.__mro__ for name in vars(klass).get("__slots__", ())}
    if "__dict__" in dir(cls) or set(names) != slots:
        raise TypeError(f"{cls.__name__} must keep exactly its fields in slots")
    return names


def maker(cls: type[R]) -> Callable[..., R]:
    """A constructor of ``cls`` taking every field by position, in field order:
    ``maker(Removed)(event_id, worker_id, dp_rank, tier, ts, sequence_hashes)``."""
    names = field_names(cls)
    if COMPILED_MAKERS:
        make: Callable[..., R] = _records.maker(cls, names)
        return make

    def by_keyword(*values: Any) -> R:
        if len(values) != len(names):
            raise TypeError(f"a {cls.__name__} maker takes {len(names)} values, got {len(values)}")
        return cls(**dict(zip(names, values, strict=True)))

    return by_keyword
