"""The shared registry's transport against a real Redis server: replies in order, scripts
loaded where the server lacks them, errors raised only once every reply was read.

Its cluster side (routing by slot map, no ``COMMAND GETKEYS``, fail-over and slot migration)
is tested on a real Redis Cluster in ``test_shared_cluster.py``.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
import redis
from services import redis_or_skip

from kvledger.events.shared.transport import Transport

pytestmark = pytest.mark.redis

# Echoes its key and argument, and whether that key exists (it only reads: EVALSHA_RO may run it)
ECHO = "-- {tag}\nreturn {{KEYS[1], ARGV[1], redis.call('EXISTS', KEYS[1])}}"


@pytest.fixture
def prefix() -> Iterator[str]:
    client = redis_or_skip()
    name = f"kvl:{{transport-{uuid.uuid4().hex[:12]}}}:"
    yield name
    client.delete(*[name + k for k in ("a", "b", "n")])


def test_replies_come_in_order_and_a_script_the_server_lacks_is_loaded(prefix: str) -> None:
    """A script no server has seen (its source is new) is loaded at its first NOSCRIPT and
    every command sent again: script calls, read-only calls and plain commands, one reply
    each in order (the first call sees the key that the first sending's SET wrote)."""
    client = redis_or_skip()
    source = ECHO.format(tag=uuid.uuid4().hex)
    transport = Transport(client, [source])
    sha = str(transport.script(source, [prefix + "a"], ["x"])[1])
    assert client.script_exists(sha) == [False]
    replies = transport.run(
        [
            transport.script(source, [prefix + "a"], [1]),
            ("SET", prefix + "a", "v"),
            transport.read_script(source, [prefix + "a"], [b"\x00\xff"]),
            ("GET", prefix + "a"),
            transport.script(source, [prefix + "b"], ["z"]),
        ]
    )
    key_a, key_b = (prefix + "a").encode(), (prefix + "b").encode()
    assert replies == [[key_a, b"1", 1], True, [key_a, b"\x00\xff", 1], b"v", [key_b, b"z", 0]]
    assert client.script_exists(sha) == [True]
    assert transport.run([transport.script(source, [prefix + "a"], [2])]) == [[key_a, b"2", 1]]
    assert transport.run([]) == []


def test_an_error_comes_after_every_reply_and_the_connection_stays_in_step(prefix: str) -> None:
    """A command refused mid-pipeline raises once the pipeline's replies are all read: the
    commands after it ran, and the next run reads its own replies, not those left over."""
    client = redis_or_skip()
    transport = Transport(client, [])
    with pytest.raises(redis.ResponseError, match="not an integer"):
        transport.run(
            [("SET", prefix + "n", "text"), ("INCR", prefix + "n"), ("SET", prefix + "b", "after")]
        )
    assert client.get(prefix + "b") == b"after"
    for _ in range(3):  # one connection or several from the pool: each in step
        assert transport.run([("GET", prefix + "n"), ("GET", prefix + "b")]) == [b"text", b"after"]
    with pytest.raises(redis.ResponseError, match="not an integer"):
        transport.run([("INCR", prefix + "n")])  # a command alone, not in a pipeline
    assert transport.run([("GET", prefix + "n")]) == [b"text"]
