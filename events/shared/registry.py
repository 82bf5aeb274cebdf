"""The registry shared by all workers, kept in Redis.

Each worker's events are applied by a Lua script (``lua/apply.lua``, loaded by ``scripts.py``),
so a call is atomic and the per-worker "last applied event id" moves in the same step as the
index: applying events twice changes nothing, and a call that starts past the next expected id
is refused at the gap and the caller fills it from the worker's durable log. The Python side
checks the records and reduces a run of events to what it leaves behind (each touched block
once, with the bits it ends set or cleared, and the Cleared count per tier), so Lua only does
the part that needs the stored values; a long batch goes out as several calls in one pipeline.
This module says what each call holds; how calls reach one server or a cluster's nodes, and
reloading scripts a server lost, is ``transport.py``'s job. The same script appends every
applied event to one Redis stream (trimmed approximately), so routers reading it with a
consumer group see each event exactly once, in order per worker. The stream's record of an
event is its durable-log record (``codec.encode``, checksummed): a publisher fed by the log's
commits sends the very bytes the log stored.

The index may be split over N shards by sequence hash (``keys.KeySpace.shards``); every shard
keeps all the keys below for its blocks (its own applied id per worker, generations, lease),
every batch reaches every shard, and a worker's records go to its home shard's stream only.
docs/shared-registry.md (Sharding and Redis Cluster) says how leases, purges, fail-overs and
slot migrations work across them.

Keys of a shard, all under its prefix (``kvl:{<namespace>}:`` for shard 0) and named by
``keys.KeySpace`` (the braces are a hash tag: Redis Cluster keeps a whole shard on one slot,
which the scripts need because they touch keys they derive):

- ``idx``                       hash  8-byte sequence hash -> run of 21-byte entries: u32 worker
                                id, u8 tier mask (G1=1, G2=2, G3=4, G4=8), and the worker's 16
                                generation bytes (below) when the entry was written
- ``gens``                      hash  4-byte worker id -> four u32 generations, one per tier
- ``held``                      hash  ``<worker>:<tier>`` -> live entries of that worker and tier
- ``applied`` / ``count``       hash  worker id -> last applied event id / events applied
- ``lease:<worker>``            string with a TTL; refreshed by every apply and by heartbeats
- ``workers``                   set   workers that may hold entries (swept by ``purge_expired``)
- ``events``                    stream of applied records (fields ``w`` worker, ``r`` record)
- ``sweep``                     hash  ``cursor`` of the running stale-entry sweep pass, and
                                ``again`` when another pass must follow it; absent: no block
                                holds a stale bit

Why generations: a tier bit of an entry counts only while the generation stamped for that tier
equals the worker's current one. Cleared bumps one tier's generation and a purge bumps all four,
so both are O(1) however many blocks the worker held, and the apply keeps no per-tier record of
what a worker holds (a second hashtable insert per block, or a log to replay and compact, costs
about as much as the index itself). Generations are never reset (a purged worker that comes
back must not revive its old entries), so ``gens`` keeps one 16-byte field per worker ever seen.
Readers (``who_has``, ``snapshot``) drop stale bits using the generations read in the same
round trip; writes drop the writer's stale bits (and, on blocks it shares, other workers') from
the blocks they touch, and a sweep (a slice of HSCAN per apply, started by a Cleared or purge
that made anything stale) removes the rest, so stale entries do not pile up. ``held`` keeps the
per-tier counts exact, which is what lets a purge say how many entries it dropped and lets a
no-op Cleared skip the sweep.
"""

from __future__ import annotations

import itertools
import operator
import struct
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import redis
from xxhash import xxh3_64_intdigest

from kvledger.events import codec
from kvledger.events.codec import KIND_CODES
from kvledger.events.shared import scripts as lua
from kvledger.events.shared.claims import ClaimLost, Holder, WorkerIdTaken
from kvledger.events.shared.client import REFUSALS, Client
from kvledger.events.shared.keys import MAX_SHARDS, KeySpace
from kvledger.events.shared.transport import Arg, Transport
from kvledger.events.types import (
    AnyEvent,
    Cleared,
    LogRecord,
    Lookup,
    Offloaded,
    Onboarded,
    Released,
    Removed,
    RunInfo,
    Stored,
    Tier,
    without_token_ids,
)
from kvledger.events.wire import encode_baseline, hash_key, pack_hashes, pack_stream_entry
from kvledger.registry.columns import BlockColumns
from kvledger.registry.index import prefix_depths

_STAMPED = struct.Struct(">IB16s")
_NO_GENERATIONS = bytes(16)


@dataclass(frozen=True, slots=True)
class ApplyResult:
    applied: int
    repeated: int
    last_event_id: int
    gap_at: int | None
    """The first event id of the batch that did not follow ``last_event_id`` (None: no gap)."""


_FENCED = -3
_NOT_PURGED = -4


