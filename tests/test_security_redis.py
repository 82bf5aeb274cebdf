"""Redis trust: the ACL roles of docs/security.md on the real server, and a refused login
reported at once.

Each test creates its ACL users (unique names) and namespace on the shared Redis and deletes
them after; nothing else on the server is touched.
"""

from __future__ import annotations

import re
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis
from services import REDIS_URL, redis_or_skip

from kvledger.events.log import EventLog
from kvledger.events.shared import RedisPublisher, SharedRegistry, StreamSubscriber, connect
from kvledger.events.shared.acl import ROLES, Role, setuser_args, setuser_line
from kvledger.events.types import AnyEvent, Stored, Tier
from kvledger.registry.emitter import EventEmitter
from kvledger.registry.hashing import TokenBlockSequence

pytestmark = pytest.mark.redis
DOCS = Path(__file__).resolve().parents[1] / "docs" / "security.md"


@pytest.fixture
def admin() -> redis.Redis:
    return redis_or_skip()


@pytest.fixture
def namespace(admin: redis.Redis) -> Iterator[str]:
    name = f"acl-{uuid.uuid4().hex[:10]}"
    yield name
    SharedRegistry(admin, name).delete_namespace()


class Users:
    """ACL users made for one test, deleted after it."""

    def __init__(self, admin: redis.Redis) -> None:
        self.admin = admin
        self.names: list[str] = []

    def make(self, namespace: str, role: Role) -> str:
        """A user of ``role`` in ``namespace``; returns its Redis URL."""
        name = f"kvl-test-{role}-{uuid.uuid4().hex[:10]}"
        password = uuid.uuid4().hex
        args = ["SETUSER", name, "on", f">{password}", *setuser_args(namespace, role)]
        self.admin.execute_command("ACL", *args)  # type: ignore[no-untyped-call]
        self.names.append(name)
        return f"redis://{name}:{password}@127.0.0.1:6379/0"


@pytest.fixture
def users(admin: redis.Redis) -> Iterator[Users]:
    made = Users(admin)
    yield made
    for name in made.names:
        admin.execute_command("ACL", "DELUSER", name)  # type: ignore[no-untyped-call]


def stored_events(worker: int, count: int) -> list[AnyEvent]:
    out: list[AnyEvent] = []
    emitter = EventEmitter(out.append, worker_id=worker)
    for i in range(count):
        tokens = list(range(i * 100, i * 100 + 32))
        seq = TokenBlockSequence(tokens, 16)
        blocks = list(zip(seq.sequence_hashes, seq.local_hashes, strict=True))
        emitter.stored(Tier.G2, None, blocks, token_ids=[tokens[:16], tokens[16:]])
    return out


