"""The registry shared by all workers, kept in Redis.

Each worker's events are applied by one Lua script per batch, so a batch is atomic and the
per-worker "last applied event id" moves in the same step as the index: applying a batch twice
changes nothing, and a batch that starts past the next expected id is refused at the gap and the
caller fills it from the worker's durable log. The same script appends every applied event to one
Redis stream (trimmed approximately), so routers reading it with a consumer group see each event
exactly once, in order per worker.

Keys, all under ``kvl:{<namespace>}:`` (the braces are a hash tag: Redis Cluster keeps a whole
namespace on one slot, which the scripts need because they touch keys they derive):

- ``b:<8-byte sequence hash>``  hash  worker id -> tier mask (G1=1, G2=2, G3=4, G4=8)
- ``w:<worker>:<tier>``         set   the worker's sequence hashes on that tier (Cleared, purge)
- ``applied`` / ``count``       hash  worker id -> last applied event id / events applied
- ``lease:<worker>``            string with a TTL; refreshed by every apply and by heartbeats
- ``workers``                   set   workers that may hold entries (swept by ``purge_expired``)
- ``events``                    stream of applied records (fields ``w`` worker, ``r`` record)
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import redis

from kvledger.events.types import AnyEvent, Tier
from kvledger.events.wire import encode_record, hash_key
from kvledger.registry.index import prefix_depths

_NAMESPACE = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")

# Shared by the scripts: drop one worker's bit for one tier from a block, then the worker's
# field when no tier is left.
_LUA_DROP = """
local function drop(prefix, wid, s, b)
  local k = prefix .. 'b:' .. s
  local m = redis.call('HGET', k, wid)
  if m then
    local left = bit.band(tonumber(m), bit.bnot(b))
    if left == 0 then redis.call('HDEL', k, wid) else redis.call('HSET', k, wid, left) end
  end
end
local function purge(prefix, wid)
  local n = 0
  for tier = 1, 4 do
    local wset = prefix .. 'w:' .. wid .. ':' .. tier
    for _, s in ipairs(redis.call('SMEMBERS', wset)) do
      redis.call('HDEL', prefix .. 'b:' .. s, wid)
      n = n + 1
    end
    redis.call('DEL', wset)
  end
  redis.call('HDEL', prefix .. 'applied', wid)
  redis.call('HDEL', prefix .. 'count', wid)
  redis.call('SREM', prefix .. 'workers', wid)
  redis.call('DEL', prefix .. 'lease:' .. wid)
  redis.call('XADD', prefix .. 'events', 'MAXLEN', '~', ARGV[3], '*', 'w', wid, 'purged', n)
  return n
end
"""

# KEYS: applied, count, events, workers, lease
# ARGV: prefix, worker id, stream maxlen, lease ttl ms, record...
# Returns {applied, repeated, last applied id, id at which a gap was found or -1}.
_LUA_APPLY = (
    _LUA_DROP
    + """
