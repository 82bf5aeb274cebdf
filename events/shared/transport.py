"""How the shared registry's commands reach Redis: one server or a Redis Cluster.

The registry decides what to run (``registry.py``: script calls and plain commands, each on one
shard's keys); a ``Transport`` runs a list of them and returns their replies in order, loading
the scripts where a server lacks them. It goes through redis-py: its ``Script`` objects name
the scripts; its pipeline (one server), connection pools, retries, protocol packing and reply
parsing do the rest. Two parts are written here, both for a cluster:

- routing: each command goes to the node of its first key in redis-py's slot map. redis-py's
  cluster pipeline would ask each script call's keys of its default node (``COMMAND GETKEYS``)
  before routing it: a round trip more per call, a permission the roles of ``acl.py`` do not
  grant, and a failure while that node is down (a fail-over);
- writing to the nodes (``_to_nodes``) rather than through redis-py's cluster pipeline with
  each command's node named: the pipeline costs ~40 us more of Python per execute, which makes
  a ``who_has`` on a cluster 1.3-1.4x as long. It still carries what redis-py must handle
  (MOVED, ASK, TRYAGAIN while a slot migrates).

``bench/redis_transport_bench.py`` measures each choice against redis-py's own way; the
figures are in bench/RESULTS.md (Shared registry on Redis, "Transport apart from the
registry").
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Sequence
from typing import Any

import redis
from redis.commands.core import Script

from kvledger.events.shared.client import Client

Arg = bytes | str | int
Command = Sequence[Arg]
"""A Redis command and its arguments, as redis-py's ``execute_command`` takes them."""

_SCRIPT_CALLS = ("EVALSHA", "EVALSHA_RO")


