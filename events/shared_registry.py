"""The registry shared by all workers, kept in Redis.

Each worker's events are applied by a Lua script, so a call is atomic and the per-worker "last
applied event id" moves in the same step as the index: applying events twice changes nothing,
and a call that starts past the next expected id is refused at the gap and the caller fills it
from the worker's durable log. The Python side checks the records and reduces a run of events to
what it leaves behind (each touched block once, with the bits it ends set or cleared, and the
Cleared count per tier), so Lua only does the part that needs the stored values; a long batch
goes out as several calls in one pipeline. The same script appends every applied event to one
Redis stream (trimmed approximately), so routers reading it with a consumer group see each event
exactly once, in order per worker.

Keys, all under ``kvl:{<namespace>}:`` (the braces are a hash tag: Redis Cluster keeps a whole
namespace on one slot, which the scripts need because they touch keys they derive):

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
import re
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import msgpack
import numpy as np
import redis

from kvledger.events.codec import KIND_CODES
from kvledger.events.types import AnyEvent, Cleared, Removed, Tier
from kvledger.events.wire import (
    KIND_OF_CODE,
    RECORD_VERSION,
    WireFormatError,
    encode_record,
    hash_key,
)
from kvledger.registry.index import prefix_depths

_STAMPED = struct.Struct(">IB16s")
_NO_GENERATIONS = bytes(16)
_NAMESPACE = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")

# Reading with generations: what ``who_has`` needs, and the start of every other script.
_LUA_GENERATIONS = """
local sub, byte, char, find = string.sub, string.byte, string.char, string.find
local concat = table.concat
local bor, band, bnot, lshift = bit.bor, bit.band, bit.bnot, bit.lshift
local call = redis.call
local prefix = ARGV[1]
local idx, gkey, skey = prefix .. 'idx', prefix .. 'gens', prefix .. 'sweep'
local ZERO = string.rep(string.char(0), 16)
local gcache = {}
-- A worker's current generations (16 bytes: u32 per tier), by its 4-byte id.
local function gens_of(wk)
  local g = gcache[wk]
  if g == nil then
    g = call('HGET', gkey, wk) or ZERO
    gcache[wk] = g
  end
  return g
end
-- The bits of ``mask`` whose tier generation in ``stamp`` is still the current one.
local function valid_mask(mask, stamp, cur)
  if stamp == cur then return mask end
  local m = 0
  for t = 0, 3 do
    local b, at = lshift(1, t), 4 * t
    if band(mask, b) ~= 0 and sub(stamp, at + 1, at + 4) == sub(cur, at + 1, at + 4) then
      m = bor(m, b)
    end
  end
  return m
end
-- Per distinct 21-byte entry: the entry without its stale bits, with the current
-- generations, or false when nothing is left. Blocks mostly repeat a few entries, so each is
-- worked out once per script run.
local live_of = {}
local function live(e)
  local l = live_of[e]
  if l == nil then
    local wk = sub(e, 1, 4)
    local cur = gens_of(wk)
    local m = valid_mask(byte(e, 5), sub(e, 6, 21), cur)
    l = m ~= 0 and wk .. char(m) .. cur
    live_of[e] = l
  end
  return l
end
-- A block's value without stale bits (false: nothing left).
local function clean(v)
  if #v == 21 then return live(v) end
  local out, n, changed = {}, 0, false
  for j = 1, #v, 21 do
    local e = sub(v, j, j + 20)
    local l = live(e)
    if l ~= e then changed = true end
    if l then
      n = n + 1
      out[n] = l
    end
  end
  if not changed then return v end
  if n == 0 then return false end
  return concat(out)
end
"""

# Writing: shared by the apply, purge and sweep scripts.
_LUA_COMMON = (
    _LUA_GENERATIONS
    + """
local function write_back(sets, ns, dels, nd)
  for p = 1, ns, 2048 do call('HSET', idx, unpack(sets, p, math.min(p + 2047, ns))) end
  for p = 1, nd, 1024 do call('HDEL', idx, unpack(dels, p, math.min(p + 1023, nd))) end
end
-- Ask for a full sweep pass that starts after now (a running pass may have passed blocks
-- that just went stale, so it is followed by another).
local function want_sweep()
  if call('HEXISTS', skey, 'cursor') == 1 then
    call('HSET', skey, 'again', '1')
  else
    call('HSET', skey, 'cursor', '0')
  end
