"""SIGKILL a publishing ``kvledger worker`` at random moments and check, after each restart,
that what other processes see of it (the shared registry, a router's index fed over ZMQ) is
the fold of its log.

Each round starts the worker on a long workload, kills it with SIGKILL after a random time,
and starts it again on the same log with a short workload and ``--linger``: once the restart
says it is done (every event of the log applied to Redis), the views are compared with the
replay of the log, and the restart is stopped with SIGTERM. The restart is at once, so it also
takes over the claim the killed process left behind.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from kvledger.events.log import EventLog
from kvledger.events.log.replay import replay
from kvledger.events.shared.registry import SharedRegistry
from kvledger.events.shared.zmq_subscribe import ZmqSubscriber
from kvledger.events.vllm_events import to_events
from kvledger.registry.index import RouterIndex, holders_from_state


def worker_command(
    url: str, namespace: str, worker: int, log: Path, *extra: str, shards: int | None = None
) -> list[str]:
    return [
        sys.executable, "-m", "kvledger.cli", "worker",
        "--worker-id", str(worker), "--redis-url", url, "--namespace", namespace,
        "--log", str(log), "--lease-ttl", "10",
        "--blocks", "256", "--block-size", "16", "--seed", "7",
        *(["--shards", str(shards)] if shards else []), *extra,
    ]  # fmt: skip


def holders_of(snapshot: dict[int, dict[int, int]], worker: int) -> dict[int, dict[int, int]]:
    """The part of a ``{hash: {worker: mask}}`` view that belongs to ``worker``."""
    return {h: {worker: m[worker]} for h, m in snapshot.items() if m.get(worker)}


def log_holders(log: Path, worker: int) -> tuple[dict[int, dict[int, int]], int]:
    """The log's fold for ``worker`` as ``{hash: {worker: mask}}``, and its last event id."""
    with EventLog(str(log), read_only=True) as opened:
        state = replay(opened)
        last = opened.last_event_id(worker)
    return holders_of(holders_from_state(state), worker), last


@dataclass
class ZmqRouter:
    """Our ``RouterIndex`` fed from a worker's ZMQ stream in a thread, as a router runs it."""

    endpoint: str
    replay_endpoint: str
    worker: int
    index: RouterIndex = field(default_factory=RouterIndex)
    last_seq: int = -1
    error: BaseException | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        try:
            # a short replay wait: a killed publisher never answers, the restart does
            with ZmqSubscriber(
                self.endpoint, replay_endpoint=self.replay_endpoint, replay_timeout=3.0
            ) as sub:
                next_id = 0
                while not self._stop.is_set():
                    for seq, batch in sub.batches(timeout=0.2):
                        events = to_events(self.worker, next_id, batch)
                        next_id += len(events)
                        with self._lock:
                            for event in events:
                                self.index.apply(event)
                            self.last_seq = seq
                        if self._stop.is_set():
                            break
        except BaseException as exc:  # reported by the test
            self.error = exc

    def holders(self) -> dict[int, dict[int, int]]:
        with self._lock:
            return holders_of(self.index.holders(), self.worker)

    @contextmanager
    def running(self) -> Iterator[ZmqRouter]:
        thread = threading.Thread(target=self.run, daemon=True)
        thread.start()
        try:
            yield self
        finally:
            self._stop.set()
            thread.join(10)


def wait_for(condition: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


@dataclass
class Round:
    killed_after: float
    last_event_id: int
    reconciled: str
    blocks: int


def kill_rounds(
    registry: SharedRegistry,
    command: Callable[..., list[str]],
    worker: int,
    log: Path,
    *,
    rounds: int,
    seed: int,
    router: ZmqRouter | None = None,
    kill_between: tuple[float, float] = (0.0, 1.0),
) -> list[Round]:
    """``rounds`` SIGKILLs and restarts; after each restart, the registry's entries for
    ``worker`` (and the router's, when given) equal the replay of its log. ``command(*extra)``
    is the worker's command line with ``extra`` flags. Each kill comes a random time within
    ``kill_between`` after the worker is seen publishing (its applied id moved on)."""
    rng = random.Random(seed)
    done: list[Round] = []
    for number in range(rounds):
        before = registry.applied_event_id(worker)
        busy = subprocess.Popen(
            command("--requests", "1000000", "--interval", "0"),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        pause = rng.uniform(*kill_between)
        try:
            publishing = partial(lambda b: registry.applied_event_id(worker) > b + 100, before)
            try:
                wait_for(publishing, 30, f"round {number}: the worker to publish")
            except AssertionError as exc:
                if busy.poll() is None:
                    raise
                said = busy.stderr.read() if busy.stderr else ""
                raise AssertionError(f"{exc}: it exited with {busy.returncode}: {said}") from exc
            time.sleep(pause)
        finally:
            if busy.poll() is None:
                os.kill(busy.pid, signal.SIGKILL)
            busy.wait()
        restart = subprocess.Popen(
            command("--requests", "5", "--linger"),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            assert restart.stdout is not None
            line = restart.stdout.readline()
            if not line:
                raise AssertionError(
                    f"round {number}: the restart exited with {restart.wait()}: "
                    f"{(restart.stderr.read() if restart.stderr else '')[-2000:]}"
                )
            report: dict[str, Any] = json.loads(line)
            assert report["drained"], (number, report)
            expected, last = log_holders(log, worker)
            assert last == report["last_event_id"], (number, last, report)
            assert registry.applied_event_id(worker) == last, number
            assert holders_of(registry.snapshot(), worker) == expected, (number, pause)
            if router is not None:
                reached = partial(lambda r, n: r.last_seq >= n, router, last)
                wait_for(reached, 40, f"round {number}: ZMQ up to event {last}")
                assert router.error is None, router.error
                assert router.holders() == expected, (number, pause)
            done.append(Round(pause, last, str(report.get("reconciled")), len(expected)))
        finally:
            restart.send_signal(signal.SIGTERM)
            status = restart.wait(timeout=30)
        assert status == 0, (number, restart.stderr.read() if restart.stderr else "")
    return done
