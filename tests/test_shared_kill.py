"""A publishing worker SIGKILLed at random moments: after each restart, the shared registry's
entries for it and a router's index fed over ZMQ equal the replay of its log.

Before the publishers took their events from the log's commits, a kill could leave Redis
ahead of the log (events applied that the log never committed), and the restart then dropped
its new events as repeats; ZMQ routers kept events whose ids the restart reused.
"""

from __future__ import annotations

import uuid
from functools import partial
from pathlib import Path

import pytest
from services import REDIS_URL, free_port, redis_or_skip
from worker_kills import ZmqRouter, kill_rounds, worker_command

from kvledger.events.shared.registry import SharedRegistry

pytestmark = [pytest.mark.redis, pytest.mark.slow]
ROUNDS = 20


def test_registry_and_zmq_router_equal_the_log_after_each_kill(tmp_path: Path) -> None:
    registry = SharedRegistry(redis_or_skip(), f"kill-{uuid.uuid4().hex[:8]}")
    log = tmp_path / "w.db"
    pub, rep = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    command = partial(
        worker_command,
        REDIS_URL,
        registry.namespace,
        50,
        log,
        "--zmq-endpoint",
        pub,
        "--zmq-replay-endpoint",
        rep,
    )
    try:
        with ZmqRouter(pub, rep, 50).running() as router:
            rounds = kill_rounds(registry, command, 50, log, rounds=ROUNDS, seed=1, router=router)
        assert len(rounds) == ROUNDS
        assert rounds[-1].last_event_id > rounds[0].last_event_id  # the log kept growing
        assert all(r.reconciled == "catch up" or r.reconciled == "in step" for r in rounds)
    finally:
        registry.delete_namespace()
