"""Rebuild the registry from the log: the whole log, up to an event id, a position or a time.

Replay starts from the newest checkpoint that lies inside the requested range and folds only
the rows after it. While folding a full prefix of the log it stores a new checkpoint every
``checkpoint_every`` rows, so the next replay of a long log starts near its end.

What replay folds comes from the records alone, each verified by its checksum (``codec.py``);
of a row's other columns it uses only ``ts`` (to cut a time prefix and date checkpoints),
checked against the record's own timestamp, and the position, which orders the rows. An event-id
bound is applied to the records' event ids, not the ``event_id`` column, so no damaged column
can change what replay folds. A damaged row stops replay with an error naming the row and the
last good position before it, which ``until_position`` reaches.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Generator, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import numpy as np
import sqlalchemy as sa

from kvledger.events.chunk_decode import decode_joined
from kvledger.events.codec import (
    CodecError,
    decode,
    decode_state,
    encode_state,
    lookup_record_ts,
)
from kvledger.events.files import write_private
from kvledger.events.log import Checkpoint, EventLog
from kvledger.events.log.reader import RowChunk
from kvledger.events.types import AnyEvent, LogRecord, Lookup, Released, RunInfo
from kvledger.registry.columns import ops_from_events
from kvledger.registry.state import EventOrderError, RegistryState, take_next

DEFAULT_CHECKPOINT_EVERY = 100_000


class RowOrderError(EventOrderError):
    """An event out of order for its worker, at a known position in the log."""

    def __init__(self, message: str, position: int) -> None:
        super().__init__(f"event at position {position}: {message}")
        self.position = position
        self.last_good: int | None = None  # set by replay: the row before, which is intact


@dataclass
class ReplayReport:
    state: RegistryState
    start_position: int  # 0, or the checkpoint replay started from
    last_position: int  # the last row folded (start_position when none was)
    rows_folded: int
    """Rows read and checked: events and lookup records (``kvledger inspect`` counts rows)."""
    checkpoints_written: list[int] = field(default_factory=list)
    events: int = 0
    """Events (block transitions) folded: those of ``rows_folded`` within an event-id bound."""
    lookup_records: int = 0
    """Lookup records among ``rows_folded`` (they fold nothing)."""


def replay(
    log_or_url: EventLog | str,
    *,
    until_event_id: int | None = None,
    until_ts: float | None = None,
    until_position: int | None = None,
    use_checkpoints: bool = True,
    checkpoint_every: int | None = DEFAULT_CHECKPOINT_EVERY,
) -> RegistryState:
    """The registry as of the log's end, or as of each worker's event ``until_event_id``, or as
    of the last event stamped no later than ``until_ts``, or as of the row at
    ``until_position`` (the bounds combine: replay stops at the first one reached)."""
    return replay_report(
        log_or_url,
        until_event_id=until_event_id,
        until_ts=until_ts,
        until_position=until_position,
        use_checkpoints=use_checkpoints,
        checkpoint_every=checkpoint_every,
    ).state


def replay_report(
    log_or_url: EventLog | str,
    *,
    until_event_id: int | None = None,
    until_ts: float | None = None,
    until_position: int | None = None,
    use_checkpoints: bool = True,
    checkpoint_every: int | None = DEFAULT_CHECKPOINT_EVERY,
    on_progress: Callable[[ReplayReport], None] | None = None,
) -> ReplayReport:
    """``replay`` with an account of where it started and what it folded.

    ``on_progress`` is called with the report so far after each chunk of rows (about every 10k),
    for a progress display on long logs. A row that cannot be folded raises ``CodecError`` (a
    damaged or malformed record) or ``RowOrderError`` (a gap or an event out of order), whose
    ``last_good`` is the position of the row before it (None when there is none).
    """
    args = (until_event_id, until_ts, until_position, use_checkpoints, checkpoint_every)
    if isinstance(log_or_url, EventLog):
        return _replay(log_or_url, *args, on_progress)
    with EventLog(log_or_url, read_only=True) as log:
        return _replay(log, *args, on_progress)


def _replay(
    log: EventLog,
    until_event_id: int | None,
    until_ts: float | None,
    until_position: int | None,
    use_checkpoints: bool,
    checkpoint_every: int | None,
    on_progress: Callable[[ReplayReport], None] | None,
) -> ReplayReport:
    checkpoint = (
        _latest_checkpoint(log, until_event_id, until_ts, until_position)
        if use_checkpoints
        else None
    )
    if checkpoint is None:
        state, start, max_ts = RegistryState(), 0, -math.inf
    else:
        state, start, max_ts = checkpoint.state, checkpoint.position, checkpoint.max_ts
    report = ReplayReport(state, start, start, 0)
    # Only a fold of every row up to a position may be stored as a checkpoint; an event-id
    # bound skips rows of some workers, so it writes none.
    every = checkpoint_every if until_event_id is None else None
    chunks = _chunks_to_read(log, state, start, until_position, until_event_id)
    since_checkpoint = 0
    try:
        for chunk in chunks:
            stop_at: tuple[int, float, bytes] | None = None
            if until_ts is not None and chunk.ts.max() > until_ts:
                # the prefix ends inside this chunk, at the first later event
                cut = int(np.argmax(chunk.ts > until_ts))
                chunk, stop_at = chunk[:cut], chunk.row(cut)
            while len(chunk):
                # fold up to the next checkpoint boundary, store one there, go on
                take = len(chunk) if not every else min(len(chunk), every - since_checkpoint)
                piece, chunk = chunk[:take], chunk[take:]
                try:
                    folded = fold_chunk(state, piece, until_event_id)
                except (CodecError, RowOrderError) as exc:
                    raise _stopped_at(log, exc, piece.positions, report.last_position) from None
                report.events += folded.events
                report.lookup_records += folded.lookup_records
                max_ts = max(max_ts, float(piece.ts.max()))
                report.rows_folded += len(piece)
                report.last_position = int(piece.positions[-1])
                since_checkpoint += len(piece)
                if every and since_checkpoint >= every:
                    if _try_checkpoint(log, report.last_position, state, max_ts):
                        report.checkpoints_written.append(report.last_position)
                    since_checkpoint = 0
            if on_progress is not None:
                on_progress(report)
            if stop_at is not None:
                _check_stop(log, stop_at, report.last_position)
                break
    finally:
        chunks.close()
    return report


def _chunks_to_read(
    log: EventLog,
    state: RegistryState,
    start: int,
    until_position: int | None,
    until_event_id: int | None,
) -> Generator[RowChunk, None, None]:
    """The rows replay reads after ``start``: with ``until_event_id``, first those up to the
    last row that, by its columns, holds an event within the bound (``last_position_until``;
    no later row can hold one, since each worker's ids grow with the position), not every row
    to the log's end.

    The columns only say where to stop, never what to fold: once those rows are folded, each
    worker the columns name must have reached, by its records, the id the columns promise
    (the bound, or its last id below it). A damaged ``worker`` or ``event_id`` column that
    would have stopped the read too early fails that and the read goes on to the end, as
    without the early stop.
    """
    stop = until_position
    targets: dict[int, int] = {}
    if until_event_id is not None:
        bound, targets = log.last_position_until(until_event_id)
        stop = bound if until_position is None else min(until_position, bound)
    chunks = log.read_row_chunks(after_position=start, until_position=stop)
    try:
        yield from chunks
    finally:
        chunks.close()
    if until_event_id is None or stop == until_position:
        return  # no early stop: the read went to the caller's own bound
    assert stop is not None  # set from the bound
    last = state.last_event_id
    if all(last.get(worker, -1) >= target for worker, target in targets.items()):
        return
    rest = log.read_row_chunks(after_position=max(start, stop), until_position=until_position)
    try:
        yield from rest
    finally:
        rest.close()


class Folded(NamedTuple):
    """What ``fold_chunk`` folded: events, and lookup records passed over."""

    events: int
    lookup_records: int


def fold_chunk(
    state: RegistryState,
    chunk: RowChunk | Sequence[tuple[int, float, bytes]],
    until_event_id: int | None = None,
) -> Folded:
    """Fold log rows ``(position, ts, payload)`` (as tuples, or a ``RowChunk``, which is how
    replay reads them) into ``state``, skipping events after ``until_event_id``.

    The same as ``state.apply(decode(payload, position))`` for each row, and as strict, but
    the whole chunk is checked and unpacked by array operations (``chunk_decode``) and folded
    into the state's arrays in one batch. A chunk the array decoder does not vouch for is
    decoded row by row, which raises the precise error or skips a repeated event. Either way
    every record's checksum and its ``ts`` column are checked, skipped events' too.
    Returns how many events it folded and lookup records it passed over.
    """
    if not isinstance(chunk, RowChunk):
        chunk = RowChunk.from_rows(chunk)
    if not len(chunk):
        return Folded(0, 0)
    buf = np.frombuffer(chunk.buf, np.uint8)
    decoded = decode_joined(
        buf, chunk.starts, chunk.ends, chunk.crcs, state.last_event_id, chunk.ts, until_event_id
    )
    if decoded is None:
        last_event_id = dict(state.last_event_id)
        counts = [0, 0]
        ops = ops_from_events(_accepted(chunk.rows(), last_event_id, until_event_id, counts))
        folded = Folded(*counts)
    else:
        ops, last_event_id = decoded.ops, decoded.last_event_id
        folded = Folded(decoded.events, decoded.lookup_records)
    for key, batch in ops.items():
        state.fold_ops(key, batch)
    state.last_event_id.update(last_event_id)
    return folded


def _accepted(
    chunk: Iterable[tuple[int, float, bytes]],
    last_event_id: dict[int, int],
    until_event_id: int | None,
    counts: list[int],
) -> Iterator[AnyEvent]:
    """The chunk's events one by one, repeats and events after the bound skipped, a gap or a
    bad record raised; ``counts`` is [events yielded, lookup records passed over]."""
    for position, ts, payload in chunk:
        record_ts = lookup_record_ts(payload, position)
        if record_ts is not None:  # a lookup record: verified, folds nothing
            if record_ts != ts:
                raise CodecError(
                    f"damaged: its ts column reads {ts!r} but its record {record_ts!r}", position
                )
            counts[1] += 1
            continue
        event = _checked(position, ts, payload)
        if isinstance(event, Lookup | Released | RunInfo):
            counts[1] += 1
            continue
        if until_event_id is not None and event.event_id > until_event_id:
            continue
        try:
            taken = take_next(last_event_id, event)
        except EventOrderError as exc:
            raise RowOrderError(str(exc), position) from None
        if taken:
            counts[0] += 1
            yield event


def _checked(position: int, ts: float, payload: bytes) -> LogRecord:
    """The row's event, its record verified and its ``ts`` column checked against it."""
    event = decode(payload, position)
    if event.ts != ts:
        raise CodecError(
            f"damaged: its ts column reads {ts!r} but its record {event.ts!r}", position
        )
    return event


def _check_stop(log: EventLog, row: tuple[int, float, bytes], last_folded: int) -> None:
    """A time prefix ends at the first row stamped later than the bound: make sure that row
    is intact, so that a damaged ``ts`` column cannot end the prefix early."""
    try:
        _checked(*row)
    except CodecError as exc:
        raise _stopped_at(log, exc, (), last_folded) from None


def _stopped_at(
    log: EventLog,
    exc: CodecError | RowOrderError,
    positions: Iterable[int],
    last_folded: int,
) -> CodecError | RowOrderError:
    """``exc``, its message extended with what the row's columns say and the last good
    position (the row read before the failing one, of ``positions``), which is also set as
    ``exc.last_good``."""
    position = exc.position
    before = [int(p) for p in positions if position is not None and p < position]
    last_good = before[-1] if before else (last_folded or None)
    exc.last_good = last_good
    columns = ""
    if position is not None:
        for chunk in log.read_chunks(
            after_position=position - 1, until_position=position, columns=("worker", "event_id")
        ):
            for worker, event_id in chunk:
                columns = f" (its columns say worker {worker}, event {event_id})"
    good = (
        f"the last good row is at position {last_good}"
        if last_good is not None
        else "no good row comes before it"
    )
    exc.args = (f"{exc}{columns}; {good}",)
    return exc


def _latest_checkpoint(
    log: EventLog, until_event_id: int | None, until_ts: float | None, until_position: int | None
) -> Checkpoint | None:
    """Checkpoints are an optimisation: one that cannot be read (an older snapshot format, a
    damaged row) means folding from the start, not failing."""
    try:
        return log.latest_checkpoint(
            max_event_id=until_event_id, max_ts=until_ts, max_position=until_position
        )
    except CodecError as exc:
        warnings.warn(
            f"ignoring the newest checkpoint, replaying from the start: {exc}", stacklevel=4
        )
        return None


def _try_checkpoint(log: EventLog, position: int, state: RegistryState, max_ts: float) -> bool:
    """Checkpoints are an optimisation: a log we may not write to still replays."""
    try:
        return log.save_checkpoint(position, state, max_ts)
    except sa.exc.OperationalError as exc:
        warnings.warn(f"could not store a checkpoint at {position}: {exc}", stacklevel=3)
        return False


def verify(replayed: RegistryState, live: RegistryState) -> list[str]:
    """Differences between a replayed state and a live one; empty when they agree."""
    return replayed.diff(live)


def save_state(path: str | Path, state: RegistryState) -> None:
    """Dump a (live) state to a file that ``kvledger replay --verify`` reads (readable by its
    owner only: it names every cached block)."""
    write_private(path, encode_state(state))


def load_state(path: str | Path) -> RegistryState:
    return decode_state(Path(path).read_bytes())