def record_tip(record: bytes) -> int:
    """The hash a shard keeps of the last record it applied for a worker (its tip): a
    restarted worker compares it with the same event of its own log, to tell a log that
    still holds what the registry applied from one that was replaced or rolled back. (Not
    the CRC-32: that of a record which ends with its own CRC is the same for every record.)"""
    return xxh3_64_intdigest(record)


@dataclass
class _ShardProgress:
    """Where one shard's apply of a batch stands (``_apply_parsed``)."""

    at: int = 0  # position in the batch of the next call to send
    applied: int = 0
    repeated: int = 0
    last: int = -1
    gap: int | None = None
    done: bool = False


class SharedRegistry:
    """One namespace of the shared registry, over a redis-py client (hiredis parses replies).

    ``shards`` splits the block index by sequence hash over that many shards (one hash tag
    each, so Redis Cluster can put them on different masters); it is fixed when the namespace
    is first opened and recorded in it, and None opens it as recorded (1 when nothing is).
    """

    def __init__(
        self,
        client: Client,
        namespace: str,
        *,
        shards: int | None = None,
        lease_ttl_s: float = 10.0,
        stream_maxlen: int = 1_000_000,
        sweep_slice: int = 256,
        events_per_call: int = 512,
        token_ids: bool = True,
    ) -> None:
        keys = KeySpace(namespace)
        if lease_ttl_s <= 0:
            raise ValueError(f"lease_ttl_s must be positive, got {lease_ttl_s}")
        if stream_maxlen < 1:
            raise ValueError(f"stream_maxlen must be at least 1, got {stream_maxlen}")
        if sweep_slice < 0:
            raise ValueError(f"sweep_slice must be 0 or more, got {sweep_slice}")
        if events_per_call < 1:
            raise ValueError(f"events_per_call must be at least 1, got {events_per_call}")
        if shards is not None and not 1 <= shards <= MAX_SHARDS:
            raise ValueError(f"shards must be 1..{MAX_SHARDS}, got {shards}")
        if client.get_connection_kwargs().get("decode_responses"):
            raise ValueError("the shared registry needs a Redis client with decode_responses=False")
        self.client = client
        self.transport = Transport(client, _SCRIPTS)
        """How the registry's script calls and commands reach Redis (``transport.py``)."""
        self.namespace = namespace
        self.keys = keys
        """Shard 0's keys: the namespace's own, as ``KeySpace(namespace)`` names them."""
        self.prefix = keys.prefix
        self.lease_ttl_ms = int(lease_ttl_s * 1000)
        self.stream_maxlen = stream_maxlen
        """About how many events each shard's stream keeps (Redis trims whole nodes of it).
        An entry holds one apply call's events, so the bound in entries follows their recent
        mean size (``events:size``)."""
        self.sweep_slice = sweep_slice
        """Blocks of a running stale-entry sweep each apply cleans (0: only ``sweep`` does)."""
        self.token_ids = token_ids
        """False: stream records of ``Stored`` events go without their token ids."""
        self.events_per_call = events_per_call
        """Events per apply script call; a longer batch is several calls in one pipeline.
        Longer calls touch fewer blocks: a block stored and removed within a call costs one
        read and no write."""
        self.stream_key = keys.stream
        self.workers_key = keys.workers
        self.index_key = keys.index
        self._wanted_shards = shards
        self._shard_keys: list[KeySpace] | None = None
        # read on first use when Redis is down: a publisher started then retries it (a
        # refused login is not an outage: it is reported at once)
        try:
            self._shard_keys = keys.shards(self._recorded_shards(shards))
        except REFUSALS:
            raise
        except (redis.ConnectionError, redis.TimeoutError):
            pass

    @property
    def shard_keys(self) -> list[KeySpace]:
        """Each shard's keys; the first are the namespace's own (``keys``)."""
        if self._shard_keys is None:
            self._shard_keys = self.keys.shards(self._recorded_shards(self._wanted_shards))
        return self._shard_keys

    @property
    def shard_count(self) -> int:
        return len(self.shard_keys)

    @property
    def stream_keys(self) -> list[str]:
        """One stream per shard: a worker's events go to its home shard's (``home_shard``)."""
        return [k.stream for k in self.shard_keys]

    def _recorded_shards(self, wanted: int | None) -> int:
        recorded = self.client.get(self.keys.shard_count)
        if recorded is None:
            if wanted is not None and wanted > 1 and self.client.exists(self.keys.applied):
                raise ValueError(
                    f"namespace {self.namespace!r} holds an unsharded registry; it cannot be "
                    f"split over {wanted} shards in place (rebuild it from the workers' logs "
                    "into a new namespace: docs/shared-registry.md, Sharding)"
                )
            self.client.set(self.keys.shard_count, wanted or 1, nx=True)
            recorded = self.client.get(self.keys.shard_count)
        count = int(recorded or 0)
        if wanted is not None and wanted != count:
            raise ValueError(
                f"namespace {self.namespace!r} is split over {count} shards, not {wanted}: the "
                "shard count is fixed when a namespace is created"
            )
        return count

    def home_shard(self, worker_id: int) -> int:
        """The shard whose stream carries the worker's events (and its purge notices)."""
        return int(worker_id) % self.shard_count

    def shard_of(self, sequence_hash: int) -> int:
        return int(sequence_hash) % self.shard_count

    # -- writing -------------------------------------------------------------------------

    def apply(
        self,
        worker_id: int,
        events: Sequence[AnyEvent],
        *,
        token: int = 0,
        records: Sequence[bytes] | None = None,
    ) -> ApplyResult:
        """Apply one worker's events, in id order, atomically up to the first gap.

        The stream gets each event's log record (``codec.encode``): ``records``, when the
        caller has them (a publisher fed by the log's commits has the bytes the log stored),
        else encoded here. ``token`` is the worker's fencing token (``claim``); 0 writes
        unclaimed, which every shard allows only while nobody has claimed the worker id. A
        shard that holds a newer claim's fence refuses the call (``ClaimLost``).

        A run of consecutive event ids goes out as script calls of up to ``events_per_call``
        events, each cut by shard and sent to every shard (a shard none of whose blocks the
        call touches still moves its applied id), all in one pipeline per node: with one
        server, the next call is packed while Redis runs the one before. Each call is atomic
        in its shard, and one that does not follow the shard's last applied id changes
        nothing, so a call after a gap is refused like the gap itself. Shards move on their
        own: after a failover one may be behind the others, and the result reports the
        shard furthest behind, which is where the caller's log must be read from.
        """
        if not 0 <= worker_id < 1 << 32:
            raise ValueError(f"worker ids must fit in 32 bits, got {worker_id}")
        for event in events:
            if event.worker_id != worker_id:
                raise ValueError(
                    f"event {event.event_id} is from worker {event.worker_id}, not {worker_id}"
                )
        keep = self.token_ids
        if records is None:
            records = [codec.encode(e if keep else without_token_ids(e)) for e in events]
        elif len(records) != len(events):
            raise ValueError(f"{len(events)} events but {len(records)} records")
        elif not keep:  # the log may keep what the shared registry must not
            records = [
                r if getattr(e, "token_ids", None) is None else codec.encode(without_token_ids(e))
                for e, r in zip(events, records, strict=True)
            ]
        parsed = [_parsed(event) for event in events]
        return self._apply_parsed(worker_id, records, parsed, token)

    def apply_records(
        self, worker_id: int, records: Sequence[bytes], *, token: int = 0
    ) -> ApplyResult:
        """``apply`` for log records (``codec.encode``), each checked by decoding it before
        anything is sent, so a damaged one (``CodecError``) or one of another worker
        (``ValueError``) leaves Redis as it was."""
        events = [_transition(codec.decode(record)) for record in records]
        return self.apply(worker_id, events, token=token, records=records)

    def _apply_parsed(
        self, worker_id: int, records: Sequence[bytes], parsed: Sequence[_Parsed], token: int
    ) -> ApplyResult:
        shards = range(self.shard_count)
        if not parsed:  # refreshes the leases and sweeps, like any apply
            every = [(s, 0, 0) for s in shards]
            replies = self._send_applies(worker_id, records, parsed, every, token)
            _check_fence(worker_id, replies)
            return ApplyResult(0, 0, min(last for _, _, last, _ in replies), None)
        progress = [_ShardProgress() for _ in shards]
        while not all(p.done for p in progress):
            plan: list[tuple[int, int, int]] = []  # (shard, first, end) of each call
            cuts: dict[int, list[tuple[int, int]]] = {}  # shards mostly stand at one place
            for shard, p in enumerate(progress):
                if not p.done:
                    if p.at not in cuts:
                        cuts[p.at] = self._cuts(parsed, p.at)
                    plan += [(shard, a, b) for a, b in cuts[p.at]]
            replies = self._send_applies(worker_id, records, parsed, plan, token)
            _check_fence(worker_id, replies)
            stopped: set[int] = set()
            for (shard, a, b), (done, again, last, gap) in zip(plan, replies, strict=True):
                p = progress[shard]
                if shard in stopped:
                    continue  # calls after a refused one changed nothing
                p.applied, p.repeated, p.last = p.applied + done, p.repeated + again, last
                if gap == -2:  # started inside what was applied: send the rest of the run again
                    p.at = a + again
                    stopped.add(shard)
                elif gap != -1:
                    p.gap, p.done = gap, True
                    stopped.add(shard)
                else:
                    p.at = b
            for p in progress:
                p.done = p.done or p.at >= len(parsed)
        gaps = [p.gap for p in progress if p.gap is not None]
        return ApplyResult(
            max(p.applied for p in progress),
            min(p.repeated for p in progress),
            min(p.last for p in progress),
            min(gaps) if gaps else None,
        )

    def _cuts(self, parsed: Sequence[_Parsed], start: int) -> list[tuple[int, int]]:
        """The calls of the run of consecutive ids from ``start``, ``events_per_call`` long."""
        end = start + 1
        while end < len(parsed) and parsed[end][0] == parsed[end - 1][0] + 1:
            end += 1
        cuts = [*range(start, end, self.events_per_call), end]
        return list(itertools.pairwise(cuts))

    def _send_applies(
        self,
        worker_id: int,
        records: Sequence[bytes],
        parsed: Sequence[_Parsed],
        plan: Sequence[tuple[int, int, int]],
        token: int,
    ) -> list[tuple[int, int, int, int]]:
        """One apply script call per (shard, first, end) of the plan, in one pipeline per node;
        their replies in plan order."""
        wid = str(int(worker_id))
        home = self.home_shard(worker_id)
        reduced: dict[tuple[int, int], list[_Changes]] = {}

        def call(shard: int, a: int, b: int) -> list[Arg]:
            if (a, b) not in reduced:
                clears, groups = _net_changes(parsed[a:b])
                reduced[a, b] = [(clears, g) for g in _split_groups(groups, self.shard_count)]
            clears, groups = reduced[a, b][shard]
            tip = record_tip(records[b - 1]) if b > a else 0
            first = parsed[a][0] if b > a else 0
            carried = (pack_stream_entry(records[a:b]),) if shard == home and b > a else ()
            return self._apply_call(
                shard, wid, token, "", tip, first, b - a, clears, groups, carried
            )

        replies = self.transport.run([call(*item) for item in plan])
        return [(int(n), int(again), int(last), int(gap)) for n, again, last, gap in replies]

    def _apply_call(
        self,
        shard: int,
        wid: str,
        token: int,
        mode: str,
        tip: int,
        first: int,
        n: int,
        clears: Sequence[int],
        groups: Sequence[_Group],
        records: Sequence[bytes],
    ) -> list[Arg]:
        """The apply script's call in one shard (``lua/apply.lua`` says what each part is)."""
        k = self.shard_keys[shard]
        keys = [
            k.applied, k.count, k.stream, k.workers, k.lease(wid), k.held, k.index,
            k.generations, k.sweep, k.fence, k.tips, k.stream_size,
        ]  # fmt: skip
        args: list[Arg] = [
            k.prefix, wid, self.stream_maxlen, self.lease_ttl_ms, self.sweep_slice,
            token, mode, tip, first, n, *clears, len(groups),
        ]  # fmt: skip
        for set_mask, clear_mask, count, _blob in groups:
            args += (set_mask, clear_mask, count)
        args += records
        args += [blob for _set, _clear, _count, blob in groups]
        return self.transport.script(lua.APPLY, keys, args)

    # -- one owner per worker id (``claims``) ---------------------------------------------

    def claim(self, worker_id: int, holder: Holder | None = None) -> int:
        """Claim ``worker_id`` for this process and return its fencing token; raises
        ``WorkerIdTaken`` naming the holder when another live process has it.

        The claim lives as long as the lease and is kept by ``heartbeat``. A claim whose
        holder ran on this host and is gone is taken over at once. Every shard's fence is
        raised to the new token before this returns, so from then on the previous holder's
        writes are refused everywhere.
        """
        holder = holder or Holder.this_process()
        wid = str(int(worker_id))
        fences = self.transport.run([self._fence_call(k, wid, 0) for k in self.shard_keys])
        floor = max(int(f) for f in fences) + 1
        k0 = self.keys
        takeover = ""
        while True:
            args: list[Arg] = [wid, holder.to_json(), self.lease_ttl_ms, takeover, floor]
            call = self.transport.script(lua.CLAIM, [k0.claim(wid), k0.tokens], args)
            token, current = self.transport.run([call])[0]
            if int(token):
                break
            held_token, other = Holder.parse(current)
            if other is not None and other.is_gone() and takeover != str(held_token):
                takeover = str(held_token)  # its process is gone: take over, if still its
                continue
            who = other.describe() if other is not None else f"a claim {current!r}"
            raise WorkerIdTaken(
                f"worker id {worker_id} is already taken in namespace {self.namespace!r} by "
                f"{who}; give each worker its own id (worker_id / KVLEDGER_WORKER_ID)"
            )
        self.transport.run([self._fence_call(k, wid, int(token)) for k in self.shard_keys])
        return int(token)

    def _fence_call(self, k: KeySpace, wid: str, token: int) -> list[Arg]:
        return self.transport.script(lua.FENCE, [k.fence], [wid, token])

    def unclaim(self, worker_id: int, token: int) -> None:
        """Give the worker id up (a clean exit), if this token still holds it, so that a
        successor need not wait for the lease to lapse. Entries stay (``release`` drops
        them)."""
        self.transport.run(
            [self.transport.script(lua.UNCLAIM, [self.keys.claim(int(worker_id))], [token])]
        )

    def holder(self, worker_id: int) -> tuple[int, Holder | None] | None:
        """(token, holder) of the live claim of ``worker_id``; None when nobody claims it."""
        current = self.client.get(self.keys.claim(int(worker_id)))
        return None if current is None else Holder.parse(current)

    def heartbeat(self, worker_id: int, token: int = 0, holder: Holder | None = None) -> bool:
        """Refresh the worker's lease (and list it, so its entries are purged when it lapses)
        in every shard, and its claim; False, and nothing refreshed where it was, once a
        newer claim fenced this token off. A claim that lapsed while nobody else took the
        id is taken again."""
        wid = str(int(worker_id))
        described = (holder or Holder.this_process()).to_json() if token else ""
        calls: list[list[Arg]] = []
        for shard, k in enumerate(self.shard_keys):
            keys = [k.fence, k.lease(wid), k.workers] + ([k.claim(wid)] if shard == 0 else [])
            args: list[Arg] = [wid, token, self.lease_ttl_ms, described]
            calls.append(self.transport.script(lua.BEAT, keys, args))
        return all(int(r) for r in self.transport.run(calls))

    def purge_expired(self) -> dict[int, int]:
        """Drop the entries of every worker whose lease lapsed: {worker: entries dropped}.

        With several shards, a worker whose lease still lives in any shard is left alone:
        heartbeats refresh every shard together, so a lease missing from one shard only is
        what a fail-over to a replica that never received the last refresh leaves, and the
        worker's next heartbeat puts it back. Purging it would take a live worker out of the
        routers' view and make it re-send its log from the first event."""
        listed = self.transport.run([("SMEMBERS", k.workers) for k in self.shard_keys])
        candidates = [sorted(int(w) for w in members) for members in listed]
        everyone = sorted({w for workers in candidates for w in workers})
        if self.shard_count > 1 and everyone:
            found = self.transport.run(
                [("EXISTS", k.lease(w)) for k in self.shard_keys for w in everyone]
            )
            pairs = zip(everyone * self.shard_count, found, strict=True)
            alive = {w for w, exists in pairs if exists}
            candidates = [[w for w in workers if w not in alive] for workers in candidates]
        return self._purge_calls(candidates, force=False)

    def release(self, worker_id: int, token: int = 0) -> int:
        """Drop a worker's entries now (clean shutdown, or before a ``reset``); returns how
        many were dropped. ``ClaimLost`` when a newer claim holds the id (nothing dropped)."""
        candidates = [[int(worker_id)] for _ in self.shard_keys]
        return self._purge_calls(candidates, force=True, token=token).get(int(worker_id), 0)

    def _purge_calls(
        self, candidates: Sequence[list[int]], *, force: bool, token: int = 0
    ) -> dict[int, int]:
        """Purge each shard's candidates (all of them with ``force``, else those whose lease
        in that shard is gone); a purge reaches every shard, one atomic call each."""
        calls: list[list[Arg]] = []
        for shard, (k, workers) in enumerate(zip(self.shard_keys, candidates, strict=True)):
            if not workers:
                continue
            keys = [k.workers, k.generations, k.held, k.applied, k.count, k.stream, k.sweep]
            keys += [k.fence] + [k.lease(w) for w in workers]
            flags = ["1" if force else "", self.stream_maxlen, self.shard_count, shard, token]
            calls.append(self.transport.script(lua.PURGE, keys, [k.prefix, *flags, *workers]))
        out: dict[int, int] = {}
        for flat in self.transport.run(calls):
            for i in range(0, len(flat), 2):
                worker, dropped = int(flat[i]), int(flat[i + 1])
                if dropped < 0:
                    raise ClaimLost(
                        f"worker {worker}: a newer claim of the id holds it; its entries were "
                        "left as they are"
                    )
                out[worker] = out.get(worker, 0) + dropped
        return out

    # -- a restart that finds the registry ahead of the log (``reset``) --------------------

    def tips(self, worker_id: int) -> list[tuple[int, int | None]]:
        """Per shard, (the worker's last applied event id, the checksum of that event's record
        or None): what a restarted worker checks against its log."""
        wid = str(int(worker_id))
        calls: list[tuple[str, ...]] = []
        for k in self.shard_keys:
            calls += [("HGET", k.applied, wid), ("HGET", k.tips, wid)]
        raw = self.transport.run(calls)
        return [
            (-1 if applied is None else int(applied), None if tip is None else int(tip))
            for applied, tip in zip(raw[::2], raw[1::2], strict=True)
        ]

    def reset(
        self,
        worker_id: int,
        *,
        last_event_id: int,
        tip: int,
        held: Mapping[Tier, BlockColumns],
        dp_rank: int = 0,
        ts: float = 0.0,
        token: int = 0,
    ) -> int:
        """Replace the worker's entries by ``held`` (its log's fold at ``last_event_id``,
        whose record's checksum is ``tip``): the worker is purged (its stream says so, as for
        a lapsed lease), then each shard takes its part of the fold in one atomic call, with
        ``last_event_id`` as the worker's applied id, and the home shard's stream one
        ``Baseline`` record per tier. Routers see the worker's entries empty or partly back
        only between those calls. Returns the blocks written."""
        wid = str(int(worker_id))
        self.release(worker_id, token)
        tiers = sorted(held)
        records = [
            encode_baseline(
                worker_id=int(worker_id),
                dp_rank=dp_rank,
                tier=tier,
                event_id=last_event_id,
                ts=ts,
                seq=held[tier].seq.tolist(),
                local=held[tier].local.tolist(),
                parent=[
                    p if has else None
                    for p, has in zip(
                        held[tier].parent.tolist(), held[tier].has_parent.tolist(), strict=True
                    )
                ],
            )
            for tier in tiers
        ]
        groups = _split_groups(_held_groups(held), self.shard_count)
        home = self.home_shard(worker_id)
        clears = [0, 0, 0, 0]
        calls = [
            self._apply_call(
                shard, wid, token, "b", tip, last_event_id, 1, clears, groups[shard],
                records if shard == home else (),
            )
            for shard in range(self.shard_count)
        ]  # fmt: skip
        replies = self.transport.run(calls)
        _check_fence(worker_id, [tuple(int(x) for x in r) for r in replies])  # type: ignore[misc]
        for _applied, _repeated, last, gap in replies:
            if int(gap) == _NOT_PURGED:
                raise RuntimeError(
                    f"worker {worker_id}: events up to {int(last)} were applied while its "
                    "entries were being replaced; is another process publishing as it?"
                )
        return sum(len(columns) for columns in held.values())

    def sweep(self, slice_blocks: int = 4096) -> bool:
        """Clean stale entries (left by Cleared and purges) from about ``slice_blocks`` blocks
        of every shard; True while a sweep pass is still running in any. Applies do this a
        slice at a time already."""
        if slice_blocks < 1:
            raise ValueError(f"slice_blocks must be at least 1, got {slice_blocks}")
        calls = [
            self.transport.script(
                lua.SWEEP, [k.index, k.generations, k.sweep], [k.prefix, slice_blocks]
            )
            for k in self.shard_keys
        ]
        return any(bool(running) for _seen, running in self.transport.run(calls))

    # -- reading -------------------------------------------------------------------------

    def who_has(
        self, sequence_hashes: Sequence[int], *, stop_at_miss: bool = False
    ) -> list[dict[int, int]]:
        """Per hash, ``{worker: tier mask}``: one script call per shard that owns one of the
        hashes, in one round trip per node, the nodes asked in parallel.

        With ``stop_at_miss`` the answer ends at the first block nobody holds (a prefix lookup).
        """
        if not sequence_hashes:
            return []
        shard_keys = self.shard_keys
        count = len(shard_keys)  # shard_of, without a call per hash
        positions: dict[int, list[int]] = {}
        if count == 1:
            positions[0] = list(range(len(sequence_hashes)))
        else:
            for position, h in enumerate(sequence_hashes):
                positions.setdefault(int(h) % count, []).append(position)
        calls: list[list[Arg]] = []
        for shard, at in positions.items():
            k = shard_keys[shard]
            keys = [k.index, k.generations, k.sweep]
            args: list[Arg] = [k.prefix]
            args += [hash_key(sequence_hashes[i]) for i in at]
            calls.append(self.transport.read_script(lua.WHO_HAS, keys, args))
        replies = self.transport.run(calls)
        out: list[dict[int, int]] = [{}] * len(sequence_hashes)
        for at, values in zip(positions.values(), replies, strict=True):
            for position, value in zip(at, values, strict=True):
                out[position] = _holders(value)
        if stop_at_miss:
            for position, holders in enumerate(out):
                if not holders:
                    return out[:position]
        return out

    def prefix_depths(self, sequence_hashes: Sequence[int]) -> dict[int, dict[Tier, int]]:
        """Per worker and tier, how many leading blocks of the prefix it holds."""
        return prefix_depths(self.who_has(sequence_hashes, stop_at_miss=True))

    def _per_shard(self, *command: str) -> list[Any]:
        """``command`` with each shard's key named by its first word (an attribute of
        ``KeySpace``) run in every shard; the replies in shard order."""
        attribute, *rest = command[1:]
        return self.transport.run(
            [(command[0], getattr(k, attribute), *rest) for k in self.shard_keys]
        )

    def applied_event_id(self, worker_id: int) -> int:
        """The last event id applied for a worker in every shard (the shard furthest behind),
        -1 when a shard knows nothing of it."""
        raw = self._per_shard("HGET", "applied", str(int(worker_id)))
        return min(-1 if r is None else int(r) for r in raw)

    def applied_count(self, worker_id: int) -> int:
        """Events applied for a worker since it was last purged, in the shard that applied
        most: every shard takes every event, so this equals last id + 1 when no shard ever
        applied an event twice."""
        raw = self._per_shard("HGET", "count", str(int(worker_id)))
        return max(0 if r is None else int(r) for r in raw)

    def held_count(self, worker_id: int, tier: Tier) -> int:
        """How many blocks a worker holds on ``tier`` (kept by the apply; what a purge drops)."""
        raw = self._per_shard("HGET", "held", f"{int(worker_id)}:{int(tier)}")
        return sum(0 if r is None else int(r) for r in raw)

    def workers(self) -> set[int]:
        return {int(w) for members in self._per_shard("SMEMBERS", "workers") for w in members}

    def snapshot(self) -> dict[int, dict[int, int]]:
        """``sequence_hash -> {worker: tier mask}`` for the whole namespace (HSCAN; for checks)."""
        out: dict[int, dict[int, int]] = {}
        for k in self.shard_keys:
            generations: dict[bytes, bytes] = {}
            for worker, stamp in self.client.hgetall(k.generations).items():
                if not isinstance(worker, bytes) or not isinstance(stamp, bytes):
                    raise TypeError("generations must be bytes")  # refused in __init__, as above
                generations[worker] = stamp
            for field, value in self.client.hscan_iter(k.index, count=1000):
                holders = _live_holders(value, generations)
                if holders:
                    out[int.from_bytes(field, "big")] = holders
        return out

    def delete_namespace(self) -> int:
        """Remove every key of this namespace (tests and tear-down); returns keys deleted."""
        deleted = 0
        for k in self.shard_keys:
            keys = list(self.client.scan_iter(match=k.all_keys(), count=1000))
            for chunk in _chunks(keys, 1000):
                self.client.delete(*chunk)
            deleted += len(keys)
        return deleted


