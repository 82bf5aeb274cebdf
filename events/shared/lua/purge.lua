-- KEYS: workers, gens, held, applied, count, events, sweep, fence, then the lease key of each
--       candidate
-- ARGV: prefix, '1' to purge the candidates whatever their lease ('' = only those whose lease is
--       gone), stream maxlen, shard count, this shard's number, the caller's fencing token (a
--       forced purge of a worker whose id a newer claim holds is refused), then the candidate
--       worker ids
-- The caller lists the candidates (SMEMBERS workers) so that every key this touches is declared:
-- Redis Cluster then holds the call back while the slot is half migrated, rather than letting it
-- read a lease that already moved as a lapsed one.
-- Returns the purged workers and how many (block, tier) entries each dropped (-1: fenced off,
-- nothing dropped), flattened.
local out = {}
local shards, shard, token = tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6])
for i = 7, #ARGV do
  local wid = ARGV[i]
  if ARGV[2] ~= '' then
    out[#out + 1] = wid
    if tonumber(call('HGET', KEYS[8], wid) or '0') > token then
      out[#out + 1] = -1
    else
      out[#out + 1] = purge(wid, ARGV[3], tonumber(wid) % shards == shard)
    end
  elseif call('SISMEMBER', KEYS[1], wid) == 1 and call('EXISTS', KEYS[i + 2]) == 0 then
    out[#out + 1] = wid
    out[#out + 1] = purge(wid, ARGV[3], tonumber(wid) % shards == shard)
  end
end
return out
