-- Give a worker id up: drop its claim if the given token still holds it.
-- KEYS: the worker's claim key. ARGV: token. Returns 1 when dropped.
local cur = redis.call('GET', KEYS[1])
if cur and string.match(cur, '^(%d+)|') == ARGV[1] then
  redis.call('DEL', KEYS[1])
  return 1
end
return 0