_SCRIPTS = (
    lua.APPLY,
    lua.PURGE,
    lua.WHO_HAS,
    lua.SWEEP,
    lua.CLAIM,
    lua.UNCLAIM,
    lua.FENCE,
    lua.BEAT,
)
_Group = tuple[int, int, int, bytes]
"""Blocks a run of events leaves alike: (bits set, bits cleared, how many, their hashes)."""
_Changes = tuple[list[int], list[_Group]]
"""What a run of events leaves behind (``_net_changes``): Cleared count per tier, groups."""


def _split_groups(groups: list[_Group], shards: int) -> list[list[_Group]]:
    """Each shard's part of the groups: the blocks whose sequence hash it owns (hash % shards)."""
    if shards == 1:
        return [groups]
    out: list[list[_Group]] = [[] for _ in range(shards)]
    for set_mask, clear_mask, _count, blob in groups:
        hashes = np.frombuffer(blob, ">u8")
        owner = hashes % np.uint64(shards)
        for shard in np.unique(owner).tolist():
            part = hashes[owner == shard]
            out[shard].append((set_mask, clear_mask, len(part), part.tobytes()))
    return out


def _check_fence(worker_id: int, replies: Sequence[tuple[int, int, int, int]]) -> None:
    """Raise ``ClaimLost`` when a shard refused an apply for a newer claim's fence."""
    if any(gap == _FENCED for _applied, _repeated, _last, gap in replies):
        raise ClaimLost(
            f"worker {worker_id}: another process claimed this worker id; the shared registry "
            "refuses this process's writes"
        )


