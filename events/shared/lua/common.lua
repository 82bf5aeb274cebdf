-- Writing: shared by the apply, purge and sweep scripts (follows generations.lua).
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
-- Drop a worker's entries of this shard; the home shard of the worker (``announce``) also
-- tells the stream's readers.
local function purge(wid, maxlen, announce)
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
  call('HDEL', prefix .. 'tips', wid)
  call('SREM', prefix .. 'workers', wid)
  call('DEL', prefix .. 'lease:' .. wid)
  if announce then
    call('XADD', prefix .. 'events', 'MAXLEN', '~', maxlen, '*', 'w', wid, 'purged', n)
  end
  return n
end
