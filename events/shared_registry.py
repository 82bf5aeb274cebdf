"""The registry shared by all workers, kept in Redis.

Each worker's events are applied by one Lua script per batch, so a batch is atomic and the
per-worker "last applied event id" moves in the same step as the index: applying a batch twice
changes nothing, and a batch that starts past the next expected id is refused at the gap and the
caller fills it from the worker's durable log. The same script appends every applied event to one
Redis stream (trimmed approximately), so routers reading it with a consumer group see each event
exactly once, in order per worker.

Keys, all under ``kvl:{<namespace>}:`` (the braces are a hash tag: Redis Cluster keeps a whole
namespace on one slot, which the scripts need because they touch keys they derive):

- ``idx``                       hash  8-byte sequence hash -> run of 5-byte entries: u32 worker
                                id, u8 tier mask (G1=1, G2=2, G3=4, G4=8); one HMGET answers
                                a whole prefix. One hash rather than a key per block: a field
                                costs less to write than a top-level key and needs no prefix
- ``log:<worker>:<tier>``       list of packed 8-byte hashes the worker gained on that tier, one
                                element per batch: a superset of what it holds there, read by
                                Cleared and purges, compacted to the live blocks when it grows
- ``logs``                      hash  ``<worker>:<tier>`` -> hashes in that log, and
                                ``<worker>:<tier>:at`` -> the size at which it is compacted
- ``applied`` / ``count``       hash  worker id -> last applied event id / events applied
- ``lease:<worker>``            string with a TTL; refreshed by every apply and by heartbeats
- ``workers``                   set   workers that may hold entries (swept by ``purge_expired``)
- ``events``                    stream of applied records (fields ``w`` worker, ``r`` record)

Why a log and not a set per tier: adding a block to a set is a second hashtable insert per
block, as dear as the index insert itself; appending the event's already packed hashes is one
RPUSH per batch. The log may name blocks the worker no longer holds (removed since), which is
harmless -- Cleared and purges re-check each block's mask -- and compaction keeps it within
``4 x live + log_compact_min`` hashes, amortised over the appends that grew it.
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

# Shared by the scripts. Each script reads the blocks it touches once (MGET in chunks) into
# ``vals``, changes them in Lua, and writes back only those that changed (MSET/DEL) at the end:
# a batch costs a handful of calls besides its XADDs, however many blocks it touches.
_LUA_COMMON = """
local sub, byte, char, find = string.sub, string.byte, string.char, string.find
local concat = table.concat
local bor, band, bnot, lshift = bit.bor, bit.band, bit.bnot, bit.lshift
local call = redis.call
local prefix = ARGV[1]
local idx = prefix .. 'idx'
local vals, orig, loaded = {}, {}, {}
local fmts = {}
-- Append the 8-byte hashes packed in blob (from byte ``start``) to out[n+1..]; returns the new
-- n. struct.unpack cuts up to 256 of them per call, far cheaper than string.sub each.
local function split(blob, start, out, n)
  local total, pos = math.floor((#blob - start + 1) / 8), start
  while total > 0 do
    local c = math.min(total, 256)
    local f = fmts[c]
    if not f then
      f = string.rep('c8', c)
      fmts[c] = f
    end
    local parts = {struct.unpack(f, blob, pos)}
    for q = 1, c do out[n + q] = parts[q] end
    n, pos, total = n + c, pos + 8 * c, total - c
  end
  return n
end
local function logkey(wid, tier) return prefix .. 'log:' .. wid .. ':' .. tier end
-- A block's value is a run of 5-byte entries: 4-byte big-endian worker id, 1-byte tier mask.
local function locate(v, wk)
  local i = 1
  while true do
    local j = find(v, wk, i, true)
    if not j then return nil end
    if (j - 1) % 5 == 0 then return j end
    i = j + 1
  end
end
-- Read keys[1..n] that were not read yet (a key may repeat).
local function load(keys, n)
  local need, m = {}, 0
  for i = 1, n do
    local k = keys[i]
    if orig[k] == nil then
      orig[k] = false
      m = m + 1
      need[m] = k
    end
  end
  for p = 1, m, 1024 do
    local e = math.min(p + 1023, m)
    local got = call('HMGET', idx, unpack(need, p, e))
    for q = p, e do
      local k, v = need[q], got[q - p + 1]
      orig[k] = v
      vals[k] = v
      loaded[#loaded + 1] = k
    end
  end
end
-- Set (set=true) or clear the bits ``b`` of this worker's mask on a loaded block.
local function remask(k, wk, b, set)
  local v = vals[k]
  if not v then
    if not set then return false end
    vals[k] = wk .. char(b)
    return true
  end
  local j = locate(v, wk)
  if not j then
    if not set then return false end
    vals[k] = v .. wk .. char(b)
    return true
  end
  local old = byte(v, j + 4)
  local new
  if set then new = bor(old, b) else new = band(old, bnot(b)) end
  if new == old then return false end
  if new ~= 0 then
    vals[k] = sub(v, 1, j + 3) .. char(new) .. sub(v, j + 5)
  elseif #v == 5 then
    vals[k] = false
  else
    vals[k] = sub(v, 1, j - 1) .. sub(v, j + 5)
  end
  return true
end
-- Write back the blocks whose value changed since they were read.
local function flush()
  local sets, dels, ns, nd = {}, {}, 0, 0
  for _, k in ipairs(loaded) do
    local v = vals[k]
    if v ~= orig[k] then
      orig[k] = v
      if v then
        sets[ns + 1] = k
        sets[ns + 2] = v
        ns = ns + 2
        if ns == 2048 then
          call('HSET', idx, unpack(sets, 1, ns))
          ns = 0
        end
      else
        nd = nd + 1
        dels[nd] = k
        if nd == 1024 then
          call('HDEL', idx, unpack(dels, 1, nd))
          nd = 0
        end
      end
    end
  end
  if ns > 0 then call('HSET', idx, unpack(sets, 1, ns)) end
  if nd > 0 then call('HDEL', idx, unpack(dels, 1, nd)) end
end
-- Replay a tier log ('+'/'-' then packed hashes per element) and any elements not pushed
-- yet: the hashes the worker holds on that tier, in first-gained order.
local function live_hashes(wid, tier, extra)
  local elems = call('LRANGE', logkey(wid, tier), 0, -1)
  for _, e in ipairs(extra) do elems[#elems + 1] = e end
  local state, order, n = {}, {}, 0
  for _, e in ipairs(elems) do
    local hashes = {}
    local c = split(e, 2, hashes, 0)
    if byte(e, 1) == 43 then
      for q = 1, c do
        local s = hashes[q]
        if state[s] == nil then
          n = n + 1
          order[n] = s
        end
        state[s] = true
      end
    else
      for q = 1, c do
        local s = hashes[q]
        if state[s] then state[s] = false end
      end
    end
  end
  local live, m = {}, 0
  for i = 1, n do
    if state[order[i]] then
      m = m + 1
      live[m] = order[i]
    end
  end
  return live, m
end
-- Clear bits ``b`` of this worker on every block its tier log holds; returns blocks changed.
local function clear_tier(wid, wk, tier, b, extra)
  local live, m = live_hashes(wid, tier, extra)
  load(live, m)
  local changed = 0
  for i = 1, m do
    if remask(live[i], wk, b, false) then changed = changed + 1 end
  end
  call('DEL', logkey(wid, tier))
  return changed
end
-- Rewrite a tier log as its live hashes; the next compaction comes at 4x that size (or
-- ``minlog``), so each logged hash is replayed about once however long the worker runs.
local function compact(wid, tier, minlog)
  local live, m = live_hashes(wid, tier, {})
  local key = logkey(wid, tier)
  call('DEL', key)
  for p = 1, m, 8192 do call('RPUSH', key, '+' .. concat(live, '', p, math.min(p + 8191, m))) end
  local field = wid .. ':' .. tier
  call('HSET', prefix .. 'logs', field, m, field .. ':at', math.max(minlog, 4 * m))
end
local function purge(wid, maxlen)
  local wk = struct.pack('>I4', tonumber(wid))
  local n = 0
  for tier = 1, 4 do n = n + clear_tier(wid, wk, tier, 15, {}) end
  flush()
  call('HDEL', prefix .. 'logs', wid .. ':1', wid .. ':1:at', wid .. ':2', wid .. ':2:at',
    wid .. ':3', wid .. ':3:at', wid .. ':4', wid .. ':4:at')
  call('HDEL', prefix .. 'applied', wid)
  call('HDEL', prefix .. 'count', wid)
  call('SREM', prefix .. 'workers', wid)
  call('DEL', prefix .. 'lease:' .. wid)
  call('XADD', prefix .. 'events', 'MAXLEN', '~', maxlen, '*', 'w', wid, 'purged', n)
  return n
end
"""

# KEYS: applied, count, events, workers, lease
# ARGV: prefix, worker id, stream maxlen, lease ttl ms, log compaction floor, record...
# Returns {applied, repeated, last applied id, id at which a gap was found or -1}.
_LUA_APPLY = (
    _LUA_COMMON
    + """
local wid, maxlen = ARGV[2], ARGV[3]
local ttl, minlog = tonumber(ARGV[4]), tonumber(ARGV[5])
local wnum = tonumber(wid)
local wk = struct.pack('>I4', wnum)
local last = tonumber(call('HGET', KEYS[1], wid) or '-1')
-- First pass, before any write: check every record and find the run that follows ``last``.
local todo, keys, nt, nk = {}, {}, 0, 0
local repeated, gap, expect = 0, -1, last + 1
for i = 6, #ARGV do
  local rec = cmsgpack.unpack(ARGV[i])
  if rec[4] ~= wnum then
    return redis.error_reply('record of worker ' .. tostring(rec[4]) .. ' sent as worker ' .. wid)
  end
  local kind, tier, eid = rec[2], rec[6], rec[3]
  if kind ~= 1 and kind ~= 2 and kind ~= 3 and kind ~= 4 and kind ~= 5 then
    return redis.error_reply('unknown event kind ' .. tostring(kind))
  end
  if tier ~= 1 and tier ~= 2 and tier ~= 3 and tier ~= 4 then
    return redis.error_reply('unknown tier ' .. tostring(tier))
  end
  local seqs = rec[8]
  if type(seqs) ~= 'string' or #seqs % 8 ~= 0 then
    return redis.error_reply('event ' .. tostring(eid) .. ': hash blob is not whole 8-byte hashes')
  end
  if eid < expect then
    repeated = repeated + 1
  elseif eid ~= expect then
    gap = eid
    break
  else
    local first = nk + 1
    nk = split(seqs, 1, keys, nk)
    nt = nt + 1
    todo[nt] = {kind, tier, seqs, first, nk, ARGV[i]}
    expect = eid + 1
  end
end
load(keys, nk)
-- Second pass: apply in order, and log each tier's gains ('+') and losses ('-') for Cleared,
-- purges and compaction.
local pending, added, reset = {{}, {}, {}, {}}, {0, 0, 0, 0}, {false, false, false, false}
for i = 1, nt do
  local ev = todo[i]
  local kind, tier, seqs = ev[1], ev[2], ev[3]
  local b = lshift(1, tier - 1)
  if kind == 5 then
    clear_tier(wid, wk, tier, b, pending[tier])
    pending[tier], added[tier], reset[tier] = {}, 0, true
  else
    local set = kind ~= 2
    for q = ev[4], ev[5] do remask(keys[q], wk, b, set) end
    if #seqs > 0 then
      local p = pending[tier]
      p[#p + 1] = (set and '+' or '-') .. seqs
      added[tier] = added[tier] + #seqs / 8
    end
  end
  call('XADD', KEYS[3], 'MAXLEN', '~', maxlen, '*', 'w', wid, 'r', ev[6])
end
flush()
for tier = 1, 4 do
  local p = pending[tier]
  for s = 1, #p, 1024 do call('RPUSH', logkey(wid, tier), unpack(p, s, math.min(s + 1023, #p))) end
  if added[tier] > 0 or reset[tier] then
    local field = wid .. ':' .. tier
    local size
    if reset[tier] then
      size = added[tier]
      call('HSET', prefix .. 'logs', field, size)
    else
      size = call('HINCRBY', prefix .. 'logs', field, added[tier])
    end
    if size >= tonumber(call('HGET', prefix .. 'logs', field .. ':at') or minlog) then
      compact(wid, tier, minlog)
    end
  end
end
if nt > 0 then
  call('HSET', KEYS[1], wid, expect - 1)
  call('HINCRBY', KEYS[2], wid, nt)
end
if ttl > 0 then
  call('SET', KEYS[5], '1', 'PX', ttl)
  call('SADD', KEYS[4], wid)
end
return {nt, repeated, expect - 1, gap}
"""
)

# KEYS: workers. ARGV: prefix, worker id ('' = every worker whose lease is gone), maxlen.
# Returns the purged workers and how many blocks each dropped out of, flattened.
_LUA_PURGE = (
    _LUA_COMMON
    + """
local out = {}
local targets
if ARGV[2] ~= '' then targets = {ARGV[2]} else targets = call('SMEMBERS', KEYS[1]) end
for _, wid in ipairs(targets) do
  if ARGV[2] ~= '' or call('EXISTS', prefix .. 'lease:' .. wid) == 0 then
    out[#out + 1] = wid
    out[#out + 1] = purge(wid, ARGV[3])
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
        log_compact_min: int = 16_384,
    ) -> None:
        if not _NAMESPACE.match(namespace):
            raise ValueError(
                f"namespace {namespace!r} must be 1-64 characters of letters, digits, '_', '.', '-'"
            )
        if lease_ttl_s <= 0:
            raise ValueError(f"lease_ttl_s must be positive, got {lease_ttl_s}")
        if stream_maxlen < 1:
            raise ValueError(f"stream_maxlen must be at least 1, got {stream_maxlen}")
        if log_compact_min < 1:
            raise ValueError(f"log_compact_min must be at least 1, got {log_compact_min}")
        if client.get_connection_kwargs().get("decode_responses"):
            raise ValueError("the shared registry needs a Redis client with decode_responses=False")
        self.client = client
        self.namespace = namespace
        self.prefix = f"kvl:{{{namespace}}}:"
        self.lease_ttl_ms = int(lease_ttl_s * 1000)
        self.stream_maxlen = stream_maxlen
        self.log_compact_min = log_compact_min
        self.stream_key = self.prefix + "events"
        self.workers_key = self.prefix + "workers"
        self.index_key = self.prefix + "idx"
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
            self.log_compact_min,
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
        values = self.client.hmget(self.index_key, [hash_key(h) for h in sequence_hashes])
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
        raw = self.client.hget(self.prefix + "applied", str(int(worker_id)))
        return -1 if raw is None else int(raw)

    def applied_count(self, worker_id: int) -> int:
        """Events applied for a worker since it was last purged (equals last id + 1 when no
        event was ever applied twice)."""
        raw = self.client.hget(self.prefix + "count", str(int(worker_id)))
        return 0 if raw is None else int(raw)

    def tier_log_size(self, worker_id: int, tier: Tier) -> int:
        """How many hashes a worker's log for ``tier`` holds (live blocks plus stale ones)."""
        raw = self.client.hget(self.prefix + "logs", f"{int(worker_id)}:{int(tier)}")
        return 0 if raw is None else int(raw)

    def workers(self) -> set[int]:
        return {int(w) for w in self.client.smembers(self.workers_key)}

    def snapshot(self) -> dict[int, dict[int, int]]:
        """``sequence_hash -> {worker: tier mask}`` for the whole namespace (HSCAN; for checks)."""
        out: dict[int, dict[int, int]] = {}
        for field, value in self.client.hscan_iter(self.index_key, count=1000):
            holders = _holders(value)
            if holders:
                out[int.from_bytes(field, "big")] = holders
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