def _held_groups(held: Mapping[Tier, BlockColumns]) -> list[_Group]:
    """A fold's blocks as apply groups: each block once, with the bits of every tier it is on
    (nothing to clear: the worker was purged just before)."""
    seqs = [columns.seq for columns in held.values()]
    if not seqs or not sum(len(s) for s in seqs):
        return []
    bits = [np.full(len(columns), 1 << (int(tier) - 1), np.int64) for tier, columns in held.items()]
    unique, inverse = np.unique(np.concatenate(seqs), return_inverse=True)
    mask = np.zeros(len(unique), np.int64)
    np.bitwise_or.at(mask, inverse, np.concatenate(bits))
    big_endian = unique.astype(">u8").view(np.uint64)  # the bytes the index keys are
    return [(value, 0, *_blob(big_endian[mask == value])) for value in np.unique(mask).tolist()]


def _holders(value: bytes | str | None) -> dict[int, int]:
    """A block's value as ``who_has`` returns it (stale bits already out) as {worker: mask}."""
    if not value:
        return {}
    if isinstance(value, str):  # only a client decoding replies gives str, refused in __init__
        raise TypeError("block values must be bytes")
    return {worker: mask for worker, mask, _stamp in _STAMPED.iter_unpack(value)}


def _live_holders(value: bytes, generations: dict[bytes, bytes]) -> dict[int, int]:
    """A stored block value (21-byte entries) as {worker: mask}, stale bits left out."""
    out: dict[int, int] = {}
    for worker, mask, stamp in _STAMPED.iter_unpack(value):
        current = generations.get(worker.to_bytes(4, "big"), _NO_GENERATIONS)
        if stamp != current:
            mask &= sum(
                1 << t for t in range(4) if stamp[4 * t : 4 * t + 4] == current[4 * t : 4 * t + 4]
            )
        if mask:
            out[worker] = mask
    return out


