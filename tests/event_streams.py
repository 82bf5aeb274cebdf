"""Random but well-formed event streams for the router index and shared registry tests.

Workers draw prompts from a few shared prefixes (so they hold the same blocks) and store,
remove, offload, onboard and clear the way a block manager would: a Stored is anchored to the
leading blocks the worker already holds, copies carry each block's real parent.
"""

from __future__ import annotations

import random
from collections.abc import Callable

from kvledger.events.types import AnyEvent, BlockInfo, Tier
from kvledger.registry.emitter import EventEmitter
from kvledger.registry.hashing import TokenBlockSequence

BLOCK_SIZE = 4


def tee(*sinks: Callable[[AnyEvent], object]) -> Callable[[AnyEvent], None]:
    """One sink handing each event to ``sinks`` in order: an emitter takes a single sink."""

    def sink(event: AnyEvent) -> None:
        for each in sinks:
            each(event)

    return sink


def prompt_pool(seed: int, prefixes: int = 4, prompts: int = 24) -> list[list[int]]:
    """Token lists sharing ``prefixes`` distinct beginnings."""
    rng = random.Random(seed)
    heads = [
        [rng.randrange(1000) for _ in range(BLOCK_SIZE * rng.randrange(1, 6))]
        for _ in range(prefixes)
    ]
    return [
        rng.choice(heads) + [rng.randrange(1000) for _ in range(BLOCK_SIZE * rng.randrange(1, 6))]
        for _ in range(prompts)
    ]


def worker_events(
    seed: int, worker_id: int, ops: int, prompts: list[list[int]], *, g1_only: bool = False
) -> list[AnyEvent]:
    """One worker's stream of ``ops`` operations (ids from 0, strictly increasing)."""
    rng = random.Random(seed * 7919 + worker_id)
    events: list[AnyEvent] = []
    emit = EventEmitter(events.append, worker_id=worker_id, dp_rank=worker_id % 2)
    held: dict[Tier, dict[int, BlockInfo]] = {t: {} for t in (Tier.G1, Tier.G2, Tier.G3)}
    for _ in range(ops):
        roll = rng.random()
        g1 = held[Tier.G1]
        if roll < 0.5 or not g1:
            tokens = rng.choice(prompts)
            seq = TokenBlockSequence(tokens, BLOCK_SIZE)
            infos = []
            parent = None
            for local, seq_hash in zip(seq.local_hashes, seq.sequence_hashes, strict=True):
                infos.append(BlockInfo(seq_hash, local, parent))
                parent = seq_hash
            k = 0
            while k < len(infos) and infos[k].sequence_hash in g1:
                k += 1
            new = infos[k:]
            if new:
                emit.stored(
                    Tier.G1, new[0].parent_hash, [(b.sequence_hash, b.local_hash) for b in new]
                )
                for b in new:
                    g1[b.sequence_hash] = b
        elif roll < 0.75:
            gone = rng.sample(sorted(g1), rng.randrange(1, min(len(g1), 6) + 1))
            emit.removed(Tier.G1, gone)
            for s in gone:
                del g1[s]
        elif roll < 0.97 and not g1_only:
            src, dst = rng.choice([(Tier.G1, Tier.G2), (Tier.G2, Tier.G3), (Tier.G2, Tier.G1)])
            pool = held[src]
            if not pool:
                continue
            picked = [
                pool[s] for s in rng.sample(sorted(pool), rng.randrange(1, min(len(pool), 5) + 1))
            ]
            emit.copied(src, dst, picked)
            for b in picked:
                held[dst][b.sequence_hash] = b
            if rng.random() < 0.5 and src != Tier.G1:
                emit.removed(src, [b.sequence_hash for b in picked])
                for b in picked:
                    del pool[b.sequence_hash]
        else:
            tier = Tier.G1 if g1_only else rng.choice(list(held))
            emit.cleared(tier)
            held[tier].clear()
    return events
