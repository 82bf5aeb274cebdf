"""The vocabulary of block transitions.

Every change to what a worker holds is one of these records. They are plain immutable
values that import nothing of the project, so the registry (which produces them), the log
(which stores them), replay (which folds them) and the router encoders (which translate
them) can all depend on this module without depending on each other.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, replace
from typing import NamedTuple, TypeAlias


class Tier(enum.IntEnum):
    """Where a block lives. Lower numbers are faster and smaller."""

    G1 = 1  # GPU memory
    G2 = 2  # host memory
    G3 = 3  # local disk
    G4 = 4  # another worker's memory

    @classmethod
    def parse(cls, value: str | int | Tier) -> Tier:
        """Accept ``Tier.G2``, ``2``, ``"G2"`` or ``"g2"``; reject anything else clearly."""
        if isinstance(value, Tier):
            return value
        if isinstance(value, int):
            return cls(value)
        try:
            return cls[value.strip().upper()]
        except KeyError:
            raise ValueError(f"unknown tier {value!r}; expected one of G1, G2, G3, G4") from None


HashKey: TypeAlias = tuple[str | None, str | None]
"""``(lora_name, salt)``: what besides the tokens names a block (``hashing.block_seed``)."""


class BlockInfo(NamedTuple):
    """A block's identity: its prefix hash, its own tokens' hash and its parent's prefix hash."""

    sequence_hash: int
    local_hash: int
    parent_hash: int | None


@dataclass(frozen=True, slots=True, kw_only=True)
class Event:
    """Fields every transition carries.

    ``event_id`` is per worker and strictly increasing from 0, which is what makes
    consumers idempotent: an event whose id is not above the last applied one is a repeat.
    """

    event_id: int
    worker_id: int
    dp_rank: int
    tier: Tier
    ts: float


@dataclass(frozen=True, slots=True, kw_only=True)
class Stored(Event):
    """Blocks now present on ``tier``.

    ``blocks`` is a chain of ``(sequence_hash, local_hash)``: the first block's parent is
    ``parent_hash`` (None at the start of a sequence) and each later block's parent is the
    block before it.
    """

    parent_hash: int | None
    blocks: tuple[tuple[int, int], ...]
    token_ids: tuple[tuple[int, ...], ...] | None = None
    #: what moved the local-hash seed (``hashing.block_seed``): routers that hash tokens
    #: themselves need them to name the blocks as the worker does. Not kept by the durable
    #: log, so not part of an event's equality (nor are a copy's token ids below).
    lora_name: str | None = field(default=None, compare=False)
    salt: str | None = field(default=None, compare=False)

    @property
    def sequence_hashes(self) -> tuple[int, ...]:
        return tuple(seq for seq, _ in self.blocks)

    def infos(self) -> list[BlockInfo]:
        """The blocks with their parents spelled out."""
        out: list[BlockInfo] = []
        parent = self.parent_hash
        for seq, local in self.blocks:
            out.append(BlockInfo(seq, local, parent))
            parent = seq
        return out