local prefix, wid, maxlen = ARGV[1], ARGV[2], ARGV[3]
local ttl = tonumber(ARGV[4])
local wnum = tonumber(wid)
local last = tonumber(redis.call('HGET', KEYS[1], wid) or '-1')
local applied, repeated, gap = 0, 0, -1
for i = 5, #ARGV do
  local rec = cmsgpack.unpack(ARGV[i])
  local eid = rec[3]
  if rec[4] ~= wnum then
    return redis.error_reply('record of worker ' .. tostring(rec[4]) .. ' sent as worker ' .. wid)
  end
  if eid <= last then
    repeated = repeated + 1
  elseif eid ~= last + 1 then
    gap = eid
    break
  else
    local kind, tier, seqs = rec[2], rec[6], rec[8]
    local b = bit.lshift(1, tier - 1)
    local wset = prefix .. 'w:' .. wid .. ':' .. tier
    if kind == 1 or kind == 3 or kind == 4 then
      local members = {}
      for p = 1, #seqs, 8 do
        local s = string.sub(seqs, p, p + 7)
        local k = prefix .. 'b:' .. s
        local m = redis.call('HGET', k, wid)
        redis.call('HSET', k, wid, bit.bor(tonumber(m or '0'), b))
        members[#members + 1] = s
        if #members == 512 then
          redis.call('SADD', wset, unpack(members))
          members = {}
        end
      end
      if #members > 0 then redis.call('SADD', wset, unpack(members)) end
    elseif kind == 2 then
      for p = 1, #seqs, 8 do
        local s = string.sub(seqs, p, p + 7)
        drop(prefix, wid, s, b)
        redis.call('SREM', wset, s)
      end
    elseif kind == 5 then
      for _, s in ipairs(redis.call('SMEMBERS', wset)) do drop(prefix, wid, s, b) end
      redis.call('DEL', wset)
    else
      return redis.error_reply('unknown event kind ' .. tostring(kind))
    end
    redis.call('XADD', KEYS[3], 'MAXLEN', '~', maxlen, '*', 'w', wid, 'r', ARGV[i])
    last = eid
    applied = applied + 1
  end
end
if applied > 0 then
  redis.call('HSET', KEYS[1], wid, last)
  redis.call('HINCRBY', KEYS[2], wid, applied)
end
if ttl > 0 then
  redis.call('SET', KEYS[5], '1', 'PX', ttl)
  redis.call('SADD', KEYS[4], wid)
end
return {applied, repeated, last, gap}
"""
)

# KEYS: workers. ARGV: prefix, worker id ('' = every worker whose lease is gone), maxlen.
# Returns the purged workers and how many entries each lost, flattened.
_LUA_PURGE = (
    _LUA_DROP
    + """
local prefix = ARGV[1]
local out = {}
local targets
if ARGV[2] ~= '' then targets = {ARGV[2]} else targets = redis.call('SMEMBERS', KEYS[1]) end
for _, wid in ipairs(targets) do
  if ARGV[2] ~= '' or redis.call('EXISTS', prefix .. 'lease:' .. wid) == 0 then
    out[#out + 1] = wid
    out[#out + 1] = purge(prefix, wid)
  end
end
return out
"""
)

# KEYS: workers (slot routing only). ARGV: prefix, stop at first miss (1/0), hash...
# Returns one flat [worker, mask, ...] list per hash (up to the first miss when asked).
_LUA_WHO_HAS = """
local prefix, stop = ARGV[1], ARGV[2] == '1'
local out = {}
for i = 3, #ARGV do
  local fields = redis.call('HGETALL', prefix .. 'b:' .. ARGV[i])
  if stop and #fields == 0 then break end
  out[#out + 1] = fields
end
return out
"""


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
    ) -> None:
        if not _NAMESPACE.match(namespace):
            raise ValueError(
                f"namespace {namespace!r} must be 1-64 characters of letters, digits, '_', '.', '-'"
            )
        if lease_ttl_s <= 0:
            raise ValueError(f"lease_ttl_s must be positive, got {lease_ttl_s}")
        if stream_maxlen < 1:
            raise ValueError(f"stream_maxlen must be at least 1, got {stream_maxlen}")
        if client.get_connection_kwargs().get("decode_responses"):
            raise ValueError("the shared registry needs a Redis client with decode_responses=False")
        self.client = client
        self.namespace = namespace
        self.prefix = f"kvl:{{{namespace}}}:"
        self.lease_ttl_ms = int(lease_ttl_s * 1000)
        self.stream_maxlen = stream_maxlen
        self.stream_key = self.prefix + "events"
        self.workers_key = self.prefix + "workers"
        self._apply = client.register_script(_LUA_APPLY)
        self._purge = client.register_script(_LUA_PURGE)
        self._who_has = client.register_script(_LUA_WHO_HAS)

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
        """``apply`` for records already encoded with ``wire.encode_record``."""
        wid = str(int(worker_id))
        keys = [
            self.prefix + "applied",
            self.prefix + "count",
            self.stream_key,
            self.workers_key,
            self.prefix + "lease:" + wid,
        ]
        args: list[bytes | str | int] = [
            self.prefix,
            wid,
            self.stream_maxlen,
            self.lease_ttl_ms,
            *records,
        ]
        applied, repeated, last, gap = self._apply(keys=keys, args=args)
        return ApplyResult(int(applied), int(repeated), int(last), None if gap == -1 else int(gap))

    def heartbeat(self, worker_id: int) -> None:
        """Refresh the worker's lease (and list it, so its entries are purged when it lapses)."""
        wid = str(int(worker_id))
        pipe = self.client.pipeline(transaction=True)
        pipe.set(self.prefix + "lease:" + wid, "1", px=self.lease_ttl_ms)
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

    # -- reading -------------------------------------------------------------------------

    def who_has(
        self, sequence_hashes: Sequence[int], *, stop_at_miss: bool = False
    ) -> list[dict[int, int]]:
        """Per hash, ``{worker: tier mask}``, in one round trip.

        With ``stop_at_miss`` the answer ends at the first block nobody holds (a prefix lookup).
        """
        args: list[bytes | str] = [self.prefix, "1" if stop_at_miss else "0"]
        args.extend(hash_key(h) for h in sequence_hashes)
        rows = self._who_has(keys=[self.workers_key], args=args)
        return [{int(row[i]): int(row[i + 1]) for i in range(0, len(row), 2)} for row in rows]

    def prefix_depths(self, sequence_hashes: Sequence[int]) -> dict[int, dict[Tier, int]]:
        """Per worker and tier, how many leading blocks of the prefix it holds."""
        return prefix_depths(self.who_has(sequence_hashes, stop_at_miss=True))

    def applied_event_id(self, worker_id: int) -> int:
        """The last event id applied for a worker, -1 when Redis knows nothing of it."""
        raw = self.client.hget(self.prefix + "applied", str(int(worker_id)))
        return -1 if raw is None else int(raw)

    def applied_count(self, worker_id: int) -> int:
        """Events applied for a worker since it was last purged (equals last id + 1 when no
        event was ever applied twice)."""
        raw = self.client.hget(self.prefix + "count", str(int(worker_id)))
        return 0 if raw is None else int(raw)

    def workers(self) -> set[int]:
        return {int(w) for w in self.client.smembers(self.workers_key)}

    def snapshot(self) -> dict[int, dict[int, int]]:
        """``sequence_hash -> {worker: tier mask}`` for the whole namespace (SCAN; for checks)."""
        out: dict[int, dict[int, int]] = {}
        start = len(self.prefix) + 2
        keys = list(self.client.scan_iter(match=self.prefix + "b:*", count=1000))
        for chunk in _chunks(keys, 1000):
            pipe = self.client.pipeline(transaction=False)
            for key in chunk:
                pipe.hgetall(key)
            for key, fields in zip(chunk, pipe.execute(), strict=True):
                if fields:
                    seq = int.from_bytes(key[start:], "big")
                    out[seq] = {int(w): int(m) for w, m in fields.items()}
        return out

    def delete_namespace(self) -> int:
        """Remove every key of this namespace (tests and tear-down); returns keys deleted."""
        keys = list(self.client.scan_iter(match=self.prefix + "*", count=1000))
        for chunk in _chunks(keys, 1000):
            self.client.delete(*chunk)
        return len(keys)


def _chunks(items: list[bytes], size: int) -> Iterable[list[bytes]]:
    for i in range(0, len(items), size):
        yield items[i : i + size]
