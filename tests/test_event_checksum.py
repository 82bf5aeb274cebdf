"""Every row carries a checksum: damage never replays silently.

A flipped bit or a cut anywhere in a record is refused, by ``decode`` and by replay's chunk
decoder alike; damage to a row's other columns either changes nothing replay folds or stops
it; a damaged row stops replay naming the row and the last good position, which
``--until-position`` reaches; ``inspect --check`` lists every damaged row. Logs written before
checksums (record version 2) still replay.
"""

from __future__ import annotations

import shlex
import sqlite3
import struct
from contextlib import closing
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvledger.cli import main
from kvledger.events.codec import CodecError, decode, encode
from kvledger.events.log import EventLog
from kvledger.events.log.replay import fold_chunk, replay, replay_report
from kvledger.events.types import AnyEvent, BlockInfo, Tier
from kvledger.registry.emitter import EventEmitter
from kvledger.registry.state import RegistryState


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        self.now += 0.25
        return self.now


def workload(worker: int = 0, rounds: int = 6, first_event_id: int = 0) -> list[AnyEvent]:
    """Every record shape: stored chains with and without a parent or token ids, removals,
    copies with and without parentless blocks, a clear."""
    out: list[AnyEvent] = []
    emit = EventEmitter(out.append, worker_id=worker, first_event_id=first_event_id, clock=Clock())
    for i in range(rounds):
        base = 1000 * i + 1
        emit.stored(Tier.G1, None, [(base, base + 1), (base + 2, base + 3)])
        emit.stored(Tier.G1, base + 2, [(base + 4, base + 5)], [[7, 8, 9]])
        emit.copied(Tier.G1, Tier.G2, [BlockInfo(base, base + 1, None)])
        emit.copied(Tier.G1, Tier.G2, [BlockInfo(base + 4, base + 5, base + 2)])
        emit.removed(Tier.G1, [base, base + 4])
        emit.copied(Tier.G2, Tier.G1, [BlockInfo(base + 4, base + 5, base + 2)])
    emit.cleared(Tier.G2)
    return out


EVENTS = workload()
SHAPES = EVENTS[:7]  # one of each record shape, and the clear at the end
SHAPES.append(EVENTS[-1])


def rows_of(events: list[AnyEvent]) -> list[tuple[int, float, bytes]]:
    return [(i, e.ts, encode(e)) for i, e in enumerate(events, 1)]


