"""Checkpoints: a snapshot of the registry's fold up to a position, so replay starts there
instead of at the first row. A checkpoint only saves replay time; the rows stay the record."""

from __future__ import annotations

import time
from dataclasses import dataclass

import sqlalchemy as sa

from kvledger.events.codec import CodecError, decode_checkpoint, encode_state
from kvledger.events.log.schema import checkpoints
from kvledger.registry.state import RegistryState


@dataclass(frozen=True)
class Checkpoint:
    position: int
    max_event_id: int
    max_ts: float
    state: RegistryState


def save_checkpoint(db: sa.Engine, position: int, state: RegistryState, max_ts: float) -> None:
    """Store ``state`` as the fold of every row up to ``position``.

    One there already is replaced: it holds the same fold, unless it was written in an older
    snapshot format, which this heals.
    """
    max_event_id = max(state.last_event_id.values(), default=-1)
    values = {
        "max_event_id": max_event_id,
        "max_ts": max_ts,
        "created": time.time(),
        # the columns replay selects a checkpoint by, under the snapshot's checksum
        "snapshot": encode_state(state, (position, max_event_id, max_ts)),
    }
    with db.begin() as conn:
        exists = conn.execute(
            sa.select(checkpoints.c.id).where(checkpoints.c.position == position)
        ).first()
        if exists is None:
            conn.execute(checkpoints.insert().values(position=position, **values))
        else:
            conn.execute(checkpoints.update().where(checkpoints.c.id == exists[0]).values(**values))


def latest_checkpoint(
    db: sa.Engine,
    *,
    max_position: int | None = None,
    max_event_id: int | None = None,
    max_ts: float | None = None,
) -> Checkpoint | None:
    """The newest checkpoint that covers no event beyond the given bounds.

    ``CodecError`` when its snapshot is damaged, or when its position, max_event_id or max_ts
    column differs from what the snapshot holds under its checksum (a snapshot written before
    version 4 holds none of them)."""
    c = checkpoints.c
    stmt = sa.select(c.position, c.max_event_id, c.max_ts, c.snapshot)
    if max_position is not None:
        stmt = stmt.where(c.position <= max_position)
    if max_event_id is not None:
        stmt = stmt.where(c.max_event_id <= max_event_id)
    if max_ts is not None:
        stmt = stmt.where(c.max_ts <= max_ts)
    with db.connect() as conn:
        row = conn.execute(stmt.order_by(c.position.desc()).limit(1)).first()
    if row is None:
        return None
    position, max_event_id, max_ts = int(row[0]), int(row[1]), float(row[2])
    state, cover = decode_checkpoint(row[3])
    if cover is not None and cover != (position, max_event_id, max_ts):
        raise CodecError(
            f"checkpoint at position {position}: damaged: its columns (position, max_event_id, "
            f"max_ts) = {(position, max_event_id, max_ts)} differ from its checksummed "
            f"snapshot's {cover}"
        )
    return Checkpoint(position, max_event_id, max_ts, state)
