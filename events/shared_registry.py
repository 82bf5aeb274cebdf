"""The registry shared by all workers, kept in Redis.

Each worker's events are applied by one Lua script per batch, so a batch is atomic and the
per-worker "last applied event id" moves in the same step as the index: applying a batch twice
changes nothing, and a batch that starts past the next expected id is refused at the gap and the
caller fills it from the worker's durable log. The same script appends every applied event to one
Redis stream (trimmed approximately), so routers reading it with a consumer group see each event
exactly once, in order per worker.

Keys, all under ``kvl:{<namespace>}:`` (the braces are a hash tag: Redis Cluster keeps a whole
namespace on one slot, which the scripts need because they touch keys they derive):

- ``b:<8-byte sequence hash>``  string of 5-byte entries: u32 worker id, u8 tier mask
                                (G1=1, G2=2, G3=4, G4=8); one MGET answers a whole prefix
- ``w:<worker>:<tier>``         set   the worker's sequence hashes on that tier (Cleared, purge)
- ``applied`` / ``count``       hash  worker id -> last applied event id / events applied
- ``lease:<worker>``            string with a TTL; refreshed by every apply and by heartbeats
- ``workers``                   set   workers that may hold entries (swept by ``purge_expired``)
- ``events``                    stream of applied records (fields ``w`` worker, ``r`` record)
"""

from __future__ import annotations

import re
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import redis

from kvledger.events.types import AnyEvent, Tier
from kvledger.events.wire import encode_record, hash_key
from kvledger.registry.index import prefix_depths

_ENTRY = struct.Struct(">IB")
_NAMESPACE = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")

# Shared by the scripts: change one worker's tier mask on many blocks with one MGET and one
# MSET, and purge a worker.
_LUA_COMMON = """
-- A block's value is a run of 5-byte entries: 4-byte big-endian worker id, 1-byte tier mask.
local function locate(v, wk)
  local i = 1
  while true do
    local j = string.find(v, wk, i, true)
    if not j then return nil end
    if (j - 1) % 5 == 0 then return j end
    i = j + 1
  end
end
-- New value of a block after this worker's mask becomes fn(old mask); nil when unchanged.
local function remask(v, wk, fn)
  local j = v and locate(v, wk)
  local old = j and string.byte(v, j + 4) or 0
  local new = fn(old)
  if new == old then return nil end
  if not v then return wk .. string.char(new) end
  if not j then return v .. wk .. string.char(new) end
  if new == 0 then return string.sub(v, 1, j - 1) .. string.sub(v, j + 5) end
  return string.sub(v, 1, j + 3) .. string.char(new) .. string.sub(v, j + 5)
end
-- Change the masks of a chunk (<= 1024) of blocks: one MGET, one MSET, one DEL at most.
local function remask_all(prefix, wk, chunk, fn)
  local keys = {}
  for j, s in ipairs(chunk) do keys[j] = prefix .. 'b:' .. s end
  local values = redis.call('MGET', unpack(keys))
  local sets, dels = {}, {}
  for j, k in ipairs(keys) do
    local nv = remask(values[j] or nil, wk, fn)
    if nv == '' then
      dels[#dels + 1] = k
      values[j] = false
    elseif nv then
      sets[#sets + 1] = k
      sets[#sets + 1] = nv
      values[j] = nv  -- a hash repeated within the chunk sees the update
    end
  end
  if #sets > 0 then redis.call('MSET', unpack(sets)) end
  if #dels > 0 then redis.call('DEL', unpack(dels)) end
end
local function chunks(list)
  local out, chunk = {}, {}
  for _, s in ipairs(list) do
    chunk[#chunk + 1] = s
    if #chunk == 1024 then
      out[#out + 1] = chunk
      chunk = {}
    end
  end
  if #chunk > 0 then out[#out + 1] = chunk end
  return out
end
local function split(seqs)
  local list = {}
  for p = 1, #seqs, 8 do list[#list + 1] = string.sub(seqs, p, p + 7) end
  return list
end
local function purge(prefix, wid)
  local wk = struct.pack('>I4', tonumber(wid))
  local n = 0
  for tier = 1, 4 do
    local wset = prefix .. 'w:' .. wid .. ':' .. tier
    local members = redis.call('SMEMBERS', wset)
    n = n + #members
    for _, chunk in ipairs(chunks(members)) do
      remask_all(prefix, wk, chunk, function(m) return 0 end)
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
    _LUA_COMMON
    + """
local prefix, wid, maxlen = ARGV[1], ARGV[2], ARGV[3]
local ttl = tonumber(ARGV[4])
local wnum = tonumber(wid)
local wk = struct.pack('>I4', wnum)
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
      for _, chunk in ipairs(chunks(split(seqs))) do
        remask_all(prefix, wk, chunk, function(m) return bit.bor(m, b) end)
        redis.call('SADD', wset, unpack(chunk))
      end
    elseif kind == 2 then
      for _, chunk in ipairs(chunks(split(seqs))) do
        remask_all(prefix, wk, chunk, function(m) return bit.band(m, bit.bnot(b)) end)
        redis.call('SREM', wset, unpack(chunk))
      end
    elseif kind == 5 then
      for _, chunk in ipairs(chunks(redis.call('SMEMBERS', wset))) do
        remask_all(prefix, wk, chunk, function(m) return bit.band(m, bit.bnot(b)) end)
      end
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
    _LUA_COMMON
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
        if not 0 <= worker_id < 1 << 32:
            raise ValueError(f"worker ids must fit in 32 bits, got {worker_id}")
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
        if not sequence_hashes:
            return []
        values = self.client.mget([self._block_key(h) for h in sequence_hashes])
        out = [_holders(v) for v in values]
        if stop_at_miss:
            for position, holders in enumerate(out):
                if not holders:
                    return out[:position]
        return out

    def prefix_depths(self, sequence_hashes: Sequence[int]) -> dict[int, dict[Tier, int]]:
        """Per worker and tier, how many leading blocks of the prefix it holds."""
        return prefix_depths(self.who_has(sequence_hashes, stop_at_miss=True))

    def _block_key(self, sequence_hash: int) -> bytes:
        return self.prefix.encode() + b"b:" + hash_key(sequence_hash)

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
            for key, value in zip(chunk, self.client.mget(chunk), strict=True):
                holders = _holders(value)
                if holders:
                    out[int.from_bytes(key[start:], "big")] = holders
        return out

    def delete_namespace(self) -> int:
        """Remove every key of this namespace (tests and tear-down); returns keys deleted."""
        keys = list(self.client.scan_iter(match=self.prefix + "*", count=1000))
        for chunk in _chunks(keys, 1000):
            self.client.delete(*chunk)
        return len(keys)


def _holders(value: bytes | str | None) -> dict[int, int]:
    """A block's value (5-byte entries: u32 worker id, u8 tier mask) as {worker: mask}."""
    if not value:
        return {}
    if isinstance(value, str):  # only a client decoding replies gives str, refused in __init__
        raise TypeError("block values must be bytes")
    return {worker: mask for worker, mask in _ENTRY.iter_unpack(value)}


def _chunks(items: list[bytes], size: int) -> Iterable[list[bytes]]:
    for i in range(0, len(items), size):
        yield items[i : i + size]
