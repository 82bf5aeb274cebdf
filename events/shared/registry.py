"""The registry shared by all workers, kept in Redis.

Each worker's events are applied by a Lua script (``lua/apply.lua``, loaded by ``scripts.py``),
so a call is atomic and the per-worker "last applied event id" moves in the same step as the
index: applying events twice changes nothing, and a call that starts past the next expected id
is refused at the gap and the caller fills it from the worker's durable log. The Python side
checks the records and reduces a run of events to what it leaves behind (each touched block
once, with the bits it ends set or cleared, and the Cleared count per tier), so Lua only does
the part that needs the stored values; a long batch goes out as several calls in one pipeline.
The same script appends every applied event to one Redis stream (trimmed approximately), so
routers reading it with a consumer group see each event exactly once, in order per worker.

Keys, all under ``kvl:{<namespace>}:`` and named by ``keys.KeySpace`` (the braces are a hash
tag: Redis Cluster keeps a whole namespace on one slot, which the scripts need because they
touch keys they derive):

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
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import msgpack
import numpy as np
import redis

from kvledger.events.codec import KIND_CODES
from kvledger.events.shared import scripts as lua
from kvledger.events.shared.keys import KeySpace
from kvledger.events.types import AnyEvent, Cleared, Removed, Tier
from kvledger.events.wire import (
    KIND_OF_CODE,
    STREAM_RECORD_VERSION,
    WireFormatError,
    encode_record,
    hash_key,
)
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


class SharedRegistry:
    """One namespace of the shared registry, over a redis-py client (hiredis parses replies)."""

    def __init__(
        self,
        client: redis.Redis,
        namespace: str,
        *,
        lease_ttl_s: float = 10.0,
        stream_maxlen: int = 1_000_000,
        sweep_slice: int = 256,
        events_per_call: int = 512,
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
        if client.get_connection_kwargs().get("decode_responses"):
            raise ValueError("the shared registry needs a Redis client with decode_responses=False")
        self.client = client
        self.namespace = namespace
        self.keys = keys
        self.prefix = keys.prefix
        self.lease_ttl_ms = int(lease_ttl_s * 1000)
        self.stream_maxlen = stream_maxlen
        self.sweep_slice = sweep_slice
        """Blocks of a running stale-entry sweep each apply cleans (0: only ``sweep`` does)."""
        self.events_per_call = events_per_call
        """Events per apply script call; a longer batch is several calls in one pipeline, the
        first of them an eighth of this (so Redis starts on it while the rest is packed).
        Longer calls touch fewer blocks: a block stored and removed within a call costs one
        read and no write."""
        self.stream_key = keys.stream
        self.workers_key = keys.workers
        self.index_key = keys.index
        self._apply = client.register_script(lua.APPLY)
        self._purge = client.register_script(lua.PURGE)
        self._who_has = client.register_script(lua.WHO_HAS)
        self._sweep = client.register_script(lua.SWEEP)

    # -- writing -------------------------------------------------------------------------

    def apply(self, worker_id: int, events: Sequence[AnyEvent]) -> ApplyResult:
        """Apply one worker's events, in id order, atomically up to the first gap."""
        for event in events:
            if event.worker_id != worker_id:
                raise ValueError(
                    f"event {event.event_id} is from worker {event.worker_id}, not {worker_id}"
                )
        return self.apply_records(worker_id, [encode_record(e) for e in events])

    def apply_records(self, worker_id: int, records: Sequence[bytes]) -> ApplyResult:
        """``apply`` for records already encoded with ``wire.encode_record``.

        Every record is checked here before anything is sent, so a malformed one
        (``WireFormatError``) or one of another worker (``ValueError``) leaves Redis as it was.
        A run of consecutive event ids goes out as script calls of up to ``events_per_call``
        events, all in one pipeline: the next call is packed while Redis runs the one before.
        Each call is atomic, and one that does not follow the last applied id changes nothing,
        so a call after a gap is refused like the gap itself.
        """
        if not 0 <= worker_id < 1 << 32:
            raise ValueError(f"worker ids must fit in 32 bits, got {worker_id}")
        parsed = [_parse_record(worker_id, record) for record in records]
        try:
            return self._apply_parsed(worker_id, records, parsed)
        except redis.exceptions.NoScriptError:  # a restarted or flushed Redis: load, send again
            self.client.script_load(lua.APPLY)
            return self._apply_parsed(worker_id, records, parsed)

    def _apply_parsed(
        self, worker_id: int, records: Sequence[bytes], parsed: Sequence[_Parsed]
    ) -> ApplyResult:
        if not parsed:  # refreshes the lease and sweeps, like any apply
            ((_, _, last, _),) = self._call(worker_id, [([], [])])
            return ApplyResult(0, 0, last, None)
        applied = repeated = 0
        last, start = -1, 0
        while start < len(parsed):
            end = start + 1
            while end < len(parsed) and parsed[end][0] == parsed[end - 1][0] + 1:
                end += 1
            first = max(1, self.events_per_call // 8)  # small, so Redis starts on it early
            cuts = [start, start + first] if end - start > first else [start]
            cuts += range(cuts[-1] + self.events_per_call, end, self.events_per_call)
            cuts.append(end)
            calls = [(records[a:b], parsed[a:b]) for a, b in itertools.pairwise(cuts)]
            at = start
            for (done, again, last, gap), (call_records, _) in zip(
                self._call(worker_id, calls), calls, strict=True
            ):
                applied, repeated = applied + done, repeated + again
                if gap == -2:  # started inside what was applied: send the rest of the run again
                    end = at + again
                    break
                if gap != -1:
                    return ApplyResult(applied, repeated, last, gap)
                at += len(call_records)
            start = end
        return ApplyResult(applied, repeated, last, None)

    def _call(
        self, worker_id: int, calls: Sequence[tuple[Sequence[bytes], Sequence[_Parsed]]]
    ) -> list[tuple[int, int, int, int]]:
        """Send one apply script call per (records, parsed) in one pipeline; their replies.

        Packed and sent here rather than through a redis-py pipeline, which packs every call
        before sending any: sending each call as soon as it is packed lets Redis run it while
        the next one is packed.
        """
        wid = str(int(worker_id))
        head = _resp_args(
            [
                b"EVALSHA",
                self._apply.sha,
                7,
                self.keys.applied,
                self.keys.count,
                self.stream_key,
                self.workers_key,
                self.keys.lease(wid),
                self.keys.held,
                self.index_key,
                self.prefix,
                wid,
                self.stream_maxlen,
                self.lease_ttl_ms,
                self.sweep_slice,
            ]
        )
        pool = self.client.connection_pool
        conn = pool.get_connection()

        def send_and_read() -> list[tuple[int, int, int, int]]:
            for records, parsed in calls:
                clears, groups = _net_changes(parsed)
                small: list[bytes | str | int] = [
                    parsed[0][0] if parsed else 0,
                    len(records),
                    *clears,
                    len(groups),
                ]
                for set_mask, clear_mask, count, _blob in groups:
                    small += (set_mask, clear_mask, count)
                parts = [b"*%d\r\n" % (15 + len(small) + len(records) + len(groups)), head]
                parts.append(_resp_args(small))
                parts.append(_resp_args(records))
                parts.append(_resp_args([blob for _set, _clear, _count, blob in groups]))
                conn.send_packed_command(parts)  # type: ignore[no-untyped-call]
            replies, error = [], None
            for _ in calls:  # read every reply, so the connection stays in step
                try:
                    applied, repeated, last, gap = conn.read_response()
                    replies.append((int(applied), int(repeated), int(last), int(gap)))
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

    def heartbeat(self, worker_id: int) -> None:
        """Refresh the worker's lease (and list it, so its entries are purged when it lapses)."""
        wid = str(int(worker_id))
        pipe = self.client.pipeline(transaction=True)
        pipe.set(self.keys.lease(wid), "1", px=self.lease_ttl_ms)
        pipe.sadd(self.workers_key, wid)
        pipe.execute()

    def purge_expired(self) -> dict[int, int]:
        """Drop the entries of every worker whose lease lapsed: {worker: entries dropped}."""
        return self._purge_call("")

    def release(self, worker_id: int) -> int:
        """Drop a worker's entries now (clean shutdown); returns how many were dropped."""
        return self._purge_call(str(int(worker_id))).get(int(worker_id), 0)

    def _purge_call(self, target: str) -> dict[int, int]:
        flat = self._purge(keys=[self.workers_key], args=[self.prefix, target, self.stream_maxlen])
        return {int(flat[i]): int(flat[i + 1]) for i in range(0, len(flat), 2)}

    def sweep(self, slice_blocks: int = 4096) -> bool:
        """Clean stale entries (left by Cleared and purges) from about ``slice_blocks`` blocks;
        True while a sweep pass is still running. Applies do this a slice at a time already."""
        if slice_blocks < 1:
            raise ValueError(f"slice_blocks must be at least 1, got {slice_blocks}")
        _seen, running = self._sweep(keys=[self.index_key], args=[self.prefix, slice_blocks])
        return bool(running)

    # -- reading -------------------------------------------------------------------------

    def who_has(
        self, sequence_hashes: Sequence[int], *, stop_at_miss: bool = False
    ) -> list[dict[int, int]]:
        """Per hash, ``{worker: tier mask}``, in one round trip.

        With ``stop_at_miss`` the answer ends at the first block nobody holds (a prefix lookup).
        """
        if not sequence_hashes:
            return []
        args: list[bytes | str] = [self.index_key, self.prefix, *map(hash_key, sequence_hashes)]
        try:  # EVALSHA itself: redis-py's Script wrapper costs ~30 us a call here
            values = self.client.evalsha(self._who_has.sha, 1, *args)
        except redis.exceptions.NoScriptError:
            self.client.script_load(lua.WHO_HAS)
            values = self.client.evalsha(self._who_has.sha, 1, *args)
        out = [_holders(v) for v in values]
        if stop_at_miss:
            for position, holders in enumerate(out):
                if not holders:
                    return out[:position]
        return out

    def prefix_depths(self, sequence_hashes: Sequence[int]) -> dict[int, dict[Tier, int]]:
        """Per worker and tier, how many leading blocks of the prefix it holds."""
        return prefix_depths(self.who_has(sequence_hashes, stop_at_miss=True))

    def applied_event_id(self, worker_id: int) -> int:
        """The last event id applied for a worker, -1 when Redis knows nothing of it."""
        raw = self.client.hget(self.keys.applied, str(int(worker_id)))
        return -1 if raw is None else int(raw)

    def applied_count(self, worker_id: int) -> int:
        """Events applied for a worker since it was last purged (equals last id + 1 when no
        event was ever applied twice)."""
        raw = self.client.hget(self.keys.count, str(int(worker_id)))
        return 0 if raw is None else int(raw)

    def held_count(self, worker_id: int, tier: Tier) -> int:
        """How many blocks a worker holds on ``tier`` (kept by the apply; what a purge drops)."""
        raw = self.client.hget(self.keys.held, f"{int(worker_id)}:{int(tier)}")
        return 0 if raw is None else int(raw)

    def workers(self) -> set[int]:
        return {int(w) for w in self.client.smembers(self.workers_key)}

    def snapshot(self) -> dict[int, dict[int, int]]:
        """``sequence_hash -> {worker: tier mask}`` for the whole namespace (HSCAN; for checks)."""
        generations: dict[bytes, bytes] = {}
        for worker, stamp in self.client.hgetall(self.keys.generations).items():
            if not isinstance(worker, bytes) or not isinstance(stamp, bytes):
                raise TypeError("generations must be bytes")  # refused in __init__, as above
            generations[worker] = stamp
        out: dict[int, dict[int, int]] = {}
        for field, value in self.client.hscan_iter(self.index_key, count=1000):
            holders = _live_holders(value, generations)
            if holders:
                out[int.from_bytes(field, "big")] = holders
        return out

    def delete_namespace(self) -> int:
        """Remove every key of this namespace (tests and tear-down); returns keys deleted."""
        keys = list(self.client.scan_iter(match=self.keys.all_keys(), count=1000))
        for chunk in _chunks(keys, 1000):
            self.client.delete(*chunk)
        return len(keys)


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


def _parse_record(worker_id: int, record: bytes) -> _Parsed:
    """The fields of a stream record the index needs, after the checks the script relies on."""
    try:
        fields = msgpack.unpackb(record, raw=True, use_list=False)
    except (ValueError, msgpack.UnpackException) as exc:
        raise WireFormatError(f"stream record is not msgpack: {exc}") from None
    if not isinstance(fields, tuple) or len(fields) != 9:
        raise WireFormatError("a stream record is a 9-item array")
    version, kind, event_id, worker, _dp_rank, tier, _ts, seqs, _body = fields
    if version != STREAM_RECORD_VERSION:
        raise WireFormatError(f"stream record version {version!r}; this reader knows 1")
    if worker != worker_id:
        raise ValueError(f"record of worker {worker!r} sent as worker {worker_id}")
    if kind not in KIND_OF_CODE:
        raise WireFormatError(f"unknown event kind {kind!r}")
    if tier not in (1, 2, 3, 4):
        raise WireFormatError(f"unknown tier {tier!r}")
    if not isinstance(event_id, int) or event_id < 0:
        raise WireFormatError(f"event id {event_id!r} is not a non-negative integer")
    if not isinstance(seqs, bytes) or len(seqs) % 8:
        raise WireFormatError(f"event {event_id}: hash blob is not whole 8-byte hashes")
    return event_id, kind, tier, seqs


def _net_changes(parsed: Sequence[_Parsed]) -> tuple[list[int], list[tuple[int, int, int, bytes]]]:
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
    groups: list[tuple[int, int, int, bytes]] = []
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