end
-- Clean about ``count`` blocks of the running sweep pass; returns the blocks looked at.
local function sweep(count)
  local cursor = call('HGET', skey, 'cursor')
  if not cursor then return 0 end
  local r = call('HSCAN', idx, cursor, 'COUNT', count)
  local items = r[2]
  local sets, dels, ns, nd = {}, {}, 0, 0
  for i = 1, #items, 2 do
    local v = items[i + 1]
    local c = clean(v)
    if c ~= v then
      if c then
        sets[ns + 1], sets[ns + 2] = items[i], c
        ns = ns + 2
      else
        nd = nd + 1
        dels[nd] = items[i]
      end
    end
  end
  write_back(sets, ns, dels, nd)
  if r[1] ~= '0' then
    call('HSET', skey, 'cursor', r[1])
  elseif call('HDEL', skey, 'again') == 1 then
    call('HSET', skey, 'cursor', '0')
  else
    call('DEL', skey)
  end
  return #items / 2
end
local function purge(wid, maxlen)
  local wk = struct.pack('>I4', tonumber(wid))
  local hk = prefix .. 'held'
  local f1, f2, f3, f4 = wid .. ':1', wid .. ':2', wid .. ':3', wid .. ':4'
  local n = 0
  for _, c in ipairs(call('HMGET', hk, f1, f2, f3, f4)) do n = n + tonumber(c or '0') end
  call('HDEL', hk, f1, f2, f3, f4)
  local g = {struct.unpack('>I4I4I4I4', gens_of(wk))}
  call('HSET', gkey, wk, struct.pack('>I4I4I4I4', g[1] + 1, g[2] + 1, g[3] + 1, g[4] + 1))
  if n > 0 then want_sweep() end
  call('HDEL', prefix .. 'applied', wid)
  call('HDEL', prefix .. 'count', wid)
  call('SREM', prefix .. 'workers', wid)
  call('DEL', prefix .. 'lease:' .. wid)
  call('XADD', prefix .. 'events', 'MAXLEN', '~', maxlen, '*', 'w', wid, 'purged', n)
  return n
end
"""
)

# The apply gets the batch already reduced by ``_net_changes``: the records (only appended to the
# stream), each tier's Cleared count, and every block the batch touches once, grouped by the
# bits the batch leaves set or clear on it. Lua then does per block only what needs the stored
# value: one HMGET slot, a mask edit, one HSET/HDEL slot. Cutting hashes out of records and
# finding each block's last change cost more in Lua than the whole index update does.
# KEYS: applied, count, events, workers, lease, held
# ARGV: prefix, worker id, stream maxlen, lease ttl ms, sweep slice, first event id, records n,
#       Cleared count per tier (4), groups g, g x (set mask, clear mask, blocks), records, and
#       per group its blocks' 8-byte hashes in one string
# Returns {applied, repeated, last applied id, gap}: gap is the first event id when it does not
# follow the last applied one, -2 when the batch starts inside what was applied (the caller
# sends the rest again), else -1.
_LUA_APPLY = (
    _LUA_COMMON
    + """
local wid, maxlen = ARGV[2], ARGV[3]
local ttl, slice = tonumber(ARGV[4]), tonumber(ARGV[5])
local first, nrec = tonumber(ARGV[6]), tonumber(ARGV[7])
local wk = struct.pack('>I4', tonumber(wid))
local last = tonumber(call('HGET', KEYS[1], wid) or '-1')
local applied, repeated, gap = 0, 0, -1
if first > last + 1 then
  gap = first
elseif first + nrec - 1 <= last then
  repeated = nrec
elseif first <= last then
  repeated, gap = last + 1 - first, -2
else
  applied = nrec
