-- Raise a worker's fence in one shard to a newly claimed token: from then on the shard refuses
-- the writes of every older token (apply, forced purge, heartbeat).
-- KEYS: fence. ARGV: worker id, token ('0' only reads). Returns the fence as it was.
local cur = tonumber(redis.call('HGET', KEYS[1], ARGV[1]) or '0')
if cur < tonumber(ARGV[2]) then redis.call('HSET', KEYS[1], ARGV[1], ARGV[2]) end
return cur
