"""The log under load: the uncommitted tail stays within its bound while a producer and a busy
CPU thread compete with the writer, and a SIGKILL at any moment loses only that tail.

Every assertion is about event counts and positions, or about the append times the producer
itself recorded around each call: never about how fast this machine happens to be.
"""

from __future__ import annotations

import asyncio
import mmap
import os
import random
import signal
import struct
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from services import hold_write_lock

from kvledger.events.log import AsyncEventLog, EventLog
from kvledger.events.types import Removed, Stored, Tier
from kvledger.registry.emitter import EventEmitter

SLOTS = 1_000_000  # events the child may record; it stops appending (and waits) after that
HEADER = struct.Struct("<q")
TIMES = struct.Struct("<dd")

# A producer at full speed, with a second thread that only burns CPU: the writer thread has to
# win the GIL from both. Each event's monotonic time just before and just after ``append`` goes
# into a shared file, then the count of events appended, so the parent knows exactly what was
# appended when the kill came.
CHILD = textwrap.dedent(
    """
    import mmap, struct, sys, threading, time
    from kvledger.events.log import EventLog
    from kvledger.events.types import Tier
    from kvledger.registry.emitter import EventEmitter

    url, shared, slots = sys.argv[1], sys.argv[2], int(sys.argv[3])
    with open(shared, "r+b") as f:
        m = mmap.mmap(f.fileno(), 0)
    header, times = struct.Struct("<q"), struct.Struct("<dd")

    def busy():
        x = 0
        while True:
            x += 1

    threading.Thread(target=busy, daemon=True).start()
    log = EventLog(url)  # the defaults: durability "batch", max_delay 0.05 s
    emitter = EventEmitter(log.append, worker_id=0)
    clock = time.monotonic
    print("started", log.max_lag, log.queue_size, flush=True)
    for i in range(slots):
        before = clock()
        if i % 2 == 0:
            emitter.stored(Tier.G1, None, [(i // 2, i)])
        else:
            emitter.removed(Tier.G1, [i // 2])
        times.pack_into(m, header.size + times.size * i, before, clock())
        header.pack_into(m, 0, i + 1)
    time.sleep(3600)
    """
)


def _committed(url: str) -> int:
    with EventLog(url, read_only=True) as log:
        return log.last_position()


