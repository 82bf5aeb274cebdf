"""The registry shared by all workers, kept in Redis.

Each worker's events are applied by one Lua script per batch, so a batch is atomic and the
per-worker "last applied event id" moves in the same step as the index: applying a batch twice
changes nothing, and a batch that starts past the next expected id is refused at the gap and the
caller fills it from the worker's durable log. The same script appends every applied event to one
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

import re
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import redis

from kvledger.events.types import AnyEvent, Tier
from kvledger.events.wire import encode_record, hash_key
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

# The apply reads the blocks a batch touches once (HMGET in chunks) into ``vals``, changes them
# in Lua, and writes back only those that changed (HSET/HDEL) at the end: a batch costs a
# handful of calls besides its XADDs, however many blocks it touches.
# KEYS: applied, count, events, workers, lease, held
# ARGV: prefix, worker id, stream maxlen, lease ttl ms, sweep slice, record...
# Returns {applied, repeated, last applied id, id at which a gap was found or -1}.
_LUA_APPLY = (
    _LUA_COMMON
    + """
local wid, maxlen = ARGV[2], ARGV[3]
local ttl, slice = tonumber(ARGV[4]), tonumber(ARGV[5])
local wnum = tonumber(wid)
local wk = struct.pack('>I4', wnum)
local last = tonumber(call('HGET', KEYS[1], wid) or '-1')
local fmts = {}
-- Every block the run touches, once each (``need``), with its value: ``vals[k]`` is nil for
-- a block not seen yet, then false (not read yet, or no value) or the value.
local vals, need, nn = {}, {}, 0
-- Append the 8-byte hashes packed in blob to out[n+1..]; returns the new n. struct.unpack
-- cuts up to 256 of them per call, far cheaper than string.sub each.
local function split(blob, out, n)
  local total, pos = #blob / 8, 1
  while total > 0 do
    local c = math.min(total, 256)
    local f = fmts[c]
    if not f then
      f = string.rep('c8', c)
      fmts[c] = f
    end
    local parts = {struct.unpack(f, blob, pos)}
    for q = 1, c do
      local k = parts[q]
      out[n + q] = k
      if vals[k] == nil then
        vals[k] = false
        nn = nn + 1
        need[nn] = k
      end
    end
    n, pos, total = n + c, pos + 8 * c, total - c
  end
  return n
end
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
    nk = split(seqs, keys, nk)
    nt = nt + 1
    todo[nt] = {kind, tier, first, nk, ARGV[i]}
    expect = eid + 1
  end
end
-- Read every block the run touches once; ``orig[i]`` is need[i]'s value as read.
local orig = {}
for p = 1, nn, 1024 do
  local e = math.min(p + 1023, nn)
  local got = call('HMGET', idx, unpack(need, p, e))
  for q = p, e do
    local v = got[q - p + 1]
    orig[q] = v
    if v then vals[need[q]] = v end
  end
end
local wg = gens_of(wk)
local delta, cleared = {0, 0, 0, 0}, {false, false, false, false}
-- This worker's single-entry values under the current generations, by mask and back: most
-- blocks hold one worker's entry, and these skip building and cutting strings for them.
local ent, ment = {}, {}
local function stamp_entries()
  ent, ment = {}, {}
  for m = 1, 15 do
    local e = wk .. char(m) .. wg
    ent[m], ment[e] = e, m
  end
  ent[0] = false
end
stamp_entries()
-- This worker's entry in a block's value starts at a multiple of 21 bytes.
local function locate(v, i)
  while true do
    local j = find(v, wk, i, true)
    if not j then return nil end
    if (j - 1) % 21 == 0 then return j end
    i = j + 1
  end
