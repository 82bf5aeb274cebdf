"""The Redis key layout of one shared-registry namespace, in one place.

A namespace's registry is split over N shards (N fixed when the namespace is first opened, and
recorded in it). Every key of a shard lies under one hash tag, so Redis Cluster keeps a shard on
one slot, which the Lua scripts need because they touch keys they derive from the prefix
(``lua/generations.lua`` builds ``idx``, ``gens`` and ``sweep`` from it). Shard 0 is
``kvl:{<namespace>}:``, the layout of an unsharded namespace, so N = 1 is exactly that layout;
shard i > 0 is ``kvl:{<namespace>:<i>:<salt>}:`` (a namespace cannot contain ':', so no
namespace's tag collides with a shard's). The salt is the smallest that puts the shard's slot
nearest to i/N of the way round the 16384 slots from shard 0's: Redis Cluster gives each master
a contiguous run of slots, so evenly spaced slots spread the shards over the masters instead of
leaving it to CRC16 (three random slots fall on three different masters of three only 2 times
in 9). Which node serves a slot stays the cluster client's business.

The shared registry, its publishers and subscribers, and the G4 directory
(``kvledger.tiers.remote.directory``) all name their keys through ``KeySpace``.

Kept by the shared registry in every shard (``registry.py`` says what each holds):

- ``idx``, ``gens``, ``held``, ``applied``, ``count``, ``workers``, ``events``,
  ``events:size``, ``sweep``, ``fence``, ``tips``
- ``lease:<worker>``            string with a TTL, refreshed by every apply and by heartbeats

and in shard 0 only:

- ``shards``                    string  N, the namespace's shard count
- ``claim:<worker>``            string with the lease's TTL: ``<token>|<holder JSON>``, who
                                owns the worker id now
- ``tokens``                    hash    worker id -> the last fencing token handed out

Kept by the G4 directory, in keys the registry's scripts never touch:

- ``nixl:<worker>``             string  the worker's NIXL agent card
- ``nixl:<worker>:blocks``      hash    where each of its blocks sits
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from redis.crc import REDIS_CLUSTER_HASH_SLOTS, key_slot

_NAMESPACE = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")
_SALTS = 4096  # candidates per shard: the best lands within a few slots of its target
MAX_SHARDS = 1024


@dataclass(frozen=True, slots=True)
class KeySpace:
    """The keys of one namespace (its shard 0): ``KeySpace("prod").lease(3) ==
    "kvl:{prod}:lease:3"``; ``shards(n)`` gives the key spaces of all n shards."""

    namespace: str
    tag: str = ""
    """The hash tag between the braces; empty for shard 0, which uses the namespace."""
    prefix: str = field(init=False)

    def __post_init__(self) -> None:
        if not isinstance(self.namespace, str) or not _NAMESPACE.match(self.namespace):
            raise ValueError(
                f"namespace {self.namespace!r} must be 1-64 characters of letters, digits, "
                "'_', '.', '-'"
            )
        object.__setattr__(self, "prefix", f"kvl:{{{self.tag or self.namespace}}}:")

    def shards(self, count: int) -> list[KeySpace]:
        """The key spaces of a namespace split over ``count`` shards; the first is this one."""
        if not 1 <= count <= MAX_SHARDS:
            raise ValueError(f"shard count must be 1..{MAX_SHARDS}, got {count}")
        home = key_slot(self.namespace.encode())
        out = [KeySpace(self.namespace)]
        for i in range(1, count):
            target = (home + i * REDIS_CLUSTER_HASH_SLOTS // count) % REDIS_CLUSTER_HASH_SLOTS

            def distance(salt: int, i: int = i, target: int = target) -> int:
                gap = abs(key_slot(f"{self.namespace}:{i}:{salt}".encode()) - target)
                return min(gap, REDIS_CLUSTER_HASH_SLOTS - gap)

            salt = min(range(_SALTS), key=distance)
            out.append(KeySpace(self.namespace, f"{self.namespace}:{i}:{salt}"))
        return out

    @property
    def shard_count(self) -> str:
        """Where the namespace records its shard count (shard 0 only)."""
        return self.prefix + "shards"

    # -- the shared registry's -----------------------------------------------------------

    @property
    def index(self) -> str:
        return self.prefix + "idx"

    @property
    def generations(self) -> str:
        return self.prefix + "gens"

    @property
    def held(self) -> str:
        return self.prefix + "held"

    @property
    def applied(self) -> str:
        return self.prefix + "applied"

    @property
    def count(self) -> str:
        return self.prefix + "count"

    @property
    def workers(self) -> str:
        return self.prefix + "workers"

    @property
    def stream(self) -> str:
        return self.prefix + "events"

    @property
    def stream_size(self) -> str:
        """Hash: ``mean``, the recent mean events per stream entry, which turns the stream's
        length bound in events into one in entries."""
        return self.prefix + "events:size"

    @property
    def sweep(self) -> str:
        return self.prefix + "sweep"

    @property
    def fence(self) -> str:
        return self.prefix + "fence"

    @property
    def tips(self) -> str:
        return self.prefix + "tips"

    def lease(self, worker_id: int | str) -> str:
        return f"{self.prefix}lease:{worker_id}"

    # -- worker id claims (shard 0 only) -------------------------------------------------

    def claim(self, worker_id: int | str) -> str:
        return f"{self.prefix}claim:{worker_id}"

    @property
    def tokens(self) -> str:
        return self.prefix + "tokens"

    # -- the G4 directory's --------------------------------------------------------------

    def agent_card(self, worker_id: int) -> str:
        return f"{self.prefix}nixl:{int(worker_id)}"

    def block_table(self, worker_id: int) -> str:
        return f"{self.prefix}nixl:{int(worker_id)}:blocks"

    def all_keys(self) -> str:
        """The SCAN pattern that matches every key of the namespace."""
        return self.prefix + "*"
