"""The reader's side of G4: find who holds the next blocks of a prompt and READ them over NIXL.

A fetch is two steps, so the caller decides how many local slots to give before any bytes move:

1. ``plan``: the shared registry (``who_has``) names the other workers holding the prompt's
   next blocks on their host tier; the one with the longest run wins; the remote directory
   gives its agent card and each block's slot and checksum (one round trip each).
2. ``execute``: one NIXL READ of the whole run into the caller's host slots, then every block's
   xxh3 is checked against its entry and the entries are looked up again. What survives is a
   prefix of the plan; everything after the first bad block is a miss.

Failures never raise: they end the run early with a reason, counted in ``stats`` (and in the
``kvbm_remote_fetch_failures`` counter when a Prometheus collector is given). Reasons:
``no_agent`` (lease gone or no card), ``vanished`` (the owner dropped the block), ``shape``
(the owner's blocks are another size), ``timeout``, ``disconnected``, ``error`` (the read
failed), ``checksum`` (the bytes read are not the block the entry names), ``registry`` (Redis
did not answer) and ``bad_card`` (what the owner published cannot be parsed).
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import redis

from kvledger.events.types import Tier
from kvledger.tiers.base import MemoryTier
from kvledger.tiers.layout import FullyContiguous
from kvledger.tiers.remote.agent import RemoteAgent
from kvledger.tiers.remote.directory import AgentCard, BlockEntry, RemoteDirectory, shape_key
from kvledger.tiers.remote.export import block_checksum

REASONS = (
    "registry",
    "bad_card",
    "no_agent",
    "vanished",
    "shape",
    "timeout",
    "disconnected",
    "error",
    "checksum",
)

_TIER_BIT = {Tier.G1: 1, Tier.G2: 2, Tier.G3: 4, Tier.G4: 8}


class HolderIndex(Protocol):
    """``kvledger.events.shared.registry.SharedRegistry`` fits."""

    def who_has(
        self, sequence_hashes: Sequence[int], *, stop_at_miss: bool = False
    ) -> list[dict[int, int]]: ...


class _Miss(Exception):
    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True, slots=True)
class FetchPlan:
    """Blocks ``sequence_hashes`` to read from ``worker``: its card and one entry per block."""

    worker_id: int
    card: AgentCard
    sequence_hashes: tuple[int, ...]
    entries: tuple[BlockEntry, ...]

    def __len__(self) -> int:
        return len(self.entries)


@dataclass(frozen=True, slots=True)
class FetchResult:
    """``count`` leading blocks of the plan arrived intact; ``reason`` says why the rest did not.

    ``held_back`` slots belong to a read abandoned at its deadline that may still write into
    them: the caller keeps them allocated until ``RemoteFetcher.reclaim`` hands them back.
    """

    worker_id: int | None
    count: int
    reason: str | None = None
    detail: str = ""
    seconds: float = 0.0
    held_back: tuple[int, ...] = ()


@dataclass(slots=True)
class FetchStats:
    fetches: int = 0
    blocks: int = 0
    bytes: int = 0
    failures: Counter[str] = field(default_factory=Counter)


class RemoteFetcher:
    """Reads other workers' blocks into this worker's host tier (``local``, registered with
    ``agent``). ``worker_id`` is this worker, never read from."""

    def __init__(
        self,
        agent: RemoteAgent,
        directory: RemoteDirectory,
        holders: HolderIndex,
        local: MemoryTier,
        *,
        worker_id: int,
        source_tier: Tier = Tier.G2,
        timeout_s: float = 5.0,
        collector: object | None = None,
    ) -> None:
        if not isinstance(local.layout, FullyContiguous) or local.device.type != "cpu":
            raise ValueError("remote blocks land on a host tier (G2), where checksums are checked")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        agent.region(local.tier)  # raises when the landing tier is not registered
        self.agent = agent
        self.directory = directory
        self.holders = holders
        self.local = local
        self.layout: FullyContiguous = local.layout
        self.worker_id = worker_id
        self.block_shape = shape_key(local.shape)
        self.source_tier = source_tier
        self.timeout_s = timeout_s
        self.stats = FetchStats()
        self._lock = threading.Lock()
        self._failures = _failure_counter(collector)
        self._held: dict[int, list[int]] = {}  # abandoned read id -> its destination slots

    # -- step 1 ------------------------------------------------------------------------------

    def plan(self, sequence_hashes: Sequence[int], limit: int | None = None) -> FetchPlan | None:
        """Who holds the longest run of ``sequence_hashes`` (from its first block) and where.

        None when no other worker holds the first block, or when the best holder's entries
        do not cover it (counted as a failure with its reason).
        """
        hashes = list(sequence_hashes[:limit] if limit is not None else sequence_hashes)
        if not hashes:
            return None
        try:
            return self._plan(hashes)
        except _Miss as miss:
            self._fail(miss.reason)
            return None

    def _plan(self, hashes: list[int]) -> FetchPlan | None:
        bit = _TIER_BIT[self.source_tier]
        run: dict[int, int] = {}
        stalled = self.agent.stalled_workers()  # a read to it is still hanging: ask others
        try:
            who = self.holders.who_has(hashes, stop_at_miss=True)
        except redis.RedisError:
            raise _Miss("registry") from None
        for position, holders in enumerate(who):
            for worker, mask in holders.items():
                if (
                    worker != self.worker_id
                    and worker not in stalled
                    and mask & bit
                    and run.get(worker, 0) == position
                ):
                    run[worker] = position + 1
        if not run:
            return None
        worker, count = max(run.items(), key=lambda wc: (wc[1], -wc[0]))
        card, entries = self._lookup(worker, hashes[:count])
        if card is None:
            raise _Miss("no_agent")
        if card.block_shape != self.block_shape or card.block_bytes != self.local.shape.block_bytes:
            raise _Miss("shape")
        region = card.region(self.source_tier)
        good: list[BlockEntry] = []
        for entry in entries:
            if entry is None or entry.tier != self.source_tier or region is None:
                break
            if not 0 <= entry.slot < region.num_slots:
                break
            good.append(entry)
        if not good:
            raise _Miss("vanished")
        return FetchPlan(worker, card, tuple(hashes[: len(good)]), tuple(good))

    # -- step 2 ------------------------------------------------------------------------------

    def execute(self, plan: FetchPlan, dst_slots: Sequence[int]) -> FetchResult:
        """READ the plan's first ``len(dst_slots)`` blocks into ``dst_slots`` of the local tier.

        Returns how many leading blocks are intact in their slots; the caller registers those
        and frees the rest (whose bytes are undefined).
        """
        n = min(len(plan), len(dst_slots))
        dst = self.local.check_slots(dst_slots[:n], "destination")
        region = plan.card.region(self.source_tier)
        assert region is not None  # plan() checked
        pairs = [(e.slot, d) for e, d in zip(plan.entries[:n], dst, strict=True)]
        outcome = self.agent.read(
            plan.card, region, self.local.tier, pairs, timeout_s=self.timeout_s
        )
        if not outcome.ok:
            self._fail(outcome.reason or "error")
            held: tuple[int, ...] = ()
            if outcome.in_flight is not None:
                held = tuple(dst)
                with self._lock:
                    self._held[outcome.in_flight] = list(dst)
            return FetchResult(
                plan.worker_id, 0, outcome.reason, outcome.detail, outcome.seconds, held
            )
        good, reason = n, None
        for i, (entry, slot) in enumerate(zip(plan.entries[:n], dst, strict=True)):
            if block_checksum(self.layout, slot) != entry.checksum:
                good, reason = i, "checksum"
                break
        if good:  # the owner may have dropped blocks while they were read: look again
            try:
                card, again = self._lookup(plan.worker_id, plan.sequence_hashes[:good])
            except _Miss as miss:
                card, again, reason = None, [], miss.reason
            if card is None or card.agent_name != plan.card.agent_name:
                good, reason = 0, reason or "no_agent"
            else:
                for i, (before, now) in enumerate(zip(plan.entries[:good], again, strict=True)):
                    if now != before:
                        good, reason = i, "vanished"
                        break
        if reason is not None:
            self._fail(reason)
        with self._lock:
            self.stats.fetches += 1
            self.stats.blocks += good
            self.stats.bytes += good * self.local.shape.block_bytes
        return FetchResult(plan.worker_id, good, reason, "", outcome.seconds)

    @property
    def holding(self) -> bool:
        """Whether slots of ``held_back`` results still wait for ``reclaim``."""
        with self._lock:
            return bool(self._held)

    def reclaim(self) -> list[int]:
        """Slots of ``held_back`` results whose reads have ended since: free to reuse now.
        Each is named once; the fetcher keeps the rest, so callers need no list of their own."""
        ended = self.agent.settle()
        with self._lock:
            return [slot for read_id in ended for slot in self._held.pop(read_id, [])]

    def _lookup(
        self, worker: int, hashes: Sequence[int]
    ) -> tuple[AgentCard | None, list[BlockEntry | None]]:
        try:
            return self.directory.lookup(worker, hashes)
        except redis.RedisError:
            raise _Miss("registry") from None
        except ValueError:
            raise _Miss("bad_card") from None

    def _fail(self, reason: str) -> None:
        with self._lock:
            self.stats.failures[reason] += 1
        if self._failures is not None:
            self._failures.labels(reason).inc()


@dataclass(slots=True)
class Fetched:
    """What ``fetch_blocks`` did: ``(index in the hashes, local slot)`` of each block that
    arrived intact, and local slots an abandoned read may still write into (keep them
    allocated until ``RemoteFetcher.reclaim`` names them)."""

    landed: list[tuple[int, int]] = field(default_factory=list)
    held_back: list[int] = field(default_factory=list)


def fetch_blocks(fetcher: RemoteFetcher, hashes: Sequence[int], slots: Sequence[int]) -> Fetched:
    """Read each of ``hashes`` from whichever other worker holds it (longest runs first) into
    ``slots`` of the fetcher's local tier, each block checked (``execute``).

    A block nobody holds, or whose read fails (its owner evicted or overwrote it after the
    lookup, the owner is gone, the bytes are not the block) is a miss for that block only:
    the fetch goes on after it. Slots left over are unused; their bytes are undefined. What
    the vLLM peer tier and the SGLang backend both do with other workers' blocks.
    """
    fetched = Fetched()
    free = list(slots)  # landing slots not used yet
    at = 0
    while at < len(hashes) and free:
        plan = fetcher.plan(hashes[at:], limit=len(free))
        if plan is None:  # nobody holds it (now): a miss for this block
            at += 1
            continue
        landing, free = free[: len(plan)], free[len(plan) :]
        result = fetcher.execute(plan, landing)
        fetched.held_back.extend(result.held_back)
        fetched.landed.extend((at + i, landing[i]) for i in range(result.count))
        used = set(result.held_back)
        free = [s for s in landing[result.count :] if s not in used] + free
        at += max(result.count, 1)  # the block that failed is a miss; go on after it
    return fetched


def _failure_counter(collector: object | None) -> Any:
    """A ``kvbm_remote_fetch_failures`` counter on ``collector`` (a prometheus
    ``CollectorRegistry``), or None without one."""
    if collector is None:
        return None
    from prometheus_client import CollectorRegistry
    from prometheus_client import Counter as PromCounter

    if not isinstance(collector, CollectorRegistry):
        raise TypeError(f"collector must be a prometheus CollectorRegistry, got {collector!r}")
    return PromCounter(
        "kvbm_remote_fetch_failures",
        "Remote (G4) block reads that ended as a miss, by reason",
        ["reason"],
        registry=collector,
    )