_Parsed = tuple[int, int, int, bytes]
"""A checked record as the apply needs it: event id, kind code, tier, packed sequence hashes."""

_REMOVED = KIND_CODES[Removed]
_CLEARED = KIND_CODES[Cleared]


def _parsed(event: AnyEvent) -> _Parsed:
    """What the apply needs of an event: id, kind code, tier, its blocks' packed hashes.

    Dispatched on the exact type, with a compiled ``struct`` per length: this runs for every
    event on the publisher's thread, which competes with the engine's for the interpreter
    (the ``isinstance`` chain and a format string per call cost it twice as much)."""
    cls = type(event)
    try:
        if cls is Stored:
            blocks = event.blocks  # type: ignore[union-attr]
            packed = _packer(len(blocks))(*map(_first, blocks))
        elif cls is Removed:
            hashes = event.sequence_hashes  # type: ignore[union-attr]
            packed = _packer(len(hashes))(*hashes)
        elif cls is Cleared:
            packed = b""
        elif cls is Offloaded or cls is Onboarded:
            blocks = event.blocks  # type: ignore[union-attr]
            packed = _packer(len(blocks))(*map(_sequence_hash, blocks))
        else:
            raise TypeError(f"not an event: {event!r}")
    except struct.error:
        pack_hashes(_hashes_of(event))  # raises the error that names the bad hashes
        raise
    return event.event_id, KIND_CODES[cls], event.tier._value_, packed