def flipped(data: bytes, bit: int) -> bytes:
    damaged = bytearray(data)
    damaged[bit // 8] ^= 1 << (bit % 8)
    return bytes(damaged)


def assert_fold_refuses(rows: list[tuple[int, float, bytes]], position: int) -> None:
    """Folding ``rows`` (the chunk decoder's path, then the row-by-row one) stops at
    ``position``."""
    with pytest.raises(CodecError) as caught:
        fold_chunk(RegistryState(), rows)
    assert caught.value.position == position


@pytest.mark.parametrize("index", range(len(SHAPES)))
def test_every_bit_flip_and_cut_of_a_real_record_is_refused(index: int) -> None:
    event = SHAPES[index]
    rows = rows_of(EVENTS)
    position = EVENTS.index(event) + 1
    _, ts, data = rows[position - 1]
    assert decode(data) == event
    for bit in range(8 * len(data)):
        damaged = flipped(data, bit)
        with pytest.raises(CodecError, match=r"damaged|not a msgpack record|needs"):
            decode(damaged)
        # in a chunk of intact rows, where the array decoder checks them all at once
        assert_fold_refuses([*rows[:position - 1], (position, ts, damaged), *rows[position:]],
                            position)  # fmt: skip
    for length in range(len(data)):
        with pytest.raises(CodecError):
            decode(data[:length])
        assert_fold_refuses([*rows[: position - 1], (position, ts, data[:length])], position)


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_any_bit_flip_in_a_chunk_is_refused_at_its_row(data: st.DataObject) -> None:
    worker = data.draw(st.integers(0, 3))
    events = workload(worker, rounds=data.draw(st.integers(1, 4)))
    rows = rows_of(events)
    position = data.draw(st.integers(1, len(rows)))
    _, ts, payload = rows[position - 1]
    bit = data.draw(st.integers(0, 8 * len(payload) - 1))
    rows[position - 1] = (position, ts, flipped(payload, bit))
    assert_fold_refuses(rows, position)


# -- on a real log ------------------------------------------------------------------------------


def write_log(path: Path, events: list[AnyEvent] = EVENTS) -> str:
    url = f"sqlite:///{path}"
    with EventLog(url) as log:
        log.append_many(events)
    return url


def damage(path: Path, sql: str, *params: object) -> None:
    with closing(sqlite3.connect(path)) as conn, conn:
        conn.execute(sql, params)


def payload_at(path: Path, position: int) -> bytes:
    with closing(sqlite3.connect(path)) as conn:
        (payload,) = conn.execute("SELECT payload FROM events WHERE id = ?", (position,)).fetchone()
    return bytes(payload)


def test_damaged_row_stops_replay_naming_it_and_the_last_good_position(tmp_path: Path) -> None:
    path = tmp_path / "log.db"
    url = write_log(path)
    position = 20
    damage(path, "UPDATE events SET payload = ? WHERE id = ?",
           flipped(payload_at(path, position), 200), position)  # fmt: skip
    with pytest.raises(CodecError) as caught:
        replay(url, checkpoint_every=None)
    message = str(caught.value)
    assert message.startswith(f"event at position {position}: damaged: its checksum")
    assert f"its columns say worker 0, event {position - 1}" in message
    assert message.endswith(f"the last good row is at position {position - 1}")
    assert caught.value.last_good == position - 1
    # what comes before it replays, to exactly the state those events made
    before = replay_report(url, until_position=position - 1, checkpoint_every=None)
    assert before.state == RegistryState.from_events(EVENTS[: position - 1])
    assert before.last_position == position - 1


def test_replay_command_says_how_to_reach_the_last_good_row(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "a log.db"
    write_log(path)
    damage(path, "UPDATE events SET payload = ? WHERE id = 9", payload_at(path, 9)[:-3])
    assert main(["replay", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith("kvledger replay: error: event at position 9: ")
    command = err.split("`")[1]
    assert command == f"kvledger replay {shlex.quote(str(path))} --until-position 8"
    assert main([*shlex.split(command)[1:], "--json"]) == 0
    digest = RegistryState.from_events(EVENTS[:8]).digest()
    assert f'"digest": "{digest}"' in capsys.readouterr().out


def test_first_row_damaged_says_no_good_row_comes_before(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "log.db"
    write_log(path)
    damage(path, "UPDATE events SET payload = ? WHERE id = 1", flipped(payload_at(path, 1), 3))
    assert main(["replay", str(path)]) == 2
    err = capsys.readouterr().err
    assert "no good row comes before it" in err and "--until-position" not in err


def flip_column(path: Path, position: int, column: str, bit: int) -> bool:
    """Flip one bit of a column; False where the database refuses the result."""
    with closing(sqlite3.connect(path)) as conn:
        (value,) = conn.execute(f"SELECT {column} FROM events WHERE id = ?", (position,)).fetchone()
    if column == "ts":
        (word,) = struct.unpack("<Q", struct.pack("<d", value))
        (new,) = struct.unpack("<d", struct.pack("<Q", word ^ (1 << bit)))
        if new != new:  # NaN: SQLite would store NULL, which the column refuses
            return False
    elif column == "kind":
        raw = bytearray(value.encode())
        raw[bit % len(raw)] ^= 1 << (bit % 7)
        new = raw.decode()
    else:
        new = value ^ (1 << bit)
    try:
        damage(path, f"UPDATE events SET {column} = ? WHERE id = ?", new, position)
    except sqlite3.IntegrityError:  # another row has that (worker, event_id)
        return False
    return True


def bounded_replays(url: str, event: AnyEvent) -> list[RegistryState | str]:
    """Full replay, and replays bounded at the damaged row's event id and time."""
    out: list[RegistryState | str] = []
    bounds: list[dict[str, float]] = [
        {},
        {"until_event_id": event.event_id},
        {"until_event_id": event.event_id - 1},
        {"until_ts": event.ts},
        {"until_ts": event.ts - 0.1},
    ]
    with EventLog(url, read_only=True) as log:
        for bound in bounds:
            try:
                out.append(replay(log, use_checkpoints=False, checkpoint_every=None, **bound))  # type: ignore[arg-type]
            except ValueError as exc:
                out.append(f"error: {exc}")
    return out


@pytest.mark.parametrize("column", ["worker", "event_id", "kind", "tier", "ts"])
def test_a_flipped_column_never_gives_a_different_state(tmp_path: Path, column: str) -> None:
    """Replay reads only the record and the ts column, checked against the record: a bit
    flipped in any other column changes nothing it folds, and a damaged ts column stops it."""
    clean = tmp_path / "clean.db"
    url = write_log(clean)
    position = 17
    event = EVENTS[position - 1]
    want = bounded_replays(url, event)
    bits = range(64) if column == "ts" else range(0, 40, 3)
    for bit in bits:
        copy = tmp_path / f"{column}-{bit}.db"
        copy.write_bytes(clean.read_bytes())
        if not flip_column(copy, position, column, bit):
            continue
        for got, expected in zip(bounded_replays(f"sqlite:///{copy}", event), want, strict=True):
            if isinstance(got, str):
                assert column == "ts" and f"position {position}: damaged: its ts column" in got
            else:
                assert got == expected and got.last_event_id == expected.last_event_id  # type: ignore[union-attr]


def test_inspect_check_lists_every_damaged_row(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "log.db"
    write_log(path)
    assert main(["inspect", "--check", str(path)]) == 0
    out = capsys.readouterr().out
    assert f"check: {len(EVENTS)} rows read, {len(EVENTS)} checksums verified" in out
    assert "0 damaged" in out
    damage(path, "UPDATE events SET payload = ? WHERE id = 5", flipped(payload_at(path, 5), 77))
    damage(path, "UPDATE events SET payload = ? WHERE id = 11", payload_at(path, 11)[:30])
    damage(path, "UPDATE events SET ts = ts + 1 WHERE id = 23")
    damage(path, "UPDATE events SET kind = 'removed' WHERE id = 27")
    assert main(["inspect", "--check", str(path)]) == 1
    out = capsys.readouterr().out
    assert "4 damaged" in out and "records: version 3" in out
    lines = [line.strip() for line in out.splitlines() if line.startswith("  position ")]
    assert [line.split(":")[0] for line in lines] == [f"position {p}" for p in (5, 11, 23, 27)]
    assert "damaged: its checksum" in lines[0] and "columns say worker 0, event 4" in lines[0]
    assert "not a msgpack record" in lines[1]
    assert "ts column reads" in lines[2]
    assert "kind column reads 'removed', its record 'offloaded'" in lines[3]
    assert main(["inspect", "--check", "--json", str(path)]) == 1
    assert '"position": 23' in capsys.readouterr().out
    # a tier that is none: the summary cannot be made, the check still says where
    damage(path, "UPDATE events SET tier = -300 WHERE id = 31")
    assert main(["inspect", str(path)]) == 2
    assert "`kvledger inspect --check` lists its damaged rows" in capsys.readouterr().err
    assert main(["inspect", "--check", str(path)]) == 1
    out = capsys.readouterr().out
    assert "summary: cannot be made" in out and "5 damaged" in out
    assert "position 31: tier column reads -300, its record 1" in out


def to_version_2(path: Path) -> None:
    """Rewrite every record as the version 2 writer wrote it: without the checksum field."""
    with closing(sqlite3.connect(path)) as conn, conn:
        for position, payload in conn.execute("SELECT id, payload FROM events").fetchall():
            v2 = bytes([payload[0] - 1, 2]) + payload[2:-5]
            conn.execute("UPDATE events SET payload = ? WHERE id = ?", (v2, position))


def test_a_log_written_before_checksums_still_replays_and_says_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "v2.db"
    url = write_log(path)
    to_version_2(path)
    assert replay(url, checkpoint_every=None) == RegistryState.from_events(EVENTS)
    assert main(["inspect", str(path)]) == 0
    assert "records: version 2, written before checksums" in capsys.readouterr().out
    assert main(["inspect", "--check", str(path)]) == 0
    assert f"0 checksums verified, {len(EVENTS)} rows without one, 0 damaged" in (
        capsys.readouterr().out
    )
    # continued by this version: the newer rows carry checksums
    more = workload(rounds=1, first_event_id=len(EVENTS))
    with EventLog(url) as log:
        log.append_many(more)
    assert replay(url, checkpoint_every=None) == RegistryState.from_events([*EVENTS, *more])
    assert main(["inspect", str(path)]) == 0
    assert "records: versions 2 then 3" in capsys.readouterr().out


def test_version_1_records_are_still_refused(tmp_path: Path) -> None:
    path = tmp_path / "v1.db"
    url = write_log(path)
    to_version_2(path)
    v2 = payload_at(path, 3)
    damage(path, "UPDATE events SET payload = ? WHERE id = 3", v2[:1] + b"\x01" + v2[2:])
    with pytest.raises(CodecError, match="position 3: record version 1 is not supported"):
        replay(url, checkpoint_every=None)


def test_a_damaged_checkpoint_is_not_used(tmp_path: Path) -> None:
    path = tmp_path / "log.db"
    url = write_log(path)
    assert replay_report(url, checkpoint_every=10).checkpoints_written
    with closing(sqlite3.connect(path)) as conn, conn:
        for position, snapshot in conn.execute("SELECT id, snapshot FROM checkpoints").fetchall():
            damaged = flipped(snapshot, 8 * len(snapshot) - 60)  # inside the last tier's bins
            conn.execute("UPDATE checkpoints SET snapshot = ? WHERE id = ?", (damaged, position))
    with pytest.warns(UserWarning, match="ignoring the newest checkpoint.*snapshot damaged"):
        report = replay_report(url, checkpoint_every=None)
    assert report.start_position == 0
    assert report.state == RegistryState.from_events(EVENTS)
