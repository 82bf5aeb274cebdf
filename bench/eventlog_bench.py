"""Event-log throughput against raw sqlite3 on the same rows, same file system, same run.

Append: our EventLog (encode + queue + group-committed writer) against raw
``sqlite3.executemany`` of the already-encoded msgpack rows, in batches of 10k, WAL mode,
same table; one more line appends one by one at the interpreter switch interval kvledger's own
processes run at (``kvledger.cli.CLI_SWITCH_INTERVAL_S``, 0.5 ms; the ``switch_interval_s``
setting in an engine's process) instead of Python's 5 ms, under which the writer thread waits
for the GIL that the appending thread holds. Replay: read + decode + fold into a RegistryState
against raw ``SELECT`` + ``msgpack.unpackb`` of the same rows; one more line adds turning the
replayed state's arrays into per-block dicts (``RegistryState.tiers``). Each figure is the best of
--repeat rounds, each round running every measure once.

Lag under load: a producer that never sleeps (it spins between appends, as an engine's loop
does) appends at ``--rate`` events/s, the rate of ``kvledger simulate --engine on`` on the
mooncake conversation trace, for ``--lag-seconds``; each event's commit lag (append to the
commit that holds it) is printed as p50/p99/max against the configured ``max_delay``, with the
deepest backlog against ``queue_size`` and the back-pressure waits. Then ``--kills`` child
processes doing the same are SIGKILLed at random moments: the events each loses, and the span
of append time they cover against the bound ``max_lag``.

A long log (with ``--long N``, e.g. 10,000,000): N events written straight into a log file
(the workload's first 100k events over and over, ids renumbered, each record re-checksummed),
then replayed whole in a fresh process that prints the replay's time and its peak memory
(``ru_maxrss``) against the same process's before the replay. Replay streams the log in
chunks of 10k rows into the registry's arrays: its time grows with the log, its memory with
the registry's live blocks (bounded by the workload's pool), not with the log.

PostgreSQL (with ``--pg-url``, a server's database): our EventLog, appending one by one and
in 10k batches (its writer COPYs each batch), and the asyncio log (``AsyncEventLog``) in 10k
batches, against raw psycopg ``executemany`` of the pre-encoded rows in batches of 10k, each
batch committed, into the same table; every round in fresh schemas.

    .venv/bin/python bench/eventlog_bench.py [--events 200000] [--repeat 3] [--dir DIR]
        [--rate 15000] [--lag-seconds 5] [--kills 5]
        [--pg-url postgresql+psycopg://postgres@127.0.0.1:5432/test]
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import mmap
import os
import random
import resource
import shutil
import signal
import sqlite3
import struct
import subprocess
import sys
import tempfile
import time
import uuid
import zlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgpack

from kvledger.cli import CLI_SWITCH_INTERVAL_S
from kvledger.events.log import AsyncEventLog, EventLog
from kvledger.events.log.replay import replay, replay_report
from kvledger.events.log.rows import to_row
from kvledger.events.types import BlockInfo, LogRecord, Lookup, Released, RunInfo, Tier
from kvledger.registry.emitter import EventEmitter
from kvledger.registry.lookups import LookupRecorder

BATCH = 10_000
ENGINE_ON_RATE = 15_000
"""Events/s that ``kvledger simulate --engine on --g2-blocks 8192 --g3-blocks 32768`` appends
on the mooncake conversation trace (96,093 events in its first 6.6 s on the 2-core VM)."""


def workload(
    n_events: int, seed: int = 7, block_tokens: int = 0, lookups: bool = False
) -> list[LogRecord]:
    """A mocker-like mix: sequences stored in 1-4 block runs, evictions, offloads to G2.

    With ``block_tokens``, stored events carry that many token ids per block, as an engine's
    do (vLLM's BlockStored has them). With ``lookups``, each stored run is a request's: its
    lookup record (a cached prefix of 0-8 blocks and the stored ones) comes before it and its
    release after, as ``log_lookups`` writes them."""
    rng = random.Random(seed)
    out: list[LogRecord] = []
    emitter = EventEmitter(out.append, worker_id=0)
    recorder = LookupRecorder(out.append, worker_id=0)
    request = 0
    resident: list[BlockInfo] = []
    parent: int | None = None
    while len(out) < n_events:
        roll = rng.random()
        if roll < 0.55 or len(resident) < 8:
            if rng.random() < 0.2:
                parent = None
            blocks = []
            for _ in range(rng.randint(1, 4)):
                seq, local = rng.getrandbits(64), rng.getrandbits(64)
                blocks.append((seq, local))
                resident.append(BlockInfo(seq, local, parent))
                parent = seq
            tokens = None
            if block_tokens:
                tokens = [[rng.randrange(150_000) for _ in range(block_tokens)] for _ in blocks]
            if lookups:
                cached = [rng.getrandbits(64) for _ in range(rng.randint(0, 8))]
                asked = cached + [seq for seq, _ in blocks]
                recorder.lookup(request, asked, (len(cached), 0, 0), num_tokens=16 * len(asked))
            emitter.stored(Tier.G1, resident[-len(blocks)].parent_hash, blocks, tokens)
            if lookups:
                recorder.released(request)
                request += 1
        elif roll < 0.85:
            gone = [resident.pop(rng.randrange(len(resident))) for _ in range(rng.randint(1, 3))]
            emitter.removed(Tier.G1, [b.sequence_hash for b in gone])
        else:
            emitter.copied(Tier.G1, Tier.G2, rng.sample(resident, rng.randint(1, 3)))
    return out[:n_events]


RAW_DDL = """
CREATE TABLE events (
    id INTEGER PRIMARY KEY AUTOINCREMENT, worker BIGINT NOT NULL, event_id BIGINT NOT NULL,
    kind VARCHAR(16) NOT NULL, tier SMALLINT NOT NULL, ts FLOAT NOT NULL, payload BLOB NOT NULL,
    CONSTRAINT uq_events_worker_event_id UNIQUE (worker, event_id))
"""


RAW_INSERT = "INSERT INTO events (worker, event_id, kind, tier, ts, payload) VALUES (?,?,?,?,?,?)"


def raw_append(
    path: Path,
    rows: Sequence[tuple[object, ...]],
    ddl: str = RAW_DDL,
    sql: str = RAW_INSERT,
    batch: int = BATCH,
) -> float:
    """Seconds to ``executemany`` ``rows`` into a fresh WAL file, ``batch`` rows a commit
    (another table with ``ddl`` and ``sql``: ``row_layout_probe.py``'s run rows)."""
    conn = sqlite3.connect(path)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=NORMAL")
    conn.execute(ddl)
    conn.commit()
    t0 = time.perf_counter()
    for start in range(0, len(rows), batch):
        conn.executemany(sql, rows[start : start + batch])
        conn.commit()
    elapsed = time.perf_counter() - t0
    conn.close()
    return elapsed


def raw_read(path: Path) -> float:
    conn = sqlite3.connect(path)
    t0 = time.perf_counter()
    unpackb = msgpack.unpackb
    for _id, _ts, payload in conn.execute("SELECT id, ts, payload FROM events ORDER BY id"):
        unpackb(payload, use_list=False)
    elapsed = time.perf_counter() - t0
    conn.close()
    return elapsed


def our_append(path: Path | str, events: list[LogRecord]) -> float:
    log = EventLog(str(path), batch_size=BATCH)
    append = log.append
    t0 = time.perf_counter()
    for event in events:
        append(event)
    log.close()
    return time.perf_counter() - t0


def our_append_switching(path: Path | str, events: list[LogRecord], interval: float) -> float:
    """``our_append`` with the interpreter's switch interval at ``interval`` seconds."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(interval)
    try:
        return our_append(path, events)
    finally:
        sys.setswitchinterval(before)


def our_append_many(path: Path | str, events: list[LogRecord]) -> float:
    log = EventLog(str(path), batch_size=BATCH)
    t0 = time.perf_counter()
    for start in range(0, len(events), BATCH):
        log.append_many(events[start : start + BATCH])
    log.close()
    return time.perf_counter() - t0


def our_async_append_many(url: str, events: list[LogRecord]) -> float:
    """``AsyncEventLog.append_many`` in batches of ``BATCH`` on a loop of its own, until its
    close has committed the last."""

    async def run() -> float:
        log = await AsyncEventLog(url, batch_size=BATCH).open()
        t0 = time.perf_counter()
        for start in range(0, len(events), BATCH):
            await log.append_many(events[start : start + BATCH])
        await log.close()
        return time.perf_counter() - t0

    return asyncio.run(run())


def our_replay(path: Path, last_id: int, *, as_dicts: bool = False) -> float:
    """Replay as ``kvledger replay`` runs it; with ``as_dicts``, also turn the state's arrays
    into the per-block dicts that ``RegistryState.tiers`` hands out."""
    with EventLog(str(path), read_only=True) as log:
        t0 = time.perf_counter()
        state = replay(log, use_checkpoints=False, checkpoint_every=None)
        if as_dicts:
            state.tiers  # noqa: B018 (the property builds the dicts)
        elapsed = time.perf_counter() - t0
    assert state.last_event_id[0] == last_id
    return elapsed


# -- a long log ------------------------------------------------------------------------------

_EVENT_ID = struct.Struct(">Q")
_CRC = struct.Struct("<I")


def long_log(path: Path, n_events: int) -> None:
    """``n_events`` events into a fresh log file: the workload's first 100k over and over,
    each copy's ids moved on and its records re-checksummed (the hashes repeat, so the
    registry's live set stays the workload's)."""
    base = [to_row(e) for e in workload(min(n_events, 100_000))]
    EventLog(str(path)).close()  # the schema
    conn = sqlite3.connect(path)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=NORMAL")
    sql = "INSERT INTO events (worker, event_id, kind, tier, ts, payload) VALUES (?,?,?,?,?,?)"
    for start in range(0, n_events, len(base)):
        rows = []
        for worker, event_id, kind, tier, ts, payload in base[: n_events - start]:
            moved = event_id + start
            # the event id sits at bytes 13-20 of a record (codec's fixed-width header)
            data = payload[:13] + _EVENT_ID.pack(moved) + payload[21:-4]
            rows.append((worker, moved, kind, tier, ts, data + _CRC.pack(zlib.crc32(data))))
        conn.executemany(sql, rows)
        conn.commit()
    conn.close()


def replay_child(path: str) -> None:
    """Replay ``path`` whole; print the seconds, events, and peak RSS before and after."""
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with EventLog(path, read_only=True) as log:
        t0 = time.perf_counter()
        report = replay_report(log, use_checkpoints=False, checkpoint_every=None)
        elapsed = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    blocks = sum(report.state.counts().values())
    print(f"{elapsed} {report.events} {before} {after} {blocks}")


def long_replay(work: Path, n_events: int) -> str:
    path = work / "long.db"
    t0 = time.perf_counter()
    long_log(path, n_events)
    written = time.perf_counter() - t0
    out = subprocess.run(
        [sys.executable, __file__, "--replay-child", str(path)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    elapsed, events, before, after, blocks = float(out[0]), int(out[1]), *map(int, out[2:])
    size = path.stat().st_size
    return (
        f"long log: {events:,} events ({size / 2**30:.2f} GiB, written in {written:.0f} s): "
        f"replay {elapsed:.1f} s ({events / elapsed / 1e6:.2f} M events/s), peak RSS "
        f"{after / 1024:.0f} MiB ({before / 1024:.0f} MiB before the replay; {blocks:,} live "
        f"blocks at the end)"
    )


# -- PostgreSQL -------------------------------------------------------------------------------

PG_DDL = """
CREATE TABLE events (
    id BIGSERIAL PRIMARY KEY, worker BIGINT NOT NULL, event_id BIGINT NOT NULL,
    kind VARCHAR(16) NOT NULL, tier SMALLINT NOT NULL, ts DOUBLE PRECISION NOT NULL,
    payload BYTEA NOT NULL, CONSTRAINT uq_events_worker_event_id UNIQUE (worker, event_id))
"""


def _pg_connect(url: str) -> Any:
    import psycopg  # only with --pg-url: the light install has no driver

    return psycopg.connect(url.replace("postgresql+psycopg://", "postgresql://"))


def pg_schema(url: str) -> tuple[str, str]:
    """A fresh schema on the server: its name and a URL whose search_path is it."""
    schema = f"bench_{uuid.uuid4().hex[:12]}"
    with _pg_connect(url) as conn:
        conn.execute(f'CREATE SCHEMA "{schema}"')
    return schema, f"{url}?options=-csearch_path%3D{schema}"


def pg_drop(url: str, schemas: list[str]) -> None:
    with _pg_connect(url) as conn:
        for schema in schemas:
            conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


def pg_raw_append(
    url: str, schema: str, rows: list[tuple[int, int, str, int, float, bytes]]
) -> float:
    conn = _pg_connect(url)
    conn.execute(f'SET search_path TO "{schema}"')
    conn.execute(PG_DDL)
    conn.commit()
    sql = (
        "INSERT INTO events (worker, event_id, kind, tier, ts, payload) VALUES (%s,%s,%s,%s,%s,%s)"
    )
    t0 = time.perf_counter()
    with conn.cursor() as cursor:
        for start in range(0, len(rows), BATCH):
            cursor.executemany(sql, rows[start : start + BATCH])
            conn.commit()
    elapsed = time.perf_counter() - t0
    conn.close()
    return elapsed


def pg_rounds(
    url: str, rows: list[Any], events: list[LogRecord], repeat: int
) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {}
    schemas: list[str] = []
    try:
        for _ in range(repeat):
            made = [pg_schema(url) for _ in range(4)]
            schemas += [schema for schema, _ in made]
            round_ = {
                "pg_raw": pg_raw_append(url, made[0][0], rows),
                "pg_one": our_append(made[1][1], events),
                "pg_many": our_append_many(made[2][1], events),
                "pg_async": our_async_append_many(made[3][1], events),
            }
            for name, seconds in round_.items():
                times.setdefault(name, []).append(seconds)
    finally:
        pg_drop(url, schemas)
    return times


# -- lag under load ---------------------------------------------------------------------------


def paced(log: EventLog, events: list[LogRecord], rate: float, seconds: float) -> list[float]:
    """Append ``events`` at ``rate``/s for up to ``seconds``, spinning (never sleeping) between
    appends; returns each appended event's time (``time.monotonic()`` after its append)."""
    clock = time.monotonic
    append = log.append
    appended: list[float] = []
    start = clock()
    for i, event in enumerate(events):
        due = start + i / rate
        while clock() < due:
            pass
        append(event)
        appended.append(clock())
        if appended[-1] - start > seconds:
            break
    return appended


def lag_under_load(path: Path, events: list[LogRecord], rate: float, seconds: float) -> str:
    log = EventLog(str(path))
    depths: list[int] = []
    original = log.append

    def append(event: LogRecord) -> None:
        original(event)
        depths.append(log.queue_depth)

    log.append = append  # type: ignore[method-assign]
    appended = paced(log, events, rate, seconds)
    log.flush()
    commits = list(log.commit_times)
    waits, waited = log.backpressure_waits, log.backpressure_seconds
    log.close()
    counts = [n for n, _ in commits]
    lags = sorted(commits[bisect.bisect_left(counts, i + 1)][1] - t for i, t in enumerate(appended))
    got = len(appended) / (appended[-1] - appended[0])

    def ms(q: float) -> str:
        return f"{lags[min(len(lags) - 1, int(q * len(lags)))] * 1000:.0f}"

    return (
        f"lag under load: {got:,.0f} events/s for {len(appended):,} events: commit lag p50 "
        f"{ms(0.5)} ms, p99 {ms(0.99)} ms, max {lags[-1] * 1000:.0f} ms (max_delay "
        f"{log.max_delay * 1000:.0f} ms); queue max {max(depths):,} / {log.queue_size:,}; "
        f"back-pressure {waits} waits, {waited:.2f} s"
    )


HEADER = struct.Struct("<q")
TIMES = struct.Struct("<dd")


def child(url: str, shared: str, rate: float, n_events: int) -> None:
    """A producer to kill: appends at ``rate``/s; after each append it writes the append's
    start and end times, then the count appended, into ``shared``."""
    events = workload(n_events)
    with open(shared, "r+b") as f:
        m = mmap.mmap(f.fileno(), 0)
    log = EventLog(url)
    clock = time.monotonic
    print("started", flush=True)
    start = clock()
    for i, event in enumerate(events):
        due = start + i / rate
        while clock() < due:
            pass
        before = clock()
        log.append(event)
        TIMES.pack_into(m, HEADER.size + TIMES.size * i, before, clock())
        HEADER.pack_into(m, 0, i + 1)
    time.sleep(3600)


def kill_at_random(work: Path, rate: float, kills: int, n_events: int) -> str:
    rng = random.Random()
    lost: list[int] = []
    spans: list[float] = []
    for k in range(kills):
        db = work / f"kill-{k}.db"
        EventLog(str(db)).close()
        shared = work / f"kill-{k}.bin"
        with open(shared, "wb") as f:
            f.truncate(HEADER.size + TIMES.size * n_events)
        proc = subprocess.Popen(
            [sys.executable, __file__, "--child", str(db), str(shared), str(rate), str(n_events)],
            stdout=subprocess.PIPE,
        )
        assert proc.stdout is not None and proc.stdout.readline().strip() == b"started"
        time.sleep(rng.uniform(1.0, 3.0))
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        with open(shared, "rb") as f:
            m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        (appended,) = HEADER.unpack_from(m, 0)
        with sqlite3.connect(db) as conn:
            (committed,) = conn.execute("SELECT count(*) FROM events").fetchone()
        lost.append(max(0, appended - committed))
        span = 0.0
        if appended > committed:
            _, first_done = TIMES.unpack_from(m, HEADER.size + TIMES.size * committed)
            last_start, _ = TIMES.unpack_from(m, HEADER.size + TIMES.size * (appended - 1))
            span = last_start - first_done
        spans.append(span)
        m.close()
    with EventLog(str(work / "bound.db")) as log:
        bound = log.max_lag or 0.0
    return (
        f"SIGKILL x{kills} at random moments: events lost {', '.join(map(str, lost))} "
        f"(appended over at most {max(spans) * 1000:.0f} ms; bound max_lag {bound * 1000:.0f} ms)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=200_000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--dir", default="kvledger-data", help="where the bench files go")
    parser.add_argument(
        "--block-tokens", type=int, default=0, help="token ids per stored block (default none)"
    )
    parser.add_argument(
        "--rate", type=float, default=ENGINE_ON_RATE, help="lag under load: events/s appended"
    )
    parser.add_argument("--lag-seconds", type=float, default=5.0, help="lag under load: length")
    parser.add_argument("--kills", type=int, default=5, help="SIGKILLed producers (0: none)")
    parser.add_argument(
        "--lookups", action="store_true", help="a lookup and a release record per stored run"
    )
    parser.add_argument(
        "--pg-url", help="also measure on this PostgreSQL database (postgresql+psycopg://...)"
    )
    parser.add_argument(
        "--long", type=int, default=0, help="also replay a log of this many events (0: none)"
    )
    parser.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    parser.add_argument("--replay-child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.replay_child:
        replay_child(args.replay_child)
        return
    if args.child:
        url, shared, rate, n_events = args.child
        child(url, shared, float(rate), int(n_events))
        return
    n = args.events
    events = workload(n, block_tokens=args.block_tokens, lookups=args.lookups)
    rows = [to_row(e) for e in events]
    lookup_rows = sum(isinstance(e, Lookup | Released | RunInfo) for e in events)
    last_id = n - lookup_rows - 1
    Path(args.dir).mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="eventlog-bench-", dir=args.dir))
    try:

        def fresh(name: str, i: int) -> Path:
            return work / f"{name}-{i}.db"

        # Rounds interleave every measure, so that a slow spell of the shared machine hits
        # both sides of a ratio instead of one side's runs.
        times: dict[str, list[float]] = {}
        for i in range(args.repeat):
            round_ = {  # measured in this order
                "raw_a": raw_append(fresh("raw", i), rows),
                "ours_a": our_append(fresh("ours", i), events),
                "ours_s": our_append_switching(fresh("switch", i), events, CLI_SWITCH_INTERVAL_S),
                "ours_m": our_append_many(fresh("many", i), events),
                "raw_r": raw_read(fresh("raw", 0)),
                "ours_r": our_replay(fresh("ours", 0), last_id),
                "dicts_r": our_replay(fresh("ours", 0), last_id, as_dicts=True),
            }
            for name, seconds in round_.items():
                times.setdefault(name, []).append(seconds)
        pg_times = pg_rounds(args.pg_url, rows, events, args.repeat) if args.pg_url else {}
        under_load = max(n, int(args.rate * (args.lag_seconds + 1)))
        load_events = events if under_load <= n else workload(under_load)
        lag_line = (
            lag_under_load(work / "lag.db", load_events, args.rate, args.lag_seconds)
            if args.lag_seconds > 0
            else ""
        )
        kill_line = kill_at_random(work, args.rate, args.kills, under_load) if args.kills else ""
        long_line = long_replay(work, args.long) if args.long else ""
    finally:
        shutil.rmtree(work, ignore_errors=True)
    raw_a, ours_a, ours_s, ours_m, raw_r, ours_r, dicts_r = (min(times[k]) for k in times)
    times.update(pg_times)

    def spread(ours: str, raw: str) -> str:
        """The ratio of each round on its own: how much the machine moved under the best."""
        ratios = [r / o for r, o in zip(times[raw], times[ours], strict=True)]
        return f"  (rounds {min(ratios):.2f}-{max(ratios):.2f})"

    def line(label: str, seconds: float, reference: float | None = None, rounds: str = "") -> None:
        ratio = "" if reference is None else f"  ratio {reference / seconds:.2f}{rounds}"
        print(f"{label:<50} {n / seconds / 1e6:6.3f} M events/s{ratio}")

    print(
        f"events: {n} ({lookup_rows} of them lookup records), {args.block_tokens} token ids per "
        f"stored block, batch {BATCH}, WAL, synchronous=NORMAL, best of {args.repeat}"
    )
    line("append  raw sqlite3.executemany (pre-encoded):", raw_a)
    line("append  EventLog.append (one by one):", ours_a, raw_a, spread("ours_a", "raw_a"))
    line(
        f"append  one by one, switch interval {CLI_SWITCH_INTERVAL_S * 1e3:g} ms:",
        ours_s,
        raw_a,
        spread("ours_s", "raw_a"),
    )
    line("append  EventLog.append_many (10k):", ours_m, raw_a, spread("ours_m", "raw_a"))
    line("read    raw SELECT + msgpack.unpackb:", raw_r)
    line("replay  read + decode + fold (no checkpoint):", ours_r, raw_r, spread("ours_r", "raw_r"))
    line("replay  and then every block as a dict:", dicts_r, raw_r, spread("dicts_r", "raw_r"))
    if pg_times:
        pg_raw = min(pg_times["pg_raw"])
        line("append  PostgreSQL raw psycopg executemany:", pg_raw)
        line("append  PostgreSQL EventLog.append (COPY):", min(pg_times["pg_one"]), pg_raw,
             spread("pg_one", "pg_raw"))  # fmt: skip
        line("append  PostgreSQL EventLog.append_many (COPY):", min(pg_times["pg_many"]), pg_raw,
             spread("pg_many", "pg_raw"))  # fmt: skip
        line("append  PostgreSQL AsyncEventLog.append_many:", min(pg_times["pg_async"]), pg_raw,
             spread("pg_async", "pg_raw"))  # fmt: skip
    if lag_line:
        print(lag_line)
    if kill_line:
        print(kill_line)
    if long_line:
        print(long_line)


if __name__ == "__main__":
    main()
