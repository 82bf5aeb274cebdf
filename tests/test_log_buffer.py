"""AppendBuffer on a real log: batches in order, the hold bound when the producer goes quiet
(also across a SIGKILL), errors that name what was lost, and the exit hook."""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import textwrap
import threading
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest
from services import wait_until

from kvledger.events.log import AppendBuffer, EventLog, EventLogError
from kvledger.events.log import buffer as buffer_module
from kvledger.events.log.replay import replay
from kvledger.events.types import AnyEvent, LogRecord, Removed, Stored, Tier
from kvledger.registry.emitter import EventEmitter
from kvledger.registry.state import RegistryState


@pytest.fixture(autouse=True, params=["compiled queue", "Python queue"])
def queue(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Every test runs with each of the buffer's queues (``buffer.COMPILED_GATHER``, read when a
    buffer is made), where the compiled one is built."""
    if request.param == "compiled queue":
        if not buffer_module.COMPILED_GATHER:
            pytest.skip("kvledger.events.log._gather is not built (or KVLEDGER_PYTHON_BUFFER=1)")
    else:
        monkeypatch.setattr(buffer_module, "COMPILED_GATHER", False)
    return str(request.param)


def events(n: int, worker: int = 0, start: int = 0) -> list[LogRecord]:
    """n events of one worker, ids from ``start``: a stored block then its removal, in turn."""
    out: list[LogRecord] = []
    for eid in range(start, start + n):
        if eid % 2 == 0:
            out.append(
                Stored(
                    event_id=eid,
                    worker_id=worker,
                    dp_rank=0,
                    tier=Tier.G2,
                    ts=1.0,
                    parent_hash=None,
                    blocks=((eid + 1, eid + 1),),
                )
            )
        else:
            out.append(
                Removed(
                    event_id=eid,
                    worker_id=worker,
                    dp_rank=0,
                    tier=Tier.G2,
                    ts=1.0,
                    sequence_hashes=(eid,),
                )
            )
    return out


def logged(log: EventLog) -> list[AnyEvent]:
    log.flush()
    return list(log.read())


def test_events_go_to_the_log_in_batches_and_in_order(log_url: str) -> None:
    with EventLog(log_url) as log:
        buffer = AppendBuffer(log, batch_size=8, max_hold=60.0)
        sent = events(20)
        for start in range(0, 6, 3):  # 6 events: below the batch, all wait
            buffer.extend(sent[start : start + 3])
        assert buffer.waiting == 6 and log.appended == 0
        buffer.extend(sent[6:9])  # 9 >= 8: the lot goes
        assert buffer.waiting == 0 and log.appended == 9
        buffer.extend(sent[9:20])
        assert log.appended == 20
        assert logged(log) == sent
        buffer.close()


def test_a_quiet_producers_events_reach_the_log_within_the_hold(log_url: str) -> None:
    with EventLog(log_url) as log:
        buffer = AppendBuffer(log, batch_size=1000, max_hold=0.02)
        sent = events(5)
        buffer.extend(sent[:3])
        wait_until(lambda: log.committed == 3, "the writer did not hand over the waiting events")
        buffer.extend(sent[3:])  # a second quiet spell: the writer wakes again
        wait_until(lambda: log.committed == 5, "the writer did not hand over the second spell")
        assert buffer.waiting == 0
        assert logged(log) == sent
        buffer.close()


def test_flush_and_close_hand_over_what_waits(log_url: str) -> None:
    with EventLog(log_url) as log:
        buffer = AppendBuffer(log, batch_size=1000, max_hold=60.0)
        sent = events(6)
        buffer.extend(sent[:2])
        buffer.flush()
        assert log.appended == 2
        buffer.extend(sent[2:])
        buffer.close()
        buffer.close()  # twice is fine
        assert logged(log) == sent
        with pytest.raises(EventLogError, match="closed"):
            buffer.extend(events(1, start=6))


def test_producers_on_several_threads_keep_each_workers_order(log_url: str) -> None:
    with EventLog(log_url) as log:
        buffer = AppendBuffer(log, batch_size=16, max_hold=0.005)
        streams = {worker: events(400, worker=worker) for worker in range(3)}

        def produce(worker: int) -> None:
            stream = streams[worker]
            for start in range(0, len(stream), 3):
                buffer.extend(stream[start : start + 3])

        threads = [threading.Thread(target=produce, args=(w,)) for w in streams]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        buffer.close()
        got = logged(log)
        for worker, stream in streams.items():
            assert [e for e in got if e.worker_id == worker] == stream


def test_a_refused_event_costs_only_itself_and_raises_from_the_call_that_appended_it(
    log_url: str,
) -> None:
    with EventLog(log_url) as log:
        buffer = AppendBuffer(log, batch_size=4, max_hold=60.0)
        buffer.extend(events(2))  # ids 0, 1: good, waiting
        bad = replace(events(1, start=2)[0], tier=9)  # type: ignore[arg-type]  # cannot be encoded
        with pytest.raises(ValueError, match=r"refused 1 of 4 buffered events.*event 2\)"):
            buffer.extend([bad, *events(1, start=2)])  # the good id 2 follows the bad one
        assert buffer.waiting == 0
        assert logged(log) == events(3)  # 0, 1 and the good 2 went in
        with pytest.raises(ValueError, match=r"refused 2 of 4.*event 6\).*leaves a gap"):
            buffer.extend([*events(2, start=3), *events(2, start=6)])  # 5 is missing
        nan = replace(events(1, start=5)[0], ts=math.nan)  # the ts column takes no NaN
        with pytest.raises(ValueError, match=r"refused 1 of 4.*event 5\).*ts is NaN"):
            buffer.extend([nan, *events(3, start=5)])
        buffer.close()
        assert logged(log) == events(8)


def test_a_failed_timed_append_is_raised_at_the_next_call_naming_the_loss(log_url: str) -> None:
    with EventLog(log_url) as log:
        buffer = AppendBuffer(log, batch_size=1000, max_hold=0.01)
        buffer.extend(events(1, start=5))  # id 5 where the log expects 0: refused at the hand-over
        wait_until(lambda: buffer.waiting == 0, "the writer did not try the hand-over")
        with pytest.raises(EventLogError, match=r"1 events are not in the log.*leaves a gap"):
            buffer.extend(events(1))
        buffer.extend(events(2))  # raised once; the buffer goes on
        wait_until(lambda: log.committed == 2, "the writer stopped handing over after the failure")
        buffer.close()
        assert logged(log) == events(2)


def test_bad_settings_are_refused(log_url: str) -> None:
    with EventLog(log_url) as log:
        with pytest.raises(ValueError, match="batch_size"):
            AppendBuffer(log, batch_size=0)
        with pytest.raises(ValueError, match="max_hold"):
            AppendBuffer(log, max_hold=0)
        assert AppendBuffer(log).max_hold == log.max_delay / 4


QUIET_PRODUCER = textwrap.dedent(
    """
    import sys, time
    from kvledger.events.log import AppendBuffer, EventLog
    from kvledger.events.types import Tier
    from kvledger.registry.emitter import EventEmitter

    log = EventLog(sys.argv[1])
    buffer = AppendBuffer(log, batch_size=1000, max_hold=0.05)
    batch = []
    emitter = EventEmitter(batch.append, worker_id=0)
    for i in range(int(sys.argv[2])):
        emitter.stored(Tier.G2, None, [(i + 1, i + 1)])
        if i % 3 == 2:
            emitter.removed(Tier.G2, [i + 1])
        buffer.extend(batch)
        batch.clear()
    print("handed", flush=True)
    if sys.argv[3] == "idle":
        time.sleep(600)  # until killed: nothing more is called
    # "exit": leave without closing the buffer or the log
    """
)


def committed(url: str) -> int:
    with EventLog(url, read_only=True) as log:
        return log.last_position()


def kill_when(
    tmp_path: Path, producer: str, args: list[str], says: bytes, ready: Callable[[], bool]
) -> None:
    """Run ``producer`` (a script) until it prints ``says`` and ``ready()`` holds, then
    SIGKILL it."""
    script = tmp_path / "producer.py"
    script.write_text(producer)
    proc = subprocess.Popen(
        [sys.executable, str(script), *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == says
        wait_until(ready, "the producer's events did not become durable", 60)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == -signal.SIGKILL


def test_events_handed_before_a_quiet_spell_survive_sigkill(log_url: str, tmp_path: Path) -> None:
    EventLog(log_url).close()  # the schema, before the child writes
    # 30 stores and 10 removals, below the batch size: only the log's writer can append them
    args = [log_url, "30", "idle"]
    kill_when(tmp_path, QUIET_PRODUCER, args, b"handed", lambda: committed(log_url) == 40)
    with EventLog(log_url, read_only=True) as log:
        state = replay(log)
    live: dict[tuple[int, Tier], dict[int, tuple[int, int | None]]] = {
        (0, Tier.G2): {i + 1: (i + 1, None) for i in range(30) if i % 3 != 2}
    }
    assert state == RegistryState.from_mapping(live)


def test_events_left_in_a_buffer_at_exit_are_appended(log_url: str, tmp_path: Path) -> None:
    EventLog(log_url).close()
    script = tmp_path / "producer.py"
    script.write_text(QUIET_PRODUCER)
    done = subprocess.run(
        [sys.executable, str(script), log_url, "7", "exit"],
        capture_output=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr.decode()
    assert committed(log_url) == 9  # 7 stores, 2 removals: never closed, appended at exit
    assert b"kvledger" not in done.stderr


def test_closing_the_log_hands_over_what_waits_in_its_buffers(log_url: str) -> None:
    log = EventLog(log_url)
    buffers = [AppendBuffer(log, batch_size=1000, max_hold=60.0) for _ in range(2)]
    for worker, buffer in enumerate(buffers):
        buffer.extend(events(3, worker=worker))
    log.close()  # neither buffer was closed
    with EventLog(log_url, read_only=True) as read:
        got = list(read.read())
    for worker in range(2):
        assert [e for e in got if e.worker_id == worker] == events(3, worker=worker)
    with pytest.raises(EventLogError, match="closed"):
        buffers[0].extend(events(1, start=3))


BUSY_PRODUCER = textwrap.dedent(
    """
    import sys
    from kvledger.events.log import AppendBuffer, EventLog
    from kvledger.events.types import Tier
    from kvledger.registry.emitter import EventEmitter

    log = EventLog(sys.argv[1])
    buffer = AppendBuffer(log)
    step = []
    emitter = EventEmitter(step.append, worker_id=0)
    held = []
    i = 0
    print("started", flush=True)
    while True:  # a scheduler's steps, until killed
        i += 1
        emitter.stored(Tier.G2, held[-1] if held else None, [(i, i)])
        held.append(i)
        if len(held) > 64:
            emitter.removed(Tier.G2, held[:3])
            del held[:3]
        buffer.extend(step)
        step.clear()
    """
)


def test_a_busy_producer_killed_mid_stream_leaves_a_prefix_that_replays(
    log_url: str, tmp_path: Path
) -> None:
    EventLog(log_url).close()
    kill_when(tmp_path, BUSY_PRODUCER, [log_url], b"started", lambda: committed(log_url) >= 3000)
    with EventLog(log_url, read_only=True) as log:
        ids = [e.event_id for e in log.read()]
        assert ids == list(range(len(ids))) and len(ids) >= 3000  # a prefix, in order
        state = replay(log)  # it folds: no block removed that was not stored
    assert state.snapshot()


def test_an_emitter_can_feed_a_buffer_through_a_step_list(log_url: str) -> None:
    """The vLLM manager's shape: an emitter appends to a list, each step hands the list over."""
    with EventLog(log_url) as log:
        buffer = AppendBuffer(log, batch_size=5, max_hold=60.0)
        step: list[LogRecord] = []
        emitter = EventEmitter(step.append, worker_id=2)
        for i in range(11):
            emitter.stored(Tier.G2, None, [(i + 1, i + 1)])
            buffer.extend(step)
            step.clear()
        buffer.close()
        assert [e.event_id for e in logged(log)] == list(range(11))