def test_a_worker_user_publishes_and_a_read_only_router_user_reads_but_cannot_write(
    tmp_path: Path, namespace: str, users: Users
) -> None:
    worker_url = users.make(namespace, "worker")
    router_url = users.make(namespace, "router")

    # the worker, as the library runs it: its log, its publisher, its user
    events = stored_events(7, 5)
    log = EventLog(f"sqlite:///{tmp_path / 'w7.db'}")
    publisher = RedisPublisher(
        SharedRegistry(connect(worker_url), namespace), 7, log=log, heartbeat_s=0.05
    ).start()  # claims worker id 7: the claim and fence scripts run as the worker's user too
    for event in events:
        log.append(event)  # the publisher takes what the log commits
    assert publisher.wait_applied(10), publisher.error
    publisher.stop()
    log.close()

    router = SharedRegistry(connect(router_url), namespace)
    hashes = [h for e in events if isinstance(e, Stored) for h, _ in e.blocks]
    assert router.who_has(hashes) == [{7: 2}] * len(hashes)  # G2 is bit 2
    assert router.applied_event_id(7) == 4
    seen: list[AnyEvent] = []
    subscriber = StreamSubscriber(
        router,
        "routers",
        "r1",
        on_event=seen.append,
        on_purge=lambda _w: None,
        on_baseline=lambda _b: None,
    )
    assert subscriber.poll() >= 1  # the publisher's apply calls, one entry each
    assert [e.event_id for e in seen] == [0, 1, 2, 3, 4]

    # ... and cannot write: not the index, not the stream, not the applied ids, not a lease
    client = router.client
    worker_side = SharedRegistry(connect(router_url), namespace)
    forbidden: list[Callable[[], object]] = [
        lambda: worker_side.apply(7, stored_events(7, 6)[5:]),
        lambda: client.xadd(router.keys.stream, {"w": "7", "r": b"x"}),
        lambda: client.hset(router.keys.index, "x", "y"),
        lambda: client.hset(router.keys.applied, "7", "99"),
        lambda: client.set(router.keys.lease(7), "1"),
        lambda: client.delete(router.keys.index),
        lambda: client.flushall(),
    ]
    for attempt in forbidden:
        with pytest.raises(redis.exceptions.NoPermissionError):
            attempt()
    admin = redis_or_skip()
    assert admin.hget(router.keys.applied, "7") == b"4"  # nothing moved


def test_a_worker_user_is_held_to_its_namespace(namespace: str, users: Users) -> None:
    client = connect(users.make(namespace, "worker"))
    other = SharedRegistry(redis_or_skip(), f"other-{uuid.uuid4().hex[:8]}")
    try:
        for attempt in (
            lambda: client.set(other.keys.lease(1), "1"),
            lambda: client.get(other.keys.shard_count),
            lambda: client.flushall(),
            lambda: client.config_get("dir"),
            lambda: client.keys("*"),
        ):
            with pytest.raises(redis.exceptions.NoPermissionError):
                attempt()
    finally:
        other.delete_namespace()


def test_the_acl_lines_in_the_docs_are_the_ones_tested() -> None:
    text = DOCS.read_text()
    for role in ROLES:
        line = setuser_line(f"kvledger-{role}", "prod", role)
        assert line in " ".join(text.split()), f"docs/security.md lacks: {line}"


def test_a_wrong_password_is_reported_at_once_and_never_retried(
    tmp_path: Path, admin: redis.Redis, namespace: str, users: Users
) -> None:
    good = users.make(namespace, "worker")
    bad = re.sub(r":[0-9a-f]{32}@", ":wrong@", good)
    with pytest.raises(redis.AuthenticationError):
        connect(bad)

    with pytest.raises(redis.AuthenticationError):
        SharedRegistry(redis.Redis.from_url(bad), namespace)

    # a publisher whose password is changed under it stops with the error on its next try
    registry = SharedRegistry(connect(good), namespace)
    user = good.split("//")[1].split(":")[0]
    admin.execute_command("ACL", "SETUSER", user, "resetpass", ">changed")  # type: ignore[no-untyped-call]
    admin.execute_command("CLIENT", "KILL", "USER", user)  # type: ignore[no-untyped-call]
    log = EventLog(f"sqlite:///{tmp_path / 'p.db'}")
    publisher = RedisPublisher(registry, 3, log=log).start()
    publisher.stop(drain_timeout=5)
    assert isinstance(publisher.error, redis.AuthenticationError)
    assert publisher.outages == 0
    log.close()

    # the worker command: one line, at once (its publish timeout would be 120 s), exit 2
    proc = subprocess.run(
        [
            sys.executable, "-m", "kvledger.cli", "worker", "--worker-id", "3",
            "--log", str(tmp_path / "w.db"), "--redis-url", bad, "--namespace", namespace,
            "--requests", "5", "--publish-timeout", "120",
        ],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert lines[0].startswith("kvledger worker: error: Redis refused the login")
    assert "password" in lines[0] and "wrong" not in lines[0]
    assert REDIS_URL  # the server the users were made on