def _kill_at_random(url: str, tmp_path: Path, delay: float) -> tuple[int, mmap.mmap, float, int]:
    """Run the child, watch its commits, SIGKILL it after ``delay`` s of appending; returns
    (events appended, their times, the child's max_lag, queue_size)."""
    EventLog(url).close()  # the schema exists before the child starts
    shared = tmp_path / "appended.bin"
    with open(shared, "wb") as f:
        f.truncate(HEADER.size + TIMES.size * SLOTS)
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    proc = subprocess.Popen(
        [sys.executable, str(script), url, str(shared), str(SLOTS)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline().split()
        assert line and line[0] == b"started", proc.stderr.read() if proc.stderr else b""
        max_lag, queue_size = float(line[1]), int(line[2])
        # A reader sees the committed count move while the run goes on (what `tail` polls).
        seen = set()
        deadline = time.monotonic() + delay
        while time.monotonic() < deadline:
            seen.add(_committed(url))
            time.sleep(0.05)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == -signal.SIGKILL
    assert len(seen - {0}) >= 2, f"the committed count did not move during the run: {seen}"
    with open(shared, "r+b") as f:
        m = mmap.mmap(f.fileno(), 0)
    (appended,) = HEADER.unpack_from(m, 0)
    return appended, m, max_lag, queue_size


def test_sigkill_loses_only_the_bounded_tail(
    new_log_url: Callable[[], str], tmp_path: Path
) -> None:
    rng = random.Random(12)
    for attempt in range(3):
        url = new_log_url()
        appended, times, max_lag, queue_size = _kill_at_random(url, tmp_path, rng.uniform(0.6, 1.5))
        with EventLog(url, read_only=True) as log:
            rows = list(log.read_positions())
        committed = len(rows)
        # A prefix of what was appended, every row whole and in order. (The event appended
        # just before the kill may be committed without having been counted.)
        assert [p for p, _ in rows] == list(range(1, committed + 1))
        assert [e.event_id for _, e in rows] == list(range(committed))
        for _, event in rows:
            i = event.event_id
            want = Stored if i % 2 == 0 else Removed
            assert isinstance(event, want) and event.sequence_hashes == (i // 2,)
        assert 0 < committed <= appended + 1, (attempt, committed, appended)
        lost = appended - committed
        assert lost <= queue_size, (attempt, lost)
        if lost > 0:
            # Every lost event was appended while the oldest lost one (the first row of the
            # batch the kill cut off) was at most max_lag old.
            _, first_done = TIMES.unpack_from(times, HEADER.size + TIMES.size * committed)
            last_start, _ = TIMES.unpack_from(times, HEADER.size + TIMES.size * (appended - 1))
            span = last_start - first_done
            assert span <= max_lag, (
                f"kill {attempt}: {lost} events lost, appended over {span:.3f} s "
                f"(bound {max_lag} s)"
            )
        times.close()


def _busy(stop: threading.Event) -> None:
    x = 0
    while not stop.is_set():
        x += 1


@pytest.mark.parametrize("durability", ["batch", "none"])
def test_backlog_never_exceeds_its_bound_with_a_busy_producer(
    log_url: str, durability: str
) -> None:
    queue_size = 300
    depths: list[int] = []
    stop = threading.Event()
    burner = threading.Thread(target=_busy, args=(stop,))
    burner.start()
    try:
        with EventLog(
            log_url,
            batch_size=100,
            queue_size=queue_size,
            durability=durability,  # type: ignore[arg-type]
        ) as log:
            emitter = EventEmitter(log.append)
            for i in range(6000):
                emitter.stored(Tier.G1, None, [(i, i)])
                depths.append(log.queue_depth)
            log.flush()
            assert [e.event_id for e in log.read()] == list(range(6000))
            assert log.queue_depth == 0 and log.committed == log.appended == 6000
    finally:
        stop.set()
        burner.join()
    assert max(depths) <= queue_size, f"queue depth reached {max(depths)} > {queue_size}"


@pytest.mark.parametrize("durability", ["batch", "none"])
def test_a_stalled_writer_holds_the_producer_by_age_not_only_by_count(
    log_url: str, durability: str
) -> None:
    """With "batch" the producer stops once the oldest uncommitted event is max_lag old, long
    before the queue is full; with "none" only the (here large) queue bound applies."""
    n = 20_000
    with EventLog(log_url, queue_size=100_000, max_delay=0.01, durability=durability) as log:  # type: ignore[arg-type]
        emitter = EventEmitter(log.append)
        emitter.stored(Tier.G1, None, [(0, 0)])
        log.flush()
        engine, blocker = hold_write_lock(log_url)
        done = threading.Event()

        def produce() -> None:
            for i in range(1, n):
                emitter.stored(Tier.G1, None, [(i, i)])
            done.set()

        producer = threading.Thread(target=produce)
        producer.start()
        try:
            if durability == "none":
                assert done.wait(30), "durability none blocked below its queue bound"
                assert log.backpressure_waits == 0
            else:
                time.sleep(0.6)
                assert not done.is_set(), "append did not wait for a stalled writer"
                assert log.queue_depth < n - 1
                assert log.max_lag is not None and log.commit_lag > log.max_lag
        finally:
            blocker.rollback()
            blocker.close()
            engine.dispose()
        producer.join(30)
        assert done.is_set()
        log.flush()
        assert [e.event_id for e in log.read()] == list(range(n))
        if durability == "batch":
            assert log.backpressure_waits >= 1
            assert log.backpressure_seconds > 0
        assert log.commit_lag == 0.0


def test_async_log_holds_the_producer_for_a_stalled_writer(tmp_path: Path) -> None:
    url = f"sqlite+aiosqlite:///{tmp_path / 'a.db'}"
    sync_url = f"sqlite:///{tmp_path / 'a.db'}"

    async def main() -> None:
        async with AsyncEventLog(url, max_delay=0.01) as log:
            first = Stored(
                event_id=0,
                worker_id=0,
                dp_rank=0,
                tier=Tier.G1,
                ts=1.0,
                parent_hash=None,
                blocks=((1, 1),),
            )
            await log.append(first)
            await log.flush()
            engine, blocker = hold_write_lock(sync_url)

            async def produce() -> None:
                for i in range(1, 20_000):
                    await log.append(
                        Removed(
                            event_id=i,
                            worker_id=0,
                            dp_rank=0,
                            tier=Tier.G1,
                            ts=1.0,
                            sequence_hashes=(i,),
                        )
                    )

            task = asyncio.create_task(produce())
            await asyncio.sleep(0.6)
            assert not task.done(), "append did not wait for a stalled writer"
            assert log.queue_depth < 19_999
            assert log.max_lag is not None and log.commit_lag > log.max_lag
            await asyncio.to_thread(blocker.rollback)
            blocker.close()
            engine.dispose()
            await asyncio.wait_for(task, 30)
            await log.flush()
            assert log.backpressure_waits >= 1 and log.queue_depth == 0
            ids = [e.event_id async for e in log.read()]
            assert ids == list(range(20_000))

    asyncio.run(main())