end
local stale = false
if applied > 0 then
  local ng = tonumber(ARGV[12])
  local rec0 = 12 + 3 * ng
  -- The worker's generations before and after the batch's Cleared events.
  local wpre = gens_of(wk)
  local wg, clears, anyclear = wpre, {}, false
  for t = 1, 4 do
    local c = tonumber(ARGV[7 + t])
    clears[t] = c
    if c > 0 then
      anyclear = true
      local at = 4 * (t - 1)
      local g = struct.unpack('>I4', wg, at + 1)
      wg = sub(wg, 1, at) .. struct.pack('>I4', (g + c) % 4294967296) .. sub(wg, at + 5)
    end
  end
  gcache[wk] = wg
  -- This worker's single-entry values under the new generations, by mask and back: most
  -- blocks hold one worker's entry, and these skip building and cutting strings for them.
  local ent, ment = {[0] = false}, {}
  for m = 1, 15 do
    local e = wk .. char(m) .. wg
    ent[m], ment[e] = e, m
  end
  -- tr[old * 16 + new]: blocks whose live mask of this worker went from old to new; before[t]:
  -- touched blocks that held a live tier-t bit before a Cleared of tier t.
  local tr, before = {}, {0, 0, 0, 0}
  local sets, dels, ns, nd = {}, {}, 0, 0
  local argv, unpack, cut, fmts = ARGV, unpack, struct.unpack, {}
  for grp = 0, ng - 1 do
    local set = tonumber(argv[13 + 3 * grp])
    local keep = bnot(tonumber(argv[14 + 3 * grp]))
    local left, blob, pos = tonumber(argv[15 + 3 * grp]), argv[rec0 + nrec + 1 + grp], 1
    -- nm[old]: the mask this group leaves; moved[old]: blocks that went from old to nm[old]
    -- (for the common cases: no value yet, or only this worker's current entry).
    local nm, moved = {}, {}
    for m = 0, 15 do
      nm[m], moved[m] = bor(band(m, keep), set), 0
    end
    local fresh = ent[set]
    while left > 0 do
      -- Cutting the hashes out of one string here is cheaper than Redis making an argument
      -- (and a Lua string in ARGV) of each.
      local e = math.min(left, 1024)
      local f = fmts[e]
      if not f then
        f = string.rep('c8', e)
        fmts[e] = f
      end
      local ks = {cut(f, blob, pos)}
      local got = call('HMGET', idx, unpack(ks, 1, e))
      for i = 1, e do
        local v = got[i]
        if not v then
          if fresh then
            moved[0] = moved[0] + 1
            sets[ns + 1], sets[ns + 2] = ks[i], fresh
            ns = ns + 2
          end
        else
          local old = ment[v]
          if old then
            local new = nm[old]
            if new ~= old then
              moved[old] = moved[old] + 1
              if new == 0 then
                nd = nd + 1
                dels[nd] = ks[i]
              else
                sets[ns + 1], sets[ns + 2] = ks[i], ent[new]
                ns = ns + 2
              end
            end
          else
            -- Another worker's entries, or this worker's stamped before a Cleared or purge.
            local k = ks[i]
            local j, i0 = nil, 1
            while true do
              j = find(v, wk, i0, true)
              if not j or (j - 1) % 21 == 0 then break end
              i0 = j + 1
            end
            local raw, stamp = 0, nil
            old = 0
            if j then
              raw, stamp = byte(v, j + 4), sub(v, j + 5, j + 20)
              old = valid_mask(raw, stamp, wg)
              if anyclear then
                local pre = valid_mask(raw, stamp, wpre)
                for t = 1, 4 do
                  if clears[t] > 0 and band(pre, lshift(1, t - 1)) ~= 0 then
                    before[t] = before[t] + 1
                  end
                end
              end
            end
            local new = nm[old]
            if new ~= old then moved[old] = moved[old] + 1 end
            local nv = v
            if j then
              if new ~= raw or stamp ~= wg then
                nv = sub(v, 1, j - 1) .. (ent[new] or '') .. sub(v, j + 21)
              end
            elseif new ~= 0 then
              nv = v .. ent[new]
            end
            if nv ~= v then
              if #nv > 21 then nv = clean(nv) elseif nv == '' then nv = false end
              if nv then
                sets[ns + 1], sets[ns + 2] = k, nv
                ns = ns + 2
              else
                nd = nd + 1
                dels[nd] = k
              end
            end
          end
        end
      end
      pos, left = pos + 8 * e, left - e
    end
    for m = 0, 15 do
      if moved[m] > 0 then
        local c = m * 16 + nm[m]
        tr[c] = (tr[c] or 0) + moved[m]
      end
    end
  end
  write_back(sets, ns, dels, nd)
  local delta = {0, 0, 0, 0}
  for c, n in pairs(tr) do
    local old, new = math.floor(c / 16), c % 16
    for t = 1, 4 do
      local b = lshift(1, t - 1)
      if band(new, b) ~= 0 then delta[t] = delta[t] + n end
      if band(old, b) ~= 0 then delta[t] = delta[t] - n end
    end
  end
  if anyclear then call('HSET', gkey, wk, wg) end
  for t = 1, 4 do
    local field = wid .. ':' .. t
    if clears[t] > 0 then
      -- Entries of the tier the batch did not touch went stale with the new generation.
      if tonumber(call('HGET', KEYS[6], field) or '0') > before[t] then stale = true end
      call('HSET', KEYS[6], field, delta[t])
    elseif delta[t] ~= 0 then
      call('HINCRBY', KEYS[6], field, delta[t])
    end
  end
  for i = rec0 + 1, rec0 + nrec do call('XADD', KEYS[3], '*', 'w', wid, 'r', ARGV[i]) end
  call('XTRIM', KEYS[3], 'MAXLEN', '~', maxlen)
  last = first + nrec - 1
  call('HSET', KEYS[1], wid, last)
  call('HINCRBY', KEYS[2], wid, nrec)
end
if stale then want_sweep() end
if slice > 0 then sweep(slice) end
if ttl > 0 then
  call('SET', KEYS[5], '1', 'PX', ttl)
  call('SADD', KEYS[4], wid)
end
return {applied, repeated, last, gap}
"""
)

# KEYS: workers. ARGV: prefix, worker id ('' = every worker whose lease is gone), maxlen.
# Returns the purged workers and how many (block, tier) entries each dropped, flattened.
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

# ARGV: prefix, sequence hash keys... Returns each block's value (21-byte entries) or nil, stale
# bits left out: the generations are read in the same script, so one round trip. With no sweep
# pass pending there is no stale entry anywhere (every Cleared or purge that made one asked for
# a pass, and a pass visits every block), so the values go back as read.
_LUA_WHO_HAS = (
    _LUA_GENERATIONS
    + """
local out, dirty = {}, call('EXISTS', skey) == 1
for p = 2, #ARGV, 1024 do
  local e = math.min(p + 1023, #ARGV)
  local got = call('HMGET', idx, unpack(ARGV, p, e))
  for q = 1, e - p + 1 do
    local v = got[q]
    if v and dirty then v = clean(v) end
    out[p + q - 2] = v
  end
end
return out
"""
)

# ARGV: prefix, slice. Returns {blocks looked at, 1 if a pass is still running else 0}.
_LUA_SWEEP = (
    _LUA_COMMON
    + """
local n = sweep(tonumber(ARGV[2]))
return {n, call('EXISTS', skey)}
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
        sweep_slice: int = 256,
        events_per_call: int = 512,
    ) -> None:
        if not _NAMESPACE.match(namespace):
            raise ValueError(
                f"namespace {namespace!r} must be 1-64 characters of letters, digits, '_', '.', '-'"
            )
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
        self.prefix = f"kvl:{{{namespace}}}:"
        self.lease_ttl_ms = int(lease_ttl_s * 1000)
        self.stream_maxlen = stream_maxlen
        self.sweep_slice = sweep_slice
        """Blocks of a running stale-entry sweep each apply cleans (0: only ``sweep`` does)."""
        self.events_per_call = events_per_call
        """Events per apply script call; a longer batch is several calls in one pipeline, the
        first of them an eighth of this (so Redis starts on it while the rest is packed).
        Longer calls touch fewer blocks: a block stored and removed within a call costs one
        read and no write."""
        self.stream_key = self.prefix + "events"
        self.workers_key = self.prefix + "workers"
        self.index_key = self.prefix + "idx"
        self._apply = client.register_script(_LUA_APPLY)
        self._purge = client.register_script(_LUA_PURGE)
        self._who_has = client.register_script(_LUA_WHO_HAS)
        self._sweep = client.register_script(_LUA_SWEEP)

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
            self.client.script_load(_LUA_APPLY)
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
                self.prefix + "applied",
                self.prefix + "count",
                self.stream_key,
                self.workers_key,
                self.prefix + "lease:" + wid,
                self.prefix + "held",
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
            self.client.script_load(_LUA_WHO_HAS)
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
        raw = self.client.hget(self.prefix + "applied", str(int(worker_id)))
        return -1 if raw is None else int(raw)

    def applied_count(self, worker_id: int) -> int:
        """Events applied for a worker since it was last purged (equals last id + 1 when no
        event was ever applied twice)."""
        raw = self.client.hget(self.prefix + "count", str(int(worker_id)))
        return 0 if raw is None else int(raw)

    def held_count(self, worker_id: int, tier: Tier) -> int:
        """How many blocks a worker holds on ``tier`` (kept by the apply; what a purge drops)."""
        raw = self.client.hget(self.prefix + "held", f"{int(worker_id)}:{int(tier)}")
        return 0 if raw is None else int(raw)

    def workers(self) -> set[int]:
        return {int(w) for w in self.client.smembers(self.workers_key)}

    def snapshot(self) -> dict[int, dict[int, int]]:
        """``sequence_hash -> {worker: tier mask}`` for the whole namespace (HSCAN; for checks)."""
        generations: dict[bytes, bytes] = {}
        for worker, stamp in self.client.hgetall(self.prefix + "gens").items():
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
        keys = list(self.client.scan_iter(match=self.prefix + "*", count=1000))
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
    if version != RECORD_VERSION:
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
