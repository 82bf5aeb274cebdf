"""The registry shared by all workers, in Redis, by job: ``keys`` (the key layout of a namespace,
also used by the G4 directory), ``registry`` (``SharedRegistry``, atomic applies through the Lua
scripts that ``scripts`` loads from ``lua/``), ``transport`` (how the registry's calls reach one
Redis server or a cluster's nodes), ``publish`` (sinks that carry a worker's events
there, and ``FanOut``) and ``subscribe`` (routers reading its event stream).

``client.connect`` gives the right redis-py client for a URL (a cluster client for Redis
Cluster). The names users need are importable from here.
"""

from kvledger.events.shared.client import connect
from kvledger.events.shared.keys import KeySpace
from kvledger.events.shared.publish import FanOut, RedisPublisher
from kvledger.events.shared.registry import ApplyResult, SharedRegistry
from kvledger.events.shared.subscribe import StreamSubscriber

__all__ = [
    "ApplyResult",
    "FanOut",
    "KeySpace",
    "RedisPublisher",
    "SharedRegistry",
    "StreamSubscriber",
    "connect",
]
