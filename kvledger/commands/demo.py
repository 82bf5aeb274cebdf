"""``kvledger demo``: a few seconds of a mock engine's G1 cache, to see the registry work."""

from __future__ import annotations

import argparse
import random
from collections import Counter

from kvledger.commands.args import non_negative_int, positive_int
from kvledger.events.types import AnyEvent
from kvledger.mocker.g1_pool import Deref, FullBlock, MockG1Pool, Use
from kvledger.registry.hashing import TokenBlockSequence
from kvledger.registry.policies import POLICY_NAMES
from kvledger.registry.state import RegistryState


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("demo", help="run a small shared-prefix workload through the registry")
    p.add_argument("--requests", type=non_negative_int, default=2000)
    p.add_argument("--blocks", type=positive_int, default=2048, help="G1 capacity in blocks")
    p.add_argument("--block-size", type=positive_int, default=16)
    p.add_argument("--policy", choices=POLICY_NAMES, default="lineage")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    rng = random.Random(args.seed)
    events: list[AnyEvent] = []
    mgr = MockG1Pool(args.blocks, args.block_size, eviction=args.policy, sink=events.append)
    prompts = [[rng.randrange(32000) for _ in range(512)] for _ in range(16)]
    requested = hit = 0
    for _ in range(args.requests):
        tokens = rng.choice(prompts) + [rng.randrange(32000) for _ in range(rng.randrange(64, 512))]
        seq = TokenBlockSequence(tokens, args.block_size)
        blocks = [FullBlock(h) for h in seq.sequence_hashes]
        cached = mgr.pool.probe(seq.sequence_hashes)
        placed = mgr.process(Use(blocks, local_hashes=seq.local_hashes))
        mgr.process(Deref(blocks[:placed]))
        requested += len(blocks)
        hit += cached
    replayed = RegistryState.from_events(events)
    kinds = Counter(type(e).__name__ for e in events)
    print(f"requests          {args.requests}")
    print(f"blocks requested  {requested}")
    print(f"prefix hit rate   {hit / max(requested, 1):.1%}")
    print(f"G1 blocks cached  {mgr.num_inactive_blocks()} of {args.blocks}")
    print(f"events            {len(events)} ({', '.join(f'{k} {v}' for k, v in kinds.items())})")
    same = replayed == mgr.registry_state()
    print(f"replay of events  {'matches' if same else 'DIFFERS FROM'} the live registry")
    return 0 if same else 1
