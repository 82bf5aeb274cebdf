"""Flip single bits in a copy of an event log and count what replay makes of each flip.

Each trial copies the log, flips one random bit (in a random row's payload, or with
``--columns`` in one of the row's other columns: worker, event_id, kind, tier, ts), replays the
copy from scratch and sorts the outcome: *caught* (replay stopped with an error), *same state*
(the flip changed nothing replay reads) or *silently different* (replay finished without an
error on a state that differs from the undamaged log's). The last is the one that must never
happen.

    .venv/bin/kvledger simulate --requests 300 --log sqlite:///kvledger-data/probe.db
    .venv/bin/python bench/damage_probe.py kvledger-data/probe.db [--trials 40] [--columns]
"""

from __future__ import annotations

import argparse
import random
import shutil
import sqlite3
import struct
import tempfile
from collections import Counter
from contextlib import closing
from pathlib import Path

from kvledger.events.log.replay import replay

COLUMNS = ("worker", "event_id", "kind", "tier", "ts")


def flip_payload(conn: sqlite3.Connection, position: int, rng: random.Random) -> str:
    (payload,) = conn.execute("SELECT payload FROM events WHERE id = ?", (position,)).fetchone()
    bit = rng.randrange(8 * len(payload))
    damaged = bytearray(payload)
    damaged[bit // 8] ^= 1 << (bit % 8)
    conn.execute("UPDATE events SET payload = ? WHERE id = ?", (bytes(damaged), position))
    return f"payload bit {bit}"


def flip_column(conn: sqlite3.Connection, position: int, rng: random.Random) -> str:
    column = rng.choice(COLUMNS)
    (value,) = conn.execute(f"SELECT {column} FROM events WHERE id = ?", (position,)).fetchone()
    if column == "kind":
        raw = bytearray(value.encode())
        bit = rng.randrange(7 * len(raw))  # stay in ASCII
        raw[bit // 7] ^= 1 << (bit % 7)
        new: object = raw.decode()
    elif column == "ts":
        bit = rng.randrange(64)
        (word,) = struct.unpack("<Q", struct.pack("<d", value))
        (new,) = struct.unpack("<d", struct.pack("<Q", word ^ (1 << bit)))
    else:
        bit = rng.randrange(16)
        new = value ^ (1 << bit)
    conn.execute(f"UPDATE events SET {column} = ? WHERE id = ?", (new, position))
    return f"{column} bit {bit}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("log", type=Path, help="a SQLite event log (left untouched)")
    parser.add_argument("--trials", type=int, default=40)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--columns", action="store_true", help="flip bits outside the payload")
    args = parser.parse_args()
    rng = random.Random(args.seed)
    reference = replay(f"sqlite:///{args.log}", use_checkpoints=False, checkpoint_every=None)
    with closing(sqlite3.connect(args.log)) as conn:
        (rows,) = conn.execute("SELECT max(id) FROM events").fetchone()
    outcomes: Counter[str] = Counter()
    silent: list[str] = []
    with tempfile.TemporaryDirectory() as tmp:
        for trial in range(args.trials):
            copy = Path(tmp) / f"damaged-{trial}.db"  # a fresh name: no stale -wal file
            shutil.copy(args.log, copy)
            position = rng.randint(1, rows)
            flip = flip_column if args.columns else flip_payload
            try:
                with closing(sqlite3.connect(copy)) as conn, conn:
                    what = flip(conn, position, rng)
            except sqlite3.IntegrityError:  # a worker/event_id pair that already exists
                outcomes["refused by the database"] += 1
                continue
            try:
                state = replay(f"sqlite:///{copy}", use_checkpoints=False, checkpoint_every=None)
            except ValueError:
                outcomes["caught"] += 1
            else:
                if state == reference and state.last_event_id == reference.last_event_id:
                    outcomes["same state"] += 1
                else:
                    outcomes["silently different"] += 1
                    silent.append(f"row {position} {what}")
    where = "columns" if args.columns else "payloads"
    print(f"{args.trials} single-bit flips in {where} of {args.log} ({rows} rows):")
    for outcome in ("caught", "refused by the database", "same state", "silently different"):
        print(f"  {outcome:<20} {outcomes[outcome]}")
    for line in silent[:10]:
        print(f"    {line}")


if __name__ == "__main__":
    main()
