-- KEYS: idx, gens, sweep. ARGV: prefix, sequence hash keys... Returns each block's value (21-byte entries) or nil,
-- stale bits left out: the generations are read in the same script, so one round trip. With no
-- sweep pass pending there is no stale entry anywhere (every Cleared or purge that made one asked
-- for a pass, and a pass visits every block), so the values go back as read.
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
