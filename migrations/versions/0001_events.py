"""Event rows: one per event, unique per (worker, event_id).

Revision ID: 0001
Revises:
Create Date: 2025-01-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

RowId = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    op.create_table(
        "events",
        sa.Column("id", RowId, primary_key=True, autoincrement=True),
        sa.Column("worker", sa.BigInteger, nullable=False),
        sa.Column("event_id", sa.BigInteger, nullable=False),
        sa.Column("kind", sa.String(16), nullable=False),
        sa.Column("tier", sa.SmallInteger, nullable=False),
        sa.Column("ts", sa.Double, nullable=False),
        sa.Column("payload", sa.LargeBinary, nullable=False),
        sa.UniqueConstraint("worker", "event_id", name="uq_events_worker_event_id"),
    )


def downgrade() -> None:
    op.drop_table("events")
