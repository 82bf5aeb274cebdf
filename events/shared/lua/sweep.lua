-- KEYS: idx, gens, sweep. ARGV: prefix, slice. Returns {blocks looked at, 1 if a pass is still running else 0}.
local n = sweep(tonumber(ARGV[2]))
return {n, call('EXISTS', skey)}