end
-- Set (set=true) or clear bit ``b`` (tier ``tier``) of this worker on a loaded block; drops
-- the worker's stale bits on the way.
local function remask(k, b, tier, set)
  local v = vals[k]
  local old = 0
  if v then old = ment[v] end
  if old or not v then
    old = old or 0
    local new
    if set then new = bor(old, b) else new = band(old, bnot(b)) end
    if new ~= old then
      if set then delta[tier] = delta[tier] + 1 else delta[tier] = delta[tier] - 1 end
      vals[k] = ent[new]
    end
    return
  end
  local j = locate(v, 1)
  local raw, stamp = 0, nil
  old = 0
  if j then
    raw = byte(v, j + 4)
    stamp = sub(v, j + 5, j + 20)
    old = valid_mask(raw, stamp, wg)
  end
  local new
  if set then new = bor(old, b) else new = band(old, bnot(b)) end
  if band(old, b) ~= band(new, b) then
    if set then delta[tier] = delta[tier] + 1 else delta[tier] = delta[tier] - 1 end
  end
  if j then
    if new == raw and stamp == wg then return end
    local nv = sub(v, 1, j - 1) .. (ent[new] or '') .. sub(v, j + 21)
    if nv == '' then vals[k] = false else vals[k] = nv end
  elseif new ~= 0 then
    vals[k] = v .. ent[new]
  end
end
local stale = false
for i = 1, nt do
  local ev = todo[i]
  local kind, tier = ev[1], ev[2]
  local b = lshift(1, tier - 1)
  if kind == 5 then
    -- Cleared: a new generation for the tier makes every entry stamped before it stale.
    local held = tonumber(call('HGET', KEYS[6], wid .. ':' .. tier) or '0')
    if cleared[tier] then held = 0 end
    if held + delta[tier] > 0 then stale = true end
    local at = 4 * (tier - 1)
    local g = struct.unpack('>I4', wg, at + 1)
    wg = sub(wg, 1, at) .. struct.pack('>I4', (g + 1) % 4294967296) .. sub(wg, at + 5)
    delta[tier], cleared[tier] = 0, true
    stamp_entries()
  else
    local set = kind ~= 2
    for q = ev[3], ev[4] do remask(keys[q], b, tier, set) end
  end
  call('XADD', KEYS[3], 'MAXLEN', '~', maxlen, '*', 'w', wid, 'r', ev[5])
end
-- Write back the blocks that changed, dropping other workers' stale entries where they share
-- a block with this one.
gcache[wk] = wg
local sets, dels, ns, nd = {}, {}, 0, 0
for i = 1, nn do
  local k = need[i]
  local v = vals[k]
  if v ~= (orig[i] or false) then
    if v and #v > 21 then v = clean(v) end
    if v then
      sets[ns + 1], sets[ns + 2] = k, v
      ns = ns + 2
    else
      nd = nd + 1
      dels[nd] = k
    end
  end
end
write_back(sets, ns, dels, nd)
if cleared[1] or cleared[2] or cleared[3] or cleared[4] then call('HSET', gkey, wk, wg) end
for tier = 1, 4 do
  local field = wid .. ':' .. tier
  if cleared[tier] then
    call('HSET', KEYS[6], field, delta[tier])
  elseif delta[tier] ~= 0 then
    call('HINCRBY', KEYS[6], field, delta[tier])
  end
end
if stale then want_sweep() end
if slice > 0 then sweep(slice) end
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
        if client.get_connection_kwargs().get("decode_responses"):
            raise ValueError("the shared registry needs a Redis client with decode_responses=False")
        self.client = client
        self.namespace = namespace
        self.prefix = f"kvl:{{{namespace}}}:"
        self.lease_ttl_ms = int(lease_ttl_s * 1000)
        self.stream_maxlen = stream_maxlen
        self.sweep_slice = sweep_slice
        """Blocks of a running stale-entry sweep each apply cleans (0: only ``sweep`` does)."""
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
            self.prefix + "held",
        ]
        args: list[bytes | str | int] = [
            self.prefix,
            wid,
            self.stream_maxlen,
            self.lease_ttl_ms,
            self.sweep_slice,
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
        values = self._who_has(
            keys=[self.index_key], args=[self.prefix, *(hash_key(h) for h in sequence_hashes)]
        )
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


def _chunks(items: list[bytes], size: int) -> Iterable[list[bytes]]:
    for i in range(0, len(items), size):
        yield items[i : i + size]
