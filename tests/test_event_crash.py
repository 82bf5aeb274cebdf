"""Crash safety: a writer process killed with SIGKILL mid-stream leaves a clean prefix that
replays, and a restarted writer carries on from it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from kvledger.events.log import EventLog
from kvledger.events.log.replay import replay
from kvledger.events.types import Tier
from kvledger.registry.emitter import EventEmitter
from kvledger.registry.state import RegistryState

WRITER = textwrap.dedent(
    """
    import random, sys
    from kvledger.events.log import EventLog
    from kvledger.events.types import BlockInfo, Tier
    from kvledger.registry.emitter import EventEmitter

    log = EventLog(sys.argv[1], batch_size=50, queue_size=200, max_delay=0.001)
    rng = random.Random(5)
    emitters = [EventEmitter(log.append, worker_id=w) for w in (0, 1)]
    resident = {0: [], 1: []}
    print("started", flush=True)
    while True:  # until killed
        worker = rng.randrange(2)
        em, held = emitters[worker], resident[worker]
        if len(held) < 4 or rng.random() < 0.6:
            seqs = [(rng.getrandbits(64), rng.getrandbits(64)) for _ in range(rng.randint(1, 3))]
            em.stored(Tier.G1, held[-1] if held else None, seqs)
            held.extend(s for s, _ in seqs)
        elif rng.random() < 0.7:
            em.removed(Tier.G1, [held.pop(rng.randrange(len(held)))])
        else:
            em.copied(Tier.G1, Tier.G2, [BlockInfo(held[-1], 7, None)])
    """
)


def committed_rows(url: str) -> int:
    with EventLog(url, read_only=True) as log:
        return log.last_position()


def test_sigkill_leaves_a_clean_prefix_that_replays_and_resumes(
    log_url: str, tmp_path: Path
) -> None:
    EventLog(log_url).close()  # create the schema before the race starts
    script = tmp_path / "writer.py"
    script.write_text(WRITER)
    proc = subprocess.Popen(
        [sys.executable, str(script), log_url], stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == b"started"
        deadline = time.monotonic() + 60
        while committed_rows(log_url) < 3000:
            assert proc.poll() is None, proc.stderr.read().decode() if proc.stderr else ""
            assert time.monotonic() < deadline, "the writer did not get going"
            time.sleep(0.02)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == -signal.SIGKILL

    with EventLog(log_url, read_only=True) as log:
        positions = [p for p, _event in log.read_positions()]
        events = list(log.read())  # every row decodes: nothing torn
        assert positions == list(range(1, len(positions) + 1)), "row ids are not contiguous"
        assert len(positions) >= 3000
        last = {}
        for worker in (0, 1):
            ids = [e.event_id for e in events if e.worker_id == worker]
            assert ids == list(range(len(ids))), f"worker {worker}'s ids have a gap"
            last[worker] = log.last_event_id(worker)
            assert last[worker] == len(ids) - 1
        state = replay(log, checkpoint_every=1000)
        assert state == RegistryState.from_events(events)

    # Restart: each worker's emitter resumes after its last logged event.
    with EventLog(log_url) as log:
        for worker in (0, 1):
            emitter = EventEmitter(log.append, worker_id=worker, first_event_id=last[worker] + 1)
            for i in range(10):
                emitter.removed(Tier.G1, [i])
        log.flush()
        after = list(log.read())
        assert after[: len(events)] == events
        for worker in (0, 1):
            ids = [e.event_id for e in after if e.worker_id == worker]
            assert ids == list(range(last[worker] + 11))
        assert replay(log) == RegistryState.from_events(after)