@dataclass(frozen=True, slots=True, kw_only=True)
class Removed(Event):
    """Blocks gone from ``tier`` (evicted or dropped)."""

    sequence_hashes: tuple[int, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class Offloaded(Event):
    """A copy from a faster ``src_tier`` to a slower ``tier`` finished.

    The blocks carry their full identity (not only the sequence hash) so that whoever
    folds the event can place them on ``tier`` without consulting ``src_tier``, which may
    have evicted them by then.
    """

    src_tier: Tier
    blocks: tuple[BlockInfo, ...]
    #: each block's token ids (empty where unknown) and ``(lora_name, salt)`` (None: neither),
    #: for routers that hash tokens themselves; the durable log keeps neither
    token_ids: tuple[tuple[int, ...], ...] | None = field(default=None, compare=False)
    hash_keys: tuple[HashKey | None, ...] | None = field(default=None, compare=False)

    @property
    def sequence_hashes(self) -> tuple[int, ...]:
        return tuple(b.sequence_hash for b in self.blocks)


@dataclass(frozen=True, slots=True, kw_only=True)
class Onboarded(Event):
    """A copy from a slower ``src_tier`` (G2, G3 or a remote worker's G4) to ``tier`` finished."""

    src_tier: Tier
    blocks: tuple[BlockInfo, ...]
    #: each block's token ids (empty where unknown) and ``(lora_name, salt)`` (None: neither),
    #: for routers that hash tokens themselves; the durable log keeps neither
    token_ids: tuple[tuple[int, ...], ...] | None = field(default=None, compare=False)
    hash_keys: tuple[HashKey | None, ...] | None = field(default=None, compare=False)

    @property
    def sequence_hashes(self) -> tuple[int, ...]:
        return tuple(b.sequence_hash for b in self.blocks)


@dataclass(frozen=True, slots=True, kw_only=True)
class Cleared(Event):
    """Every block on ``tier`` is gone."""


AnyEvent: TypeAlias = Stored | Removed | Offloaded | Onboarded | Cleared


@dataclass(frozen=True, slots=True, kw_only=True)
class Baseline(Event):
    """Every block a worker holds on ``tier`` as of its event ``event_id``, by its log's fold.

    Not a transition and never in the log: the shared registry's stream carries one per tier
    when a worker's entries were replaced by its log's fold (a restart found the registry
    ahead of the log, or knowing nothing of a long log), right after the worker's purge
    notice. A reader drops what it had of the worker (the purge), takes these blocks, and
    goes on with the worker's events after ``event_id``.
    """

    blocks: tuple[BlockInfo, ...]


EVENT_KINDS: dict[str, type[AnyEvent]] = {
    "stored": Stored,
    "removed": Removed,
    "offloaded": Offloaded,
    "onboarded": Onboarded,
    "cleared": Cleared,
}
KIND_OF: dict[type[AnyEvent], str] = {cls: name for name, cls in EVENT_KINDS.items()}


# -- lookup records: what requests asked for, not transitions ----------------------------------
#
# They go to the durable log only, in a stream of their own per worker (ids from 0, apart from
# the transitions' ids), so that every consumer of transitions (replay's fold, the shared
# registry, router encoders) neither sees them nor sees a gap in the transition ids.


@dataclass(frozen=True, slots=True, kw_only=True)
class Lookup(Event):
    """A request asked to hold blocks ``start..`` of its sequence, and what hit.

    ``start`` is 0 when a request arrives (its prompt's lookup) and the number of blocks it
    already holds when it grows (decode). ``hits`` is (blocks found on G1, blocks onboarded
    from G2, from G3), a prefix of ``sequence_hashes``. ``num_tokens`` is the prompt's length
    in tokens, 0 when the engine did not say.
    """

    request_id: int
    num_tokens: int
    start: int
    sequence_hashes: tuple[int, ...]
    hits: tuple[int, int, int]


@dataclass(frozen=True, slots=True, kw_only=True)
class Released(Event):
    """A request ended (or was preempted) and let go of the blocks it held."""

    request_id: int


@dataclass(frozen=True, slots=True, kw_only=True)
class RunInfo(Event):
    """The settings a run (or a restart) started with: what a re-run of its lookups needs to
    reproduce them."""

    g1_blocks: int
    g2_blocks: int
    g3_blocks: int
    block_size: int
    policy: str
    offload_filter: str


LookupRecord: TypeAlias = Lookup | Released | RunInfo
LogRecord: TypeAlias = AnyEvent | LookupRecord

LOOKUP_KINDS: dict[str, type[LookupRecord]] = {
    "lookup": Lookup,
    "release": Released,
    "run": RunInfo,
}


def lookup_stream(worker_id: int) -> int:
    """The key a worker's lookup records are stored under in the log's ``worker`` column
    (``-1 - worker_id``): worker ids are never negative, so the two streams cannot clash."""
    return ~worker_id


def without_token_ids(event: AnyEvent) -> AnyEvent:
    """``event`` without the token ids it carries (users' prompts); the same event when it has
    none. What the ``token_ids`` setting sends where prompts must not go."""
    if isinstance(event, Stored | Offloaded | Onboarded) and event.token_ids is not None:
        return replace(event, token_ids=None)
    return event
