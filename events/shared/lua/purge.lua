-- KEYS: workers, gens, held, applied, count, events, sweep, then the lease key of each candidate
-- ARGV: prefix, '1' to purge the candidates whatever their lease ('' = only those whose lease is
--       gone), stream maxlen, shard count, this shard's number, then the candidate worker ids
-- The caller lists the candidates (SMEMBERS workers) so that every key this touches is declared:
-- Redis Cluster then holds the call back while the slot is half migrated, rather than letting it
-- read a lease that already moved as a lapsed one.
-- Returns the purged workers and how many (block, tier) entries each dropped, flattened.
local out = {}
local shards, shard = tonumber(ARGV[4]), tonumber(ARGV[5])
for i = 6, #ARGV do
  local wid = ARGV[i]
  if ARGV[2] ~= '' or (call('SISMEMBER', KEYS[1], wid) == 1 and call('EXISTS', KEYS[i + 2]) == 0) then
    out[#out + 1] = wid
    out[#out + 1] = purge(wid, ARGV[3], tonumber(wid) % shards == shard)
  end
end
return out
