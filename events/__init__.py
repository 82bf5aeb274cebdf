"""Events, by job: the transition vocabulary (``types``) and its formats (``codec`` for the log's
records and snapshots, ``chunk_decode`` for replay's vectorised decode, ``wire`` for the Redis
stream's records) at this level; the durable log, replay and its checks in ``log/``; the Redis
shared registry, its key layout, Lua scripts, publishers and subscribers in ``shared/``."""