class Transport:
    """Runs commands on the Redis behind a redis-py client (``client.connect``), with the Lua
    scripts it was given loaded wherever they are called."""

    def __init__(self, client: Client, scripts: Iterable[str]) -> None:
        self.client = client
        self._scripts: dict[str, Script] = {
            source: client.register_script(source) for source in scripts
        }
        self._read_only = "EVALSHA_RO"
        """How ``read_script`` calls: read-only (Redis >= 7), so a Redis user that may only
        read the keys can make the call (docs/security.md); ``EVALSHA`` on an older Redis."""

    def script(self, source: str, keys: Sequence[str], args: Sequence[Arg]) -> list[Arg]:
        """The command that runs ``source`` (one of this transport's scripts) on ``keys``.

        Sent by ``run``, not by redis-py's ``Script.__call__``: that has no read-only form,
        and in a pipeline it asks ``SCRIPT EXISTS`` before every execute (a round trip more
        per batch, and a permission the roles of ``acl.py`` lack) against a NOSCRIPT that
        ``run`` handles when it happens."""
        return ["EVALSHA", self._scripts[source].sha, len(keys), *keys, *args]

    def read_script(self, source: str, keys: Sequence[str], args: Sequence[Arg]) -> list[Arg]:
        """``script`` for a script that only reads: a read-only call where Redis has one."""
        return [self._read_only, self._scripts[source].sha, len(keys), *keys, *args]

    def run(self, commands: Iterable[Command]) -> list[Any]:
        """Run ``commands`` (script calls from ``script``/``read_script``, and plain commands
        on one key each) in one pipeline per node; their replies in order, or the first error
        once every reply was read. Where a server has lost the scripts (a restart, a promoted
        replica) they are loaded and the commands sent again, so every command must be safe
        to run twice (the registry's are: applies are idempotent, the other scripts read, or
        purge what is already purged)."""
        pending = list(commands)
        loaded = False
        while True:
            try:
                return self._send(pending) if pending else []
            except redis.exceptions.NoScriptError:
                if loaded:
                    raise
                self.load_scripts()
                loaded = True
            except redis.ResponseError as exc:
                if "unknown command" not in str(exc).lower() or not any(
                    command[0] == "EVALSHA_RO" for command in pending
                ):
                    raise
                self._read_only = "EVALSHA"  # a Redis before 7.0: no read-only script calls
                pending = [
                    ["EVALSHA", *command[1:]] if command[0] == "EVALSHA_RO" else command
                    for command in pending
                ]

    def load_scripts(self) -> None:
        """Load every script (a cluster client loads them on every master)."""
        for script in self._scripts.values():
            self.client.script_load(script.script)

    def _send(self, commands: Sequence[Command]) -> list[Any]:
        if isinstance(self.client, redis.RedisCluster):
            return self._send_to_cluster(commands)
        if len(commands) == 1:  # a pipeline costs ~5-10 us more than the command alone
            return [self.client.execute_command(*commands[0])]  # type: ignore[no-untyped-call]
        pipe = self.client.pipeline(transaction=False)
        for command in commands:
            pipe.execute_command(*command)  # type: ignore[no-untyped-call]
        return list(pipe.execute())

    def _send_to_cluster(self, commands: Sequence[Command]) -> list[Any]:
        """First straight to the nodes that redis-py's slot map names (``_to_nodes``); after a
        connection error (a node gone) the map is learned anew and that tried once more; on
        any other error (MOVED, ASK, TRYAGAIN while a slot migrates) all of them through
        redis-py's cluster pipeline, which follows redirections and refreshes the map."""
        assert isinstance(self.client, redis.RedisCluster)
        try:
            return self._to_nodes(self.client, commands)
        except redis.exceptions.NoScriptError:
            raise
        except (redis.ConnectionError, redis.TimeoutError):
            self._refresh_slot_map(self.client)
            try:
                return self._to_nodes(self.client, commands)
            except (redis.ConnectionError, redis.TimeoutError, redis.exceptions.NoScriptError):
                raise  # still down: the caller tries again later
            except redis.RedisError:
                pass
        except redis.RedisError:
            pass
        pipe = self.client.pipeline()  # type: ignore[no-untyped-call]
        for command in commands:
            # routed as _to_nodes does: redis-py's own routing would ask each script call's
            # keys of the default node; the calls it redirects it sends again one by one,
            # routed by itself
            node = self.client.get_node_from_key(_first_key(command))  # type: ignore[no-untyped-call]
            pipe.execute_command(*command, target_nodes=node)
        return list(pipe.execute())

    @staticmethod
    def _refresh_slot_map(client: redis.RedisCluster) -> None:
        with contextlib.suppress(redis.RedisError):
            client.nodes_manager.initialize()
            client.replace_default_node()

    @staticmethod
    def _to_nodes(client: redis.RedisCluster, commands: Sequence[Command]) -> list[Any]:
        """Each command written to the node of its first key in redis-py's slot map, every
        node's commands in one write before any reply is read; then the replies.

        Written here rather than left to redis-py's cluster pipeline (with each command's node
        named, so that it asks nothing of the default node): the pipeline costs ~40 us more
        of Python per execute, which made ``who_has`` on a cluster 1.30-1.38x as long at 1, 3
        and 6 shards; for applies the two are equal (``bench/redis_transport_bench.py
        --cluster``)."""
        opened: dict[str, tuple[Any, Any, list[int]]] = {}  # node -> pool, connection, commands
        finished: set[str] = set()  # nodes whose replies were all read
        try:
            for position, command in enumerate(commands):
                node = client.get_node_from_key(_first_key(command))  # type: ignore[no-untyped-call]
                if node.name not in opened:
                    pool = client.get_redis_connection(node).connection_pool
                    opened[node.name] = (pool, pool.get_connection(), [])
                opened[node.name][2].append(position)
            for _pool, conn, positions in opened.values():
                conn.send_packed_command(conn.pack_commands([commands[p] for p in positions]))
            replies: list[Any] = [None] * len(commands)
            for name, (_pool, conn, positions) in opened.items():
                errors = []
                for p in positions:
                    try:
                        replies[p] = conn.read_response()
                    except redis.ResponseError as exc:
                        errors.append(exc)
                finished.add(name)
                if errors:
                    raise errors[0]
        finally:
            for name, (pool, conn, _positions) in opened.items():
                if name not in finished:
                    conn.disconnect()  # replies left unread: never reuse it
                pool.release(conn)
        return replies


def _first_key(command: Command) -> Arg:
    """The key a command is routed by: a script call's first key, else its first argument."""
    return command[3] if command[0] in _SCRIPT_CALLS else command[1]
