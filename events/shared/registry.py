"""The registry shared by all workers, kept in Redis.

Each worker's events are applied by a Lua script (``lua/apply.lua``, loaded by ``scripts.py``),
so a call is atomic and the per-worker "last applied event id" moves in the same step as the
index: applying events twice changes nothing, and a call that starts past the next expected id
is refused at the gap and the caller fills it from the worker's durable log. The Python side
checks the records and reduces a run of events to what it leaves behind (each touched block
once, with the bits it ends set or cleared, and the Cleared count per tier), so Lua only does
the part that needs the stored values; a long batch goes out as several calls in one pipeline.
The same script appends every applied event to one Redis stream (trimmed approximately), so
routers reading it with a consumer group see each event exactly once, in order per worker. The
stream's record of an event is its durable-log record (``codec.encode``, checksummed): a
publisher fed by the log's commits sends the very bytes the log stored.

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

import contextlib
import hashlib
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
from kvledger.events.wire import encode_baseline, hash_key, pack_hashes
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


_APPLY_KEYS = 11
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
        self.cluster = isinstance(client, redis.RedisCluster)
        self.namespace = namespace
        self.keys = keys
        """Shard 0's keys: the namespace's own, as ``KeySpace(namespace)`` names them."""
        self.prefix = keys.prefix
        self.lease_ttl_ms = int(lease_ttl_s * 1000)
        self.stream_maxlen = stream_maxlen
        self.sweep_slice = sweep_slice
        """Blocks of a running stale-entry sweep each apply cleans (0: only ``sweep`` does)."""
        self.token_ids = token_ids
        """False: stream records of ``Stored`` events go without their token ids."""
        self.events_per_call = events_per_call
        """Events per apply script call; a longer batch is several calls in one pipeline (with
        one server the first of them an eighth of this, so Redis starts on it while the rest
        is packed).
        Longer calls touch fewer blocks: a block stored and removed within a call costs one
        read and no write."""
        self.stream_key = keys.stream
        self.workers_key = keys.workers
        self.index_key = keys.index
        self._sha = {src: hashlib.sha1(src.encode()).hexdigest() for src in _SCRIPTS}
        self._read_eval = "EVALSHA_RO"
        """How ``who_has`` calls its script: read-only (Redis >= 7), so a router whose ACL
        user may only read the namespace's keys can ask (docs/security.md)."""
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
        try:
            return self._apply_parsed(worker_id, records, parsed, token)
        except redis.exceptions.NoScriptError:  # a restarted or flushed Redis: load, send again
            self._load_scripts()
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
        """The calls of the run of consecutive ids from ``start``: ``events_per_call`` long, the
        first one small on a single server, so Redis starts on it early."""
        end = start + 1
        while end < len(parsed) and parsed[end][0] == parsed[end - 1][0] + 1:
            end += 1
        # With one server calls are sent as they are packed; to a cluster they go out together
        first = self.events_per_call if self.cluster else max(1, self.events_per_call // 8)
        cuts = [start, start + first] if end - start > first else [start]
        cuts += range(cuts[-1] + self.events_per_call, end, self.events_per_call)
        cuts.append(end)
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
        sha = self._sha[lua.APPLY]
        reduced: dict[tuple[int, int], list[_Changes]] = {}

        def call(shard: int, a: int, b: int) -> list[bytes | str | int]:
            if (a, b) not in reduced:
                clears, groups = _net_changes(parsed[a:b])
                reduced[a, b] = [(clears, g) for g in _split_groups(groups, self.shard_count)]
            clears, groups = reduced[a, b][shard]
            k = self.shard_keys[shard]
            tip = record_tip(records[b - 1]) if b > a else 0
            args: list[bytes | str | int] = [
                "EVALSHA", sha, _APPLY_KEYS,
                k.applied, k.count, k.stream, k.workers, k.lease(wid), k.held, k.index,
                k.generations, k.sweep, k.fence, k.tips,
                k.prefix, wid, self.stream_maxlen, self.lease_ttl_ms, self.sweep_slice,
                token, "", tip, parsed[a][0] if b > a else 0, b - a, *clears, len(groups),
            ]  # fmt: skip
            for set_mask, clear_mask, count, _blob in groups:
                args += (set_mask, clear_mask, count)
            if shard == home:
                args += records[a:b]
            args += [blob for _set, _clear, _count, blob in groups]
            return args

        calls = (call(*item) for item in plan)
        replies = self._cluster_pipeline(calls) if self.cluster else self._stream_calls(calls)
        return [(int(n), int(again), int(last), int(gap)) for n, again, last, gap in replies]

    def _stream_calls(self, calls: Iterable[Sequence[bytes | str | int]]) -> list[Any]:
        """Send commands to the one server in one pipeline; their replies.

        Packed and sent here rather than through a redis-py pipeline, which packs every call
        before sending any: the first call goes out as soon as it is packed, so Redis runs it
        while the others are packed, and they follow in one write. ``calls`` may be a
        generator: it is read once.
        """
        assert isinstance(self.client, redis.Redis)
        packed = iter(calls)
        pool = self.client.connection_pool
        conn = pool.get_connection()
        sent: list[bytes] = []  # what went out, for a retry on a fresh connection

        def send_and_read() -> list[Any]:
            if not sent:  # the first call at once, so Redis starts on it while the rest is packed
                first = next(packed, None)
                if first is not None:
                    sent.append(b"*%d\r\n" % len(first) + _resp_args(first))
                    conn.send_packed_command(sent)  # type: ignore[no-untyped-call]
                rest = len(sent)
            else:  # a retry on a fresh connection: all of it again
                rest = 0
            sent.extend(b"*%d\r\n" % len(args) + _resp_args(args) for args in packed)
            if len(sent) > rest:
                # the rest in one write: each system call gives the interpreter to the engine's
                # thread, and getting it back can take a whole switch interval (5 ms)
                conn.send_packed_command([b"".join(sent[rest:])])  # type: ignore[no-untyped-call]
            replies, error = [], None
            for _ in sent:  # read every reply, so the connection stays in step
                try:
                    replies.append(conn.read_response())
                except redis.ResponseError as exc:
                    error = error or exc
            if error is not None:
                raise error
            return replies

        try:
            return conn.retry.call_with_retry(
                send_and_read,
                lambda _error: conn.disconnect(),  # type: ignore[no-untyped-call]
            )
        finally:
            pool.release(conn)

    def _cluster_pipeline(self, calls: Iterable[Sequence[bytes | str | int]]) -> list[Any]:
        """Send script calls to a cluster, one pipeline per node, the nodes in parallel.

        First straight to the nodes that redis-py's slot map names, each call sent as soon as
        it is packed (redis-py's cluster pipeline packs everything first and costs ~0.3 ms of
        Python per execute here, more than a who_has takes in Redis); on any trouble (MOVED,
        ASK, TRYAGAIN, a node gone) all of them again through that pipeline, which follows
        redirections and refreshes the map. Sending again is safe: applies are idempotent and
        the other scripts read, or purge what is already purged.
        """
        listed: list[Sequence[bytes | str | int]] = []
        pending = iter(calls)
        try:
            return self._straight_to_nodes(pending, listed)
        except redis.exceptions.NoScriptError:
            raise
        except redis.RedisError as exc:
            listed += pending  # and what was not taken yet
            if isinstance(exc, redis.ConnectionError | redis.TimeoutError):
                # A node is gone (a fail-over): learn the slot map anew and go straight again.
                # redis-py's pipeline would not: it asks a script's keys of its default node
                # (COMMAND GETKEYS) before it routes, and fails there while that node is down.
                self._refresh_slots()
                try:
                    return self._straight_to_nodes(iter(listed), [])
                except (redis.ConnectionError, redis.TimeoutError, redis.exceptions.NoScriptError):
                    raise  # still down: the caller tries again later
                except redis.RedisError:
                    pass
            pipe = self.client.pipeline()
            for args in listed:
                pipe.execute_command(*args)
            return list(pipe.execute())

    def _refresh_slots(self) -> None:
        assert isinstance(self.client, redis.RedisCluster)
        with contextlib.suppress(redis.RedisError):
            self.client.nodes_manager.initialize()
            self.client.replace_default_node()

    def _straight_to_nodes(
        self, calls: Iterable[Sequence[bytes | str | int]], listed: list[Sequence[Any]]
    ) -> list[Any]:
        """Commands (EVALSHA calls, routed by their first key, and single-key commands), each
        written to its node as soon as it is packed, then every reply read; ``listed`` gets
        each command as it is taken from ``calls``."""
        assert isinstance(self.client, redis.RedisCluster)
        opened: dict[str, tuple[Any, Any, list[int]]] = {}  # node -> pool, connection, calls
        finished: set[str] = set()  # nodes whose replies were all read
        try:
            for args in calls:
                listed.append(args)
                key = args[3 if args[0] in ("EVALSHA", "EVALSHA_RO") else 1]
                node = self.client.get_node_from_key(key)  # type: ignore[no-untyped-call]
                if node.name not in opened:
                    pool = self.client.get_redis_connection(node).connection_pool
                    opened[node.name] = (pool, pool.get_connection(), [])
                _pool, conn, positions = opened[node.name]
                positions.append(len(listed) - 1)
                packed = b"*%d\r\n" % len(args) + _resp_args(args)
                conn.send_packed_command([packed])
            replies: list[Any] = [None] * len(listed)
            for name, (_pool, conn, positions) in opened.items():
                errors = []
                for p in positions:
                    try:
                        replies[p] = conn.read_response()
                    except redis.ResponseError as exc:
                        errors.append(exc)
                finished.add(name)
                if errors:
                    raise errors[0]
        finally:
            for name, (pool, conn, _positions) in opened.items():
                if name not in finished:
                    conn.disconnect()  # replies left unread: never reuse it
                pool.release(conn)
        return replies

    def _pipeline(self, calls: Iterable[Sequence[bytes | str | int]]) -> list[Any]:
        if self.cluster:
            return self._cluster_pipeline(calls)
        pipe = self.client.pipeline(transaction=False)
        for args in calls:
            pipe.execute_command(*args)
        return list(pipe.execute())

    def _scripted(self, calls: Sequence[Sequence[bytes | str | int]]) -> list[Any]:
        """``_pipeline`` for script calls: loads the scripts where a server lacks them."""
        try:
            return self._pipeline(calls)
        except redis.exceptions.NoScriptError:
            self._load_scripts()
            return self._pipeline(calls)

    def _load_scripts(self) -> None:
        for src in _SCRIPTS:  # a cluster client sends SCRIPT LOAD to every master
            self.client.script_load(src)

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
        fences = self._scripted([self._fence_call(k, wid, 0) for k in self.shard_keys])
        floor = max(int(f) for f in fences) + 1
        k0 = self.keys
        takeover = ""
        while True:
            token, current = self._scripted(
                [
                    [
                        "EVALSHA", self._sha[lua.CLAIM], 2, k0.claim(wid), k0.tokens,
                        wid, holder.to_json(), self.lease_ttl_ms, takeover, floor,
                    ]
                ]
            )[0]  # fmt: skip
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
        self._scripted([self._fence_call(k, wid, int(token)) for k in self.shard_keys])
        return int(token)

    def _fence_call(self, k: KeySpace, wid: str, token: int) -> list[bytes | str | int]:
        return ["EVALSHA", self._sha[lua.FENCE], 1, k.fence, wid, token]

    def unclaim(self, worker_id: int, token: int) -> None:
        """Give the worker id up (a clean exit), if this token still holds it, so that a
        successor need not wait for the lease to lapse. Entries stay (``release`` drops
        them)."""
        self._scripted(
            [["EVALSHA", self._sha[lua.UNCLAIM], 1, self.keys.claim(int(worker_id)), token]]
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
        calls: list[list[bytes | str | int]] = []
        for shard, k in enumerate(self.shard_keys):
            keys = [k.fence, k.lease(wid), k.workers] + ([k.claim(wid)] if shard == 0 else [])
            args: list[bytes | str | int] = [wid, token, self.lease_ttl_ms, described]
            calls.append(["EVALSHA", self._sha[lua.BEAT], len(keys), *keys, *args])
        return all(int(r) for r in self._scripted(calls))

    def purge_expired(self) -> dict[int, int]:
        """Drop the entries of every worker whose lease lapsed: {worker: entries dropped}."""
        listed = self._pipeline([("SMEMBERS", k.workers) for k in self.shard_keys])
        candidates = [sorted(int(w) for w in members) for members in listed]
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
        sha = self._sha[lua.PURGE]
        calls: list[list[bytes | str | int]] = []
        for shard, (k, workers) in enumerate(zip(self.shard_keys, candidates, strict=True)):
            if not workers:
                continue
            keys = [k.workers, k.generations, k.held, k.applied, k.count, k.stream, k.sweep]
            keys += [k.fence] + [k.lease(w) for w in workers]
            flags = ["1" if force else "", self.stream_maxlen, self.shard_count, shard, token]
            calls.append(["EVALSHA", sha, len(keys), *keys, k.prefix, *flags, *workers])
        out: dict[int, int] = {}
        for flat in self._scripted(calls):
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
        raw = self._pipeline(calls)
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
        sha = self._sha[lua.APPLY]
        calls: list[list[bytes | str | int]] = []
        for shard, k in enumerate(self.shard_keys):
            args: list[bytes | str | int] = [
                "EVALSHA", sha, _APPLY_KEYS,
                k.applied, k.count, k.stream, k.workers, k.lease(wid), k.held, k.index,
                k.generations, k.sweep, k.fence, k.tips,
                k.prefix, wid, self.stream_maxlen, self.lease_ttl_ms, self.sweep_slice,
                token, "b", tip, last_event_id, 1, 0, 0, 0, 0, len(groups[shard]),
            ]  # fmt: skip
            for set_mask, clear_mask, count, _blob in groups[shard]:
                args += (set_mask, clear_mask, count)
            if shard == home:
                args += records
            args += [blob for _set, _clear, _count, blob in groups[shard]]
            calls.append(args)
        replies = self._scripted(calls)
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
        sha = self._sha[lua.SWEEP]
        calls: list[list[bytes | str | int]] = [
            ["EVALSHA", sha, 3, k.index, k.generations, k.sweep, k.prefix, slice_blocks]
            for k in self.shard_keys
        ]
        return any(bool(running) for _seen, running in self._scripted(calls))

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
        sha = self._sha[lua.WHO_HAS]
        positions: dict[int, list[int]] = {}
        for position, h in enumerate(sequence_hashes):
            positions.setdefault(self.shard_of(h), []).append(position)
        calls: list[list[bytes | str | int]] = []
        for shard, at in positions.items():
            k = self.shard_keys[shard]
            keys = [hash_key(sequence_hashes[i]) for i in at]
            calls.append(
                [self._read_eval, sha, 3, k.index, k.generations, k.sweep, k.prefix, *keys]
            )
        try:
            replies = self._read_calls(calls)
        except redis.ResponseError as exc:
            if self._read_eval == "EVALSHA" or "unknown command" not in str(exc).lower():
                raise
            self._read_eval = "EVALSHA"  # a Redis before 7.0: no read-only script calls
            for call in calls:
                call[0] = "EVALSHA"
            replies = self._read_calls(calls)
        out: list[dict[int, int]] = [{}] * len(sequence_hashes)
        for at, values in zip(positions.values(), replies, strict=True):
            for position, value in zip(at, values, strict=True):
                out[position] = _holders(value)
        if stop_at_miss:
            for position, holders in enumerate(out):
                if not holders:
                    return out[:position]
        return out

    def _read_calls(self, calls: Sequence[Sequence[bytes | str | int]]) -> list[Any]:
        if len(calls) == 1 and not self.cluster:
            # one server, one shard: the call itself (a pipeline costs ~30 us a call here)
            try:
                return [self.client.execute_command(*calls[0])]  # type: ignore[no-untyped-call]
            except redis.exceptions.NoScriptError:
                self._load_scripts()
                return [self.client.execute_command(*calls[0])]  # type: ignore[no-untyped-call]
        return self._scripted(calls)

    def prefix_depths(self, sequence_hashes: Sequence[int]) -> dict[int, dict[Tier, int]]:
        """Per worker and tier, how many leading blocks of the prefix it holds."""
        return prefix_depths(self.who_has(sequence_hashes, stop_at_miss=True))

    def _per_shard(self, *command: str) -> list[Any]:
        """``command`` with each shard's key named by its first word (an attribute of
        ``KeySpace``) run in every shard; the replies in shard order."""
        attribute, *rest = command[1:]
        return self._pipeline([(command[0], getattr(k, attribute), *rest) for k in self.shard_keys])

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


def _resp_args(args: Sequence[bytes | str | int]) -> bytes:
    """Arguments in the Redis protocol, without the array header."""
    out = []
    for arg in args:
        data = arg if isinstance(arg, bytes) else str(arg).encode()
        out.append(b"$%d\r\n%s\r\n" % (len(data), data))
    return b"".join(out)


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
