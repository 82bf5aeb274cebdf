"""Replay reads only what it needs, and trusts a checkpoint row only as far as its checksum.

- ``until_event_id`` stops reading at the last row that can hold an event within the bound
  (each worker's ids grow with the position, so no later row can), not at the log's end;
- a checkpoint row's position, max_event_id and max_ts columns are repeated inside its
  checksummed snapshot: a row whose columns were changed is refused (replay warns and folds
  the rows instead), where before it was trusted and replay started at the wrong place.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest
import sqlalchemy as sa

from kvledger.events.log import EventLog
from kvledger.events.log.replay import replay, replay_report
from kvledger.events.log.schema import checkpoints
from kvledger.events.types import Tier
from kvledger.registry.emitter import EventEmitter
from kvledger.registry.state import RegistryState


def write_two_workers(url: str, events_each: int, seed: int = 3) -> None:
    """Two workers' stores and removals, interleaved at random, into a fresh log."""
    rng = random.Random(seed)
    with EventLog(url) as log:
        emitters = [EventEmitter(log.append, worker_id=w) for w in (0, 1)]
        resident: list[list[int]] = [[], []]
        counts = [0, 0]
        while min(counts) < events_each:
            w = rng.randrange(2) if max(counts) < events_each else counts.index(min(counts))
            if resident[w] and rng.random() < 0.3:
                gone = resident[w].pop(rng.randrange(len(resident[w])))
                emitters[w].removed(Tier.G1, [gone])
            else:
                seq = rng.getrandbits(63)
                resident[w].append(seq)
                emitters[w].stored(Tier.G1, None, [(seq, rng.getrandbits(63))])
            counts[w] += 1


def rows_of(url: str) -> list[tuple[int, int, int]]:
    """(position, worker, event_id) of every row, in order."""
    db = sa.create_engine(url)
    try:
        with db.connect() as conn:
            result = conn.exec_driver_sql("SELECT id, worker, event_id FROM events ORDER BY id")
            return [(int(p), int(w), int(e)) for p, w, e in result]
    finally:
        db.dispose()


def expected_state(url: str, until: int | None, until_ts: float | None = None) -> RegistryState:
    with EventLog(url, read_only=True) as log:
        return replay(
            log,
            until_event_id=until,
            until_ts=until_ts,
            use_checkpoints=False,
            checkpoint_every=None,
        )


@pytest.mark.parametrize("until", [0, 7, 40, 79])
def test_until_event_id_stops_reading_at_its_bound(
    new_log_url: Callable[[], str], until: int
) -> None:
    url = new_log_url()
    write_two_workers(url, 80)
    rows = rows_of(url)
    # the last row that holds an event within the bound; every later row is beyond it
    bound = max(p for p, _w, e in rows if e <= until)
    assert bound < rows[-1][0] or until == 79
    with EventLog(url, read_only=True) as log:
        report = replay_report(log, until_event_id=until, use_checkpoints=False)
    assert report.last_position == bound
    assert report.rows_folded == sum(1 for p, _w, _e in rows if p <= bound)
    assert report.state == expected_state(url, until)
    assert report.state.last_event_id == {0: until, 1: until}


def test_until_event_id_through_a_checkpoint(new_log_url: Callable[[], str]) -> None:
    """From a checkpoint before the bound, replay still stops at it."""
    url = new_log_url()
    write_two_workers(url, 80)
    rows = rows_of(url)
    with EventLog(url) as log:
        replay(log, checkpoint_every=20)  # checkpoints every 20 rows
        report = replay_report(log, until_event_id=60)
    assert report.start_position > 0  # it started from a checkpoint
    assert report.last_position == max(p for p, _w, e in rows if e <= 60)
    assert report.state == expected_state(url, 60)


@pytest.mark.parametrize(
    ("column", "change"),
    [
        ("position", lambda v: v + 17),  # would skip rows the snapshot does not hold
        ("max_event_id", lambda v: 3),  # would be taken for an --until it does not meet
        ("max_ts", lambda v: v - 1000.0),  # would be taken for an --until-ts it does not meet
    ],
)
def test_a_checkpoint_row_whose_columns_changed_is_refused(
    new_log_url: Callable[[], str], column: str, change: Callable[[float], float]
) -> None:
    url = new_log_url()
    write_two_workers(url, 60)
    with EventLog(url) as log:
        replay(log, checkpoint_every=50)
    db = sa.create_engine(url)
    try:
        with db.begin() as conn:
            position, value = conn.execute(
                sa.select(checkpoints.c.position, checkpoints.c[column])
                .order_by(checkpoints.c.position)
                .limit(1)
            ).one()
            conn.execute(checkpoints.delete().where(checkpoints.c.position != position))
            conn.execute(
                checkpoints.update()
                .where(checkpoints.c.position == position)
                .values({column: change(value)})
            )
    finally:
        db.dispose()
    with EventLog(url, read_only=True) as log, pytest.warns(UserWarning, match="differ from"):
        if column == "max_event_id":
            state = replay(log, until_event_id=3, checkpoint_every=None)
            assert state == expected_state(url, 3)
        elif column == "max_ts":
            with EventLog(url, read_only=True) as other:
                first_ts = next(iter(other.read())).ts
            state = replay(log, until_ts=first_ts, checkpoint_every=None)
            assert state == expected_state(url, None, until_ts=first_ts)
            assert sum(state.last_event_id.values()) < 10  # not the checkpoint's 50 rows
        else:
            state = replay(log, checkpoint_every=None)
            assert state == expected_state(url, None)


def test_a_damaged_event_id_column_cannot_stop_the_read_early(
    new_log_url: Callable[[], str],
) -> None:
    """The columns only say where to stop: a row whose ``event_id`` column was changed past
    the bound would end the read before it, and the records then show a worker short of the
    id the columns promised, so replay reads on."""
    url = new_log_url()
    write_two_workers(url, 80)
    rows = rows_of(url)
    # worker 0's event 40: its column now says 900, as if it were beyond the bound
    position = next(p for p, w, e in rows if (w, e) == (0, 40))
    db = sa.create_engine(url)
    try:
        with db.begin() as conn:
            conn.exec_driver_sql(f"UPDATE events SET event_id = 900 WHERE id = {position}")
    finally:
        db.dispose()
    with EventLog(url, read_only=True) as log:
        report = replay_report(log, until_event_id=40, use_checkpoints=False)
    assert report.state.last_event_id == {0: 40, 1: 40}
