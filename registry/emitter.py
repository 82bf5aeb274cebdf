"""Numbering and stamping of events before they reach a sink.

One emitter per worker: every pool of that worker (G1, G2, G3) shares it, so the worker's
event ids form a single strictly increasing sequence no matter which tier changed.
"""

from __future__ import annotations

import sys
import time
from array import array
from collections.abc import Callable, Iterable, Sequence

from kvledger.events.types import (
    AnyEvent,
    BlockInfo,
    Cleared,
    HashKey,
    Offloaded,
    Onboarded,
    Removed,
    Stored,
    Tier,
)
from kvledger.registry.makers import maker

EventSink = Callable[[AnyEvent], None]

# The hot records' constructors by position (``registry.makers``: about a ninth of the keyword
# ``__init__``'s cost where compiled), each call's values in its dataclass's field order
_STORED = maker(Stored)  # event_id, worker_id, dp_rank, tier, ts, parent_hash, blocks,
#                          token_ids, lora_name, salt
_REMOVED = maker(Removed)  # event_id, worker_id, dp_rank, tier, ts, sequence_hashes
# both: event_id, worker_id, dp_rank, tier, ts, src_tier, blocks, token_ids, hash_keys
_OFFLOADED = maker(Offloaded)
_ONBOARDED = maker(Onboarded)

BlockTokens = bytes | Sequence[int]
"""One block's token ids: as the little-endian u32 bytes the pools keep, or as integers."""


def token_tuple(tokens: BlockTokens | None) -> tuple[int, ...]:
    """One block's token ids as the tuple events carry (empty when unknown)."""
    if tokens is None:
        return ()
    if isinstance(tokens, bytes):
        ids = array("I", tokens)
        if sys.byteorder == "big":  # pragma: no cover - kvledger runs on little-endian hosts
            ids.byteswap()
        return tuple(ids)
    return tuple(tokens)


LOCAL_TIERS = (Tier.G1, Tier.G2, Tier.G3)
"""A worker's own tiers: what a restart says start empty (``resume``), less any it recovered."""


class EventEmitter:
    """Turns state changes into numbered events and hands them to ``sink``.

    Without a sink, nothing is built (the registry runs at full speed) but ids still advance,
    so attaching a sink later never reuses an id.
    """

    __slots__ = ("sink", "worker_id", "dp_rank", "next_event_id", "clock")

    def __init__(
        self,
        sink: EventSink | None = None,
        *,
        worker_id: int = 0,
        dp_rank: int = 0,
        first_event_id: int = 0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.sink = sink
        self.worker_id = worker_id
        self.dp_rank = dp_rank
        self.next_event_id = first_event_id
        self.clock = clock

    def resume(self, last_event_id: int, clear: Iterable[Tier] = ()) -> None:
        """The restart rule: continue the ids of an earlier run of this worker that logged up
        to ``last_event_id`` (-1: there was none), and after one, say with a ``Cleared`` that
        each tier in ``clear`` starts empty, so the log replays to this run and not to what
        the earlier one left."""
        self.next_event_id = last_event_id + 1
        if last_event_id >= 0:
            for tier in clear:
                self.cleared(tier)

    def stored(
        self,
        tier: Tier,
        parent_hash: int | None,
        blocks: Sequence[tuple[int, int]],
        token_ids: Sequence[BlockTokens] | None = None,
        key: HashKey | None = None,
    ) -> None:
        if not blocks:
            return
        eid = self.next_event_id  # inline: every registration and eviction passes here
        self.next_event_id = eid + 1
        if self.sink is None:
            return
        self.sink(
            _STORED(
                eid,
                self.worker_id,
                self.dp_rank,
                tier,
                self.clock(),
                parent_hash,
                tuple(blocks),
                None if token_ids is None else tuple(map(token_tuple, token_ids)),
                None if key is None else key[0],
                None if key is None else key[1],
            )
        )

    def removed(self, tier: Tier, sequence_hashes: Iterable[int]) -> None:
        hashes = tuple(sequence_hashes)
        if not hashes:
            return
        eid = self.next_event_id
        self.next_event_id = eid + 1
        if self.sink is None:
            return
        self.sink(_REMOVED(eid, self.worker_id, self.dp_rank, tier, self.clock(), hashes))

    def copied(
        self,
        src_tier: Tier,
        dst_tier: Tier,
        blocks: Sequence[BlockInfo],
        tokens: Sequence[BlockTokens | None] | None = None,
        keys: Sequence[HashKey | None] | None = None,
    ) -> None:
        """A copy between tiers finished: Offloaded when it went down, Onboarded when up.
        ``tokens`` and ``keys`` (one per block, when known) ride along for routers."""
        if not blocks:
            return
        if src_tier == dst_tier:
            raise ValueError(f"a copy needs two different tiers, got {src_tier.name} twice")
        eid = self.next_event_id
        self.next_event_id = eid + 1
        if self.sink is None:
            return
        make = _OFFLOADED if dst_tier > src_tier else _ONBOARDED
        self.sink(
            make(
                eid,
                self.worker_id,
                self.dp_rank,
                dst_tier,
                self.clock(),
                src_tier,
                tuple(blocks),
                None if tokens is None else tuple(map(token_tuple, tokens)),
                None if keys is None or not any(keys) else tuple(keys),
            )
        )

    def cleared(self, tier: Tier) -> None:
        eid = self.next_event_id
        self.next_event_id = eid + 1
        if self.sink is None:
            return
        self.sink(
            Cleared(
                event_id=eid,
                worker_id=self.worker_id,
                dp_rank=self.dp_rank,
                tier=tier,
                ts=self.clock(),
            )
        )