def _hashes_of(event: AnyEvent) -> list[int]:
    if isinstance(event, Stored):
        return [seq for seq, _ in event.blocks]
    if isinstance(event, Removed):
        return list(event.sequence_hashes)
    if isinstance(event, Offloaded | Onboarded):
        return [b.sequence_hash for b in event.blocks]
    return []


_first = operator.itemgetter(0)
_sequence_hash = operator.attrgetter("sequence_hash")
_PACKERS: dict[int, Callable[..., bytes]] = {}


def _packer(count: int) -> Callable[..., bytes]:
    """``struct.pack`` of ``count`` big-endian u64s, compiled once per count."""
    packer = _PACKERS.get(count)
    if packer is None:
        packer = _PACKERS[count] = struct.Struct(f">{count}Q").pack
    return packer


def _transition(record: LogRecord) -> AnyEvent:
    if isinstance(record, Lookup | Released | RunInfo):
        raise ValueError(f"a lookup record is not a transition: {record!r}")
    return record


def _net_changes(parsed: Sequence[_Parsed]) -> _Changes:
    """What a run of events leaves behind: Cleared events per tier, and every block it touches
    once, grouped as (bits set, bits cleared, how many blocks, their hashes in one string).

    A block's bit ends as the last change the run made to it; a Cleared drops everything
    before it on its tier (entries stamped with the old generation are stale), so a block
    changed on that tier only before the Cleared ends with the bit cleared. Done with array
    operations per run, not Python operations per block: this runs for every batch on the
    publisher's thread, and a per-block Python version cost a third of what Redis spends.
    """
    clears = [0, 0, 0, 0]
    runs: dict[int, tuple[list[bytes], list[bool], list[int]]] = {}  # tier -> blobs, set, size
    for _event_id, kind, tier, seqs in parsed:
        if kind == _CLEARED:
            clears[tier - 1] += 1
            if tier in runs:
                sets = runs[tier][1]
                sets[:] = [False] * len(sets)
        elif seqs:
            blobs, sets, sizes = runs.setdefault(tier, ([], [], []))
            blobs.append(seqs)
            sets.append(kind != _REMOVED)
            sizes.append(len(seqs) >> 3)
    groups: list[_Group] = []
    touched, codes = [], []
    for tier, (blobs, sets, sizes) in runs.items():
        ids = np.frombuffer(b"".join(blobs), np.uint64)  # native order: only compared
        order = np.argsort(ids)
        ordered = ids[order]
        starts = np.flatnonzero(np.concatenate(([True], ordered[1:] != ordered[:-1])))
        last = np.maximum.reduceat(order, starts)  # where each block changed last
        is_set = np.repeat(np.asarray(sets, dtype=bool), sizes)[last]
        bit = 1 << (tier - 1)
        if len(runs) == 1:
            groups = [(bit, 0, *_blob(ids[last[is_set]])), (0, bit, *_blob(ids[last[~is_set]]))]
        touched.append(ids[last])
        codes.append(np.where(is_set, bit, bit << 4))
    if len(runs) > 1:  # a block changed on several tiers gets one code with every tier's bits
        unique, inverse = np.unique(np.concatenate(touched), return_inverse=True)
        code = np.zeros(len(unique), np.int64)
        np.bitwise_or.at(code, inverse, np.concatenate(codes))
        for value in np.unique(code).tolist():
            groups.append((value & 15, value >> 4, *_blob(unique[code == value])))
    return clears, [group for group in groups if group[2]]


def _blob(blocks: np.ndarray) -> tuple[int, bytes]:
    """How many blocks, and their 8-byte hashes in one string (uint64 views, bytes as read)."""
    return len(blocks), blocks.tobytes()


def _chunks(items: list[bytes], size: int) -> Iterable[list[bytes]]:
    for i in range(0, len(items), size):
        yield items[i : i + size]
