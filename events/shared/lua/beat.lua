-- A worker's heartbeat in one shard: refresh its lease and list it, unless a newer claim has
-- fenced it off; in shard 0 (a fourth key) also refresh its claim, or take the claim again
-- when it lapsed and nobody else took it (the fence is still this token).
-- KEYS: fence, lease, workers[, claim]
-- ARGV: worker id, token (0: unclaimed), lease ttl ms, holder (JSON)
-- Returns 1 while the worker owns its id here, 0 once it was fenced off.
local token = tonumber(ARGV[2])
if tonumber(redis.call('HGET', KEYS[1], ARGV[1]) or '0') > token then return 0 end
if KEYS[4] and token > 0 then
  local cur = redis.call('GET', KEYS[4])
  if not cur then
    redis.call('SET', KEYS[4], token .. '|' .. ARGV[4], 'PX', ARGV[3])
  elseif string.match(cur, '^(%d+)|') == ARGV[2] then
    redis.call('PEXPIRE', KEYS[4], ARGV[3])
  else
    return 0
  end
end
redis.call('SET', KEYS[2], '1', 'PX', ARGV[3])
redis.call('SADD', KEYS[3], ARGV[1])
return 1
