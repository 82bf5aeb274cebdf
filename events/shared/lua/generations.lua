-- Reading with generations: what who_has needs, and the start of every other script.
-- Defines the shared locals (prefix from ARGV[1], the idx, gens and sweep keys) and clean(v),
-- which drops the tier bits whose generation is stale.
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
