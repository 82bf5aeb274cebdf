-- The apply gets the batch already reduced by registry.py's _net_changes: the records (only
-- appended to the stream), each tier's Cleared count, and every block the batch touches once,
-- grouped by the bits the batch leaves set or clear on it. Lua then does per block only what
-- needs the stored value: one HMGET slot, a mask edit, one HSET/HDEL slot. Cutting hashes out
-- of records and finding each block's last change cost more in Lua than the whole index
-- update does.
-- KEYS: applied, count, events, workers, lease, held, idx, gens, sweep, fence, tips,
--       events:size (gens and
--       sweep are named from the prefix below; declaring them lets Redis Cluster hold the call
--       back while the shard's slot is half migrated, instead of running it on half the keys)
-- ARGV: prefix, worker id, stream maxlen, lease ttl ms, sweep slice, the writer's fencing token
--       (0: unclaimed), mode ('' a run of events; 'b' a baseline: the worker's fold at event
--       `first`, applied right after a purge), the checksum of the last record (the tip),
--       first event id, events n, Cleared count per tier (4), groups g, g x (set mask, clear
--       mask, blocks), what to append to the stream (in the worker's home shard the n records
--       in one string, wire.pack_stream_entry, or a baseline's record per tier; none in the
--       others), and per group its blocks' 8-byte hashes in one string
-- Returns {applied, repeated, last applied id, gap}: gap is the first event id when it does not
-- follow the last applied one, -2 when the batch starts inside what was applied (the caller
-- sends the rest again), -3 when a newer claim of the worker id fenced this writer off, -4
-- when a baseline finds the worker not purged (both change nothing); else -1.
local wid, maxlen = ARGV[2], ARGV[3]
local ttl, slice = tonumber(ARGV[4]), tonumber(ARGV[5])
local token, mode, tip = tonumber(ARGV[6]), ARGV[7], ARGV[8]
local first, nrec = tonumber(ARGV[9]), tonumber(ARGV[10])
local wk = struct.pack('>I4', tonumber(wid))
local last = tonumber(call('HGET', KEYS[1], wid) or '-1')
if tonumber(call('HGET', KEYS[10], wid) or '0') > token then
  return {0, 0, last, -3}
end
local applied, repeated, gap = 0, 0, -1
if mode == 'b' then
  if last ~= -1 then return {0, 0, last, -4} end
  applied = nrec
elseif first > last + 1 then
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
  local ng = tonumber(ARGV[15])
  local rec0 = 15 + 3 * ng
  local carried = #ARGV - rec0 - ng
  -- The worker's generations before and after the batch's Cleared events.
  local wpre = gens_of(wk)
  local wg, clears, anyclear = wpre, {}, false
  for t = 1, 4 do
    local c = tonumber(ARGV[10 + t])
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
    local set = tonumber(argv[16 + 3 * grp])
    local keep = bnot(tonumber(argv[17 + 3 * grp]))
    local left, blob, pos = tonumber(argv[18 + 3 * grp]), argv[rec0 + carried + 1 + grp], 1
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
  local field = mode == 'b' and 'b' or 'e'
  if carried > 0 then
    for i = rec0 + 1, rec0 + carried do call('XADD', KEYS[3], '*', 'w', wid, field, ARGV[i]) end
    -- maxlen counts events, and an entry holds a call's events: the stream keeps as many
    -- entries as maxlen events fill at the recent mean size of an entry.
    local mean = tonumber(call('HGET', KEYS[12], 'mean') or '0')
    mean = mean > 0 and mean + (nrec / carried - mean) / 64 or nrec / carried
    call('HSET', KEYS[12], 'mean', string.format('%.3f', mean))
    call('XTRIM', KEYS[3], 'MAXLEN', '~', math.ceil(tonumber(maxlen) / mean))
  end
  if mode == 'b' then
    last = first
    call('HSET', KEYS[2], wid, first + 1)
  else
    last = first + nrec - 1
    call('HINCRBY', KEYS[2], wid, nrec)
  end
  call('HSET', KEYS[1], wid, last)
  call('HSET', KEYS[11], wid, tip)
end
if stale then want_sweep() end
if slice > 0 then sweep(slice) end
if ttl > 0 then
  call('SET', KEYS[5], '1', 'PX', ttl)
  call('SADD', KEYS[4], wid)
end
return {applied, repeated, last, gap}
