"""What a log row holding a run of records, instead of one record, would buy the log: a probe
for the plan, measured on the same rows as ``eventlog_bench.py``'s references, in one process.

The log writes one row per event today. Its append and replay targets (0.9 and 0.8 of raw
sqlite3 on one-row-per-event rows) are out of reach in that layout, because the reference
itself is the per-row cost that an append pays on top of encoding (``to_row``) and a replay
pays on top of decoding and folding. This probe measures each part:

- ``to_row``: the producer's encode, the same in either layout;
- raw ``executemany`` of one row per event (``eventlog_bench.py``'s append reference), and of
  one row per ``--run`` consecutive records (each record behind a 4-byte length), plus the
  join that builds those rows;
- raw ``SELECT`` + ``msgpack.unpackb`` of one row per event (the replay reference), and the
  fetch of the run rows with one ``zlib.crc32`` over each row and the split into records;
- ``fold_chunk`` over the per-event rows in memory (decode, verify, fold: the same work on the
  records whatever row holds them).

It prints each part per event and two projections, each the sum of its serial parts against
the same run's reference (the writer's work overlapping the producer's would only lower the
sum). Every figure is the best of ``--repeat`` rounds, the rounds interleaved. Nothing of the
log's code changes here: the layout is written with plain sqlite3.

    .venv/bin/python bench/row_layout_probe.py [--events 200000] [--run 512] [--repeat 3]
"""

from __future__ import annotations

import argparse
import sqlite3
import struct
import tempfile
import time
import zlib
from collections.abc import Callable
from pathlib import Path

from eventlog_bench import BATCH, raw_append, raw_read, workload

from kvledger.events.log.replay import fold_chunk
from kvledger.events.log.rows import Row, to_row
from kvledger.registry.state import RegistryState

RUN_DDL = """
CREATE TABLE events (
    id INTEGER PRIMARY KEY AUTOINCREMENT, worker BIGINT NOT NULL, event_id BIGINT NOT NULL,
    last_event_id BIGINT NOT NULL, ts FLOAT NOT NULL, payload BLOB NOT NULL,
    CONSTRAINT uq_events_worker_event_id UNIQUE (worker, event_id))
"""
RUN_INSERT = "INSERT INTO events (worker, event_id, last_event_id, ts, payload) VALUES (?,?,?,?,?)"
RunRow = tuple[int, int, int, float, bytes]
_LENGTH = struct.Struct("<I")


def run_rows(rows: list[Row], run: int) -> list[RunRow]:
    """One row per ``run`` consecutive records (one worker here): each record behind its
    length, the row keyed by its first and last event id, stamped with its first record's ts."""
    pack = _LENGTH.pack
    out = []
    for start in range(0, len(rows), run):
        part = rows[start : start + run]
        blob = b"".join([pack(len(r[5])) + r[5] for r in part])
        out.append((part[0][0], part[0][1], part[-1][1], part[0][4], blob))
    return out


def split(blob: bytes) -> list[bytes]:
    """The records of a run row."""
    out, at, end = [], 0, len(blob)
    unpack = _LENGTH.unpack_from
    while at < end:
        (size,) = unpack(blob, at)
        out.append(blob[at + 4 : at + 4 + size])
        at += 4 + size
    return out


def read_runs(path: Path) -> float:
    conn = sqlite3.connect(path)
    crc32 = zlib.crc32
    start = time.perf_counter()
    for _id, _ts, payload in conn.execute("SELECT id, ts, payload FROM events ORDER BY id"):
        crc32(payload)
        split(payload)
    elapsed = time.perf_counter() - start
    conn.close()
    return elapsed


def fold(rows: list[tuple[int, float, bytes]]) -> float:
    state = RegistryState()
    start = time.perf_counter()
    for at in range(0, len(rows), BATCH):
        fold_chunk(state, rows[at : at + BATCH])
    return time.perf_counter() - start


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--events", type=int, default=200_000)
    p.add_argument("--run", type=int, default=512, help="records per row in the run layout")
    p.add_argument("--repeat", type=int, default=3)
    args = p.parse_args()

    events = workload(args.events)
    rows = [to_row(e) for e in events]
    memory = [(i + 1, r[4], r[5]) for i, r in enumerate(rows)]
    best: dict[str, float] = {}

    def keep(name: str, seconds: float) -> None:
        best[name] = min(best.get(name, seconds), seconds)

    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(args.repeat):
            per_event = Path(tmp) / f"per-event-{round_}.db"
            runs = Path(tmp) / f"runs-{round_}.db"
            keep("to_row", timed(lambda: [to_row(e) for e in events]))
            keep("write per event", raw_append(per_event, rows))
            start = time.perf_counter()
            grouped = run_rows(rows, args.run)
            keep("join", time.perf_counter() - start)
            per_commit = max(1, BATCH // args.run)
            keep("write runs", raw_append(runs, grouped, RUN_DDL, RUN_INSERT, per_commit))
            keep("read per event", raw_read(per_event))
            keep("read runs", read_runs(runs))
            keep("fold", fold(memory))

    n = len(rows)

    def us(name: str) -> float:
        return best[name] / n * 1e6

    size = sum(len(r[5]) for r in rows) / n
    print(
        f"events: {n:,} ({size:.0f} bytes a record), {args.run} records a run row, "
        f"WAL, synchronous=NORMAL, best of {args.repeat}"
    )
    for name, label in (
        ("to_row", "encode (to_row), either layout"),
        ("write per event", "raw executemany, one row an event (reference)"),
        ("join", "building the run rows"),
        ("write runs", "raw executemany, one row a run"),
        ("read per event", "raw SELECT + unpackb, one row an event (reference)"),
        ("read runs", "SELECT run rows + crc32 a row + split"),
        ("fold", "decode + verify + fold, either layout"),
    ):
        print(f"  {label:<54} {us(name):6.2f} us an event")
    append_now = us("to_row") + us("write per event")
    append_runs = us("to_row") + us("join") + us("write runs")
    replay_runs = us("read runs") + us("fold")
    print(
        f"append, serial sum / reference: one row an event {us('write per event') / append_now:.2f}"
        f", one row a run {us('write per event') / append_runs:.2f}"
    )
    print(
        f"replay, serial sum / reference: one row a run "
        f"{us('read per event') / replay_runs:.2f} (eventlog_bench.py measures today's layout)"
    )


if __name__ == "__main__":
    main()
