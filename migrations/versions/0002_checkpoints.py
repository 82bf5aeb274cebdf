"""Checkpoints: registry snapshots that let replay skip the log's prefix.

Revision ID: 0002
Revises: 0001
Create Date: 2025-01-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None

RowId = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    op.create_table(
        "checkpoints",
        sa.Column("id", RowId, primary_key=True, autoincrement=True),
        sa.Column("position", sa.BigInteger, nullable=False, unique=True),
        sa.Column("max_event_id", sa.BigInteger, nullable=False),
        sa.Column("max_ts", sa.Double, nullable=False),
        sa.Column("created", sa.Double, nullable=False),
        sa.Column("snapshot", sa.LargeBinary, nullable=False),
    )


def downgrade() -> None:
    op.drop_table("checkpoints")
