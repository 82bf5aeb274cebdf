"""The Redis client for a URL: a cluster client when the server runs in cluster mode.

A Redis Cluster node answers a plain client too, but only for the slots it serves: the shared
registry must follow MOVED replies and fail-overs, which redis-py's ``RedisCluster`` does.
Asking the server (``INFO cluster``) keeps one URL setting for both kinds of deployment.
"""

from __future__ import annotations

from typing import Any

import redis

Client = redis.Redis | redis.RedisCluster
"""A single Redis server, or a Redis Cluster."""


REFUSALS = (redis.AuthenticationError, redis.exceptions.NoPermissionError)
"""Redis refusing who we are (a wrong password) or what we ask (an ACL user without the
permission): waiting cannot mend either, so they are reported at once, never retried."""


def connect(url: str, *, cluster: bool | None = None, **kwargs: Any) -> Client:
    """A client of the Redis at ``url``; ``cluster`` None asks the server which kind it is
    (a server that cannot be reached is taken for a single one: the caller's retries then
    report it unreachable; one that refuses the URL's credentials raises
    ``redis.AuthenticationError`` at once)."""
    if cluster is None:
        plain = redis.Redis.from_url(url, **kwargs)
        try:
            cluster = bool(plain.info("cluster").get("cluster_enabled"))
        except REFUSALS:
            plain.close()
            raise
        except (redis.ConnectionError, redis.TimeoutError):
            return plain
        if not cluster:
            return plain
        plain.close()
    if cluster:
        return redis.RedisCluster.from_url(url, **kwargs)
    return redis.Redis.from_url(url, **kwargs)
