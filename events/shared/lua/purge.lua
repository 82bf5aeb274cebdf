-- KEYS: workers. ARGV: prefix, worker id ('' = every worker whose lease is gone), maxlen.
-- Returns the purged workers and how many (block, tier) entries each dropped, flattened.
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
