-- Claim a worker id for one process (shard 0).
-- KEYS: the worker's claim key, tokens
-- ARGV: worker id, holder (JSON), lease ttl ms, the token of a holder known to be dead to take
--       over from ('' = none), the lowest token to hand out (above every shard's fence)
-- Returns {token, ''} when claimed, {0, current claim} when another holder has it.
local cur = redis.call('GET', KEYS[1])
if cur then
  local held = string.match(cur, '^(%d+)|')
  if ARGV[4] == '' or held ~= ARGV[4] then return {0, cur} end
end
local token = redis.call('HINCRBY', KEYS[2], ARGV[1], 1)
local floor = tonumber(ARGV[5])
if token < floor then
  token = floor
  redis.call('HSET', KEYS[2], ARGV[1], token)
end
redis.call('SET', KEYS[1], token .. '|' .. ARGV[2], 'PX', ARGV[3])
return {token, ''}
