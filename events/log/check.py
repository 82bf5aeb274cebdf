"""Scan a whole log for damaged rows: what ``kvledger inspect --check`` reports.

Replay stops at the first damaged row; a check goes on to the end and reports every one, so
an operator sees how much of a log is hurt before deciding what to do with it. Each row's
record is decoded (which verifies its checksum), every column is compared with the record
(the columns are what ``inspect`` summarises and what SQL filters by), and each worker's event
ids must follow on from one another in log order.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import repeat
from typing import Any

import numpy as np

from kvledger.events.chunk_decode import decode_chunk
from kvledger.events.codec import KIND_CODES, KIND_NAMES, LOG_RECORD_VERSION, CodecError, decode
from kvledger.events.log import EventLog
from kvledger.events.log.rows import row_worker

_COLUMNS = ("id", "worker", "event_id", "kind", "tier", "ts", "payload")
_KIND_CODE = {KIND_NAMES[cls]: code for cls, code in KIND_CODES.items()}


@dataclass(frozen=True)
class DamagedRow:
    position: int
    problem: str


@dataclass
class CheckReport:
    rows: int = 0
    with_checksum: int = 0  # version 3 records, their checksums verified
    damaged: list[DamagedRow] = field(default_factory=list)

    @property
    def without_checksum(self) -> int:
        """Readable records of version 2, which carry no checksum to verify."""
        return self.rows - self.with_checksum - len(self.damaged)


def check_log(log: EventLog, on_progress: Callable[[int], None] | None = None) -> CheckReport:
    """Every row of ``log`` checked; ``on_progress`` gets the position reached per chunk."""
    report = CheckReport()
    next_id: dict[int, int] = {}
    for chunk in log.read_chunks(columns=_COLUMNS):
        if _chunk_intact(chunk, next_id, report):
            if on_progress is not None:
                on_progress(chunk[-1][0])
            continue
        for position, worker, event_id, kind, tier, ts, payload in chunk:
            report.rows += 1
            problem = _problem(position, worker, event_id, kind, tier, ts, payload)
            if problem is None:
                expected = next_id.get(worker, 0)
                if event_id != expected and worker in next_id:
                    what = "repeats" if event_id < expected else "skips to"
                    problem = f"worker {worker}: event {event_id} {what} (expected {expected})"
                elif payload[1] == LOG_RECORD_VERSION:
                    report.with_checksum += 1
            if problem is not None:
                report.damaged.append(DamagedRow(position, problem))
            # go on from what the columns say, so that one damaged row is one report
            next_id[worker] = max(next_id.get(worker, 0), event_id + 1)
        if on_progress is not None:
            on_progress(chunk[-1][0])
    return report


def _chunk_intact(chunk: list[Any], next_id: dict[int, int], report: CheckReport) -> bool:
    """Whether every row of the chunk is intact, checked by replay's array decoder (each
    record verified, the ts column and per-worker ids checked) and array comparisons of the
    other columns; if so, the rows are counted. False sends the chunk row by row, to say
    what is wrong where."""
    _positions, workers, event_ids, kinds, tiers, ts, payloads = zip(*chunk, strict=True)
    n = len(chunk)
    decoded = decode_chunk(
        payloads, {w: i - 1 for w, i in next_id.items()}, np.fromiter(ts, np.float64, n)
    )
    if decoded is None or decoded.headers is None:
        return False
    h = decoded.headers
    kind_codes = np.fromiter(map(_KIND_CODE.get, kinds, repeat(-1)), np.int64, n)
    if not (
        (np.fromiter(workers, np.int64, n) == h.worker).all()
        and (np.fromiter(event_ids, np.int64, n) == h.event_id.astype(np.int64)).all()
        and (np.fromiter(tiers, np.int64, n) == h.tier).all()
        and (kind_codes == h.kind).all()
    ):
        return False
    report.rows += n
    report.with_checksum += int((h.version == LOG_RECORD_VERSION).sum())
    next_id.update((w, i + 1) for w, i in decoded.last_event_id.items())
    return True


def _problem(
    position: int, worker: int, event_id: int, kind: str, tier: int, ts: float, payload: bytes
) -> str | None:
    """What is wrong with the row, or None."""
    try:
        event = decode(payload, position)
    except CodecError as exc:
        return f"{str(exc).split(': ', 1)[-1]} (its columns say worker {worker}, event {event_id})"
    columns = {
        "worker": (worker, row_worker(event)),
        "event_id": (event_id, event.event_id),
        "kind": (kind, KIND_NAMES[type(event)]),
        "tier": (tier, int(event.tier)),
        "ts": (ts, event.ts),
    }
    wrong = [f"{name} column reads {have!r}, its record {want!r}"
             for name, (have, want) in columns.items() if have != want]  # fmt: skip
    return "; ".join(wrong) or None


def record_versions(log: EventLog) -> tuple[int | None, int | None]:
    """The record versions of the log's first and last rows (None for an empty log, or a
    row too short to say): a log written before checksums and continued after them holds
    version 2 rows, then version 3."""
    last = log.last_position()
    return _version_after(log, 0), _version_after(log, max(last - 1, 0))


def _version_after(log: EventLog, position: int) -> int | None:
    chunks = log.read_chunks(after_position=position, chunk_size=1, columns=("payload",))
    try:
        for ((payload,),) in chunks:
            return payload[1] if len(payload) > 1 else None
        return None
    finally:
        chunks.close()
