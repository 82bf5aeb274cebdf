"""Rebuild the registry from the log: the whole log, up to an event id, or up to a time.

Replay starts from the newest checkpoint that lies inside the requested range and folds only
the rows after it. While folding a full prefix of the log it stores a new checkpoint every
``checkpoint_every`` rows, so the next replay of a long log starts near its end.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from operator import itemgetter
from pathlib import Path

import msgpack
import sqlalchemy as sa

from kvledger.events.codec import (
    _INT_ONLY,
    _INT_OR_NONE,
    _TIERS,
    decode,
    decode_state,
    encode_state,
)
from kvledger.events.log import EventLog
from kvledger.registry.state import EventOrderError, RegistryState

DEFAULT_CHECKPOINT_EVERY = 100_000
# The top-level field types of each record the fast fold handles (codec.py has the layout):
# version, kind, worker_id, event_id, dp_rank, tier, ts, then the body.
_HEAD = (int, int, int, int, int, int, float)
_NONE = type(None)
_SHAPES: dict[tuple[type, ...], str] = {
    (*_HEAD, _NONE, tuple, tuple, _NONE): "stored",  # at the start of a sequence
    (*_HEAD, int, tuple, tuple, _NONE): "stored",  # after a parent
    (*_HEAD, tuple): "removed",
    (*_HEAD, int, tuple, tuple, tuple): "copied",
}
_SHAPE_OF_KIND = {1: "stored", 2: "removed", 3: "copied", 4: "copied"}
_TS = itemgetter(1)


@dataclass
class ReplayReport:
    state: RegistryState
    start_position: int  # 0, or the checkpoint replay started from
    last_position: int  # the last row folded (start_position when none was)
    rows_folded: int
    checkpoints_written: list[int] = field(default_factory=list)


def replay(
    log_or_url: EventLog | str,
    *,
    until_event_id: int | None = None,
    until_ts: float | None = None,
    use_checkpoints: bool = True,
    checkpoint_every: int | None = DEFAULT_CHECKPOINT_EVERY,
) -> RegistryState:
    """The registry as of the log's end, or as of each worker's event ``until_event_id``, or as
    of the last event stamped no later than ``until_ts``."""
    return replay_report(
        log_or_url,
        until_event_id=until_event_id,
        until_ts=until_ts,
        use_checkpoints=use_checkpoints,
        checkpoint_every=checkpoint_every,
    ).state


def replay_report(
    log_or_url: EventLog | str,
    *,
    until_event_id: int | None = None,
    until_ts: float | None = None,
    use_checkpoints: bool = True,
    checkpoint_every: int | None = DEFAULT_CHECKPOINT_EVERY,
    on_progress: Callable[[ReplayReport], None] | None = None,
) -> ReplayReport:
    """``replay`` with an account of where it started and what it folded.

    ``on_progress`` is called with the report so far after each chunk of rows (about every 10k),
    for a progress display on long logs.
    """
    args = (until_event_id, until_ts, use_checkpoints, checkpoint_every, on_progress)
    if isinstance(log_or_url, EventLog):
        return _replay(log_or_url, *args)
    with EventLog(log_or_url, read_only=True) as log:
        return _replay(log, *args)


def _replay(
    log: EventLog,
    until_event_id: int | None,
    until_ts: float | None,
    use_checkpoints: bool,
    checkpoint_every: int | None,
    on_progress: Callable[[ReplayReport], None] | None,
) -> ReplayReport:
    checkpoint = (
        log.latest_checkpoint(max_event_id=until_event_id, max_ts=until_ts)
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
    chunks = log.read_chunks(after_position=start, until_event_id=until_event_id)
    since_checkpoint = 0
    try:
        for chunk in chunks:
            if until_ts is not None and max(map(_TS, chunk)) > until_ts:
                # the prefix ends inside this chunk, at the first later event
                cut = next(i for i, row in enumerate(chunk) if row[1] > until_ts)
                chunk = chunk[:cut]
                stopped = True
            else:
                stopped = False
            while chunk:
                # fold up to the next checkpoint boundary, store one there, go on
                take = len(chunk) if not every else min(len(chunk), every - since_checkpoint)
                piece, chunk = chunk[:take], chunk[take:]
                fold_chunk(state, piece)
                max_ts = max(max_ts, max(map(_TS, piece)))
                report.rows_folded += len(piece)
                report.last_position = piece[-1][0]
                since_checkpoint += len(piece)
                if every and since_checkpoint >= every:
                    if _try_checkpoint(log, report.last_position, state, max_ts):
                        report.checkpoints_written.append(report.last_position)
                    since_checkpoint = 0
            if on_progress is not None:
                on_progress(report)
            if stopped:
                break
    finally:
        chunks.close()
    return report


def fold_chunk(state: RegistryState, chunk: Sequence[tuple[int, float, bytes]]) -> None:
    """Fold log rows into ``state``, straight from the records.

    Equivalent to ``state.apply(decode(payload, position))`` for each row, and checks the same
    things, but builds no event objects: constructing frozen dataclasses costs more than
    reading the row, and replay exists to be fast. Anything the fast path does not vouch for
    (an unusual or bad record, an out-of-order id) goes through
    ``decode`` + ``apply``, which raise the precise error.
    """
    tiers = state.tiers
    last_ids = state.last_event_id
    int_only = _INT_ONLY
    shapes = _SHAPES
    unpackb = msgpack.unpackb
    for position, _ts, payload in chunk:
        try:
            record = unpackb(payload, use_list=False)
            shape = shapes.get(tuple(map(type, record)))
        except Exception:
            shape = None
        # `shape` is set only when every top-level field has the type its kind needs
        if shape is not None and shape == _SHAPE_OF_KIND.get(record[1]) and record[0] == 1:
            kind = record[1]
            worker, event_id = record[2], record[3]
            tier = _TIERS.get(record[5])
            if tier is not None and event_id == last_ids.get(worker, -1) + 1:
                blocks = tiers.get((worker, tier))
                if blocks is None:
                    blocks = tiers[(worker, tier)] = {}
                if kind == 1:
                    parent, seqs, locals_ = record[7], record[8], record[9]
                    if (
                        seqs
                        and len(seqs) == len(locals_)
                        and int_only.issuperset(map(type, seqs))
                        and int_only.issuperset(map(type, locals_))
                    ):
                        last_ids[worker] = event_id
                        for seq, local in zip(seqs, locals_):  # noqa: B905 (lengths checked)
                            blocks[seq] = (local, parent)
                            parent = seq
                        continue
                elif kind == 2:
                    hashes = record[7]
                    if hashes and int_only.issuperset(map(type, hashes)):
                        last_ids[worker] = event_id
                        for seq in hashes:
                            blocks.pop(seq, None)
                        continue
                else:
                    src, seqs, locals_, parents = record[7:]
                    if (
                        src != tier
                        and src in _TIERS
                        and seqs
                        and len(seqs) == len(locals_) == len(parents)
                        and int_only.issuperset(map(type, seqs))
                        and int_only.issuperset(map(type, locals_))
                        and _INT_OR_NONE.issuperset(map(type, parents))
                    ):
                        last_ids[worker] = event_id
                        for seq, local, parent in zip(seqs, locals_, parents):  # noqa: B905
                            blocks[seq] = (local, parent)
                        continue
        _fold_slowly(state, payload, position)


def _fold_slowly(state: RegistryState, payload: bytes, position: int) -> None:
    """The reference path: full decode, then the registry's own fold."""
    try:
        state.apply(decode(payload, position))
    except EventOrderError as exc:
        raise EventOrderError(f"event at position {position}: {exc}") from None


def _try_checkpoint(log: EventLog, position: int, state: RegistryState, max_ts: float) -> bool:
    """Checkpoints are an optimisation: a log we may not write to still replays."""
    try:
        log.save_checkpoint(position, state, max_ts)
    except sa.exc.OperationalError as exc:
        warnings.warn(f"could not store a checkpoint at {position}: {exc}", stacklevel=3)
        return False
    return True


def verify(replayed: RegistryState, live: RegistryState) -> list[str]:
    """Differences between a replayed state and a live one; empty when they agree."""
    return replayed.diff(live)


def save_state(path: str | Path, state: RegistryState) -> None:
    """Dump a (live) state to a file that ``kvledger replay --verify`` reads."""
    Path(path).write_bytes(encode_state(state))


def load_state(path: str | Path) -> RegistryState:
    return decode_state(Path(path).read_bytes())
