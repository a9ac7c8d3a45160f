"""workers: heartbeats and engine metrics snapshots

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-02 10:00:00.000000
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

import service.db

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "workers",
        sa.Column("id", sa.String(length=100), nullable=False),
        sa.Column("model", sa.String(length=200), nullable=True),
        sa.Column("started_at", service.db.UTCDateTime(timezone=True), nullable=False),
        sa.Column("heartbeat_at", service.db.UTCDateTime(timezone=True), nullable=False),
        sa.Column("metrics", sa.JSON(), nullable=True),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index("ix_workers_heartbeat_at", "workers", ["heartbeat_at"], unique=False)


def downgrade() -> None:
    op.drop_index("ix_workers_heartbeat_at", table_name="workers")
    op.drop_table("workers")
