"""The Lua scripts of the shared registry (``shared_registry.py`` has the key layout they keep).

Each script is one atomic step in Redis: ``APPLY`` edits the index for a reduced run of one
worker's events and moves its applied id, ``PURGE`` drops workers whose lease lapsed (or one
that leaves), ``WHO_HAS`` answers a prefix in one round trip, ``SWEEP`` removes entries that
a Cleared or a purge made stale. They share ``GENERATIONS`` (reading a worker's current
generations and masking stale bits) and ``COMMON`` (writing blocks back and the sweep).
"""

from __future__ import annotations

# Reading with generations: what ``who_has`` needs, and the start of every other script.
GENERATIONS = """
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
COMMON = (
    GENERATIONS
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
APPLY = (
    COMMON
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
PURGE = (
    COMMON
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
WHO_HAS = (
    GENERATIONS
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
SWEEP = (
    COMMON
    + """
local n = sweep(tonumber(ARGV[2]))
return {n, call('EXISTS', skey)}
"""
)
