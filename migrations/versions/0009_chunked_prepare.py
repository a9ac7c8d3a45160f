"""chunked prepare: how far a batch's prepare has got, so a crash resumes it

Prepare commits a large batch's lines a chunk of shards at a time, each chunk's shards
claimable as it commits. ``prepared_lines`` is its cursor: the input lines (by line number)
whose rows are committed; a prepare that stops half way resumes after it, so every line is
inserted exactly once. ``prepared_at`` is when its last chunk committed: until then finalize
leaves the batch alone. Batches past validating when this revision runs were prepared in one
transaction: they count as prepared (at their ``in_progress_at``, else when they were created).

Revision ID: 0009_chunked_prepare
Revises: 0008_model_kind
Create Date: 2026-12-02 01:30:00.000000
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

import service.db

revision = "0009_chunked_prepare"
down_revision = "0008_model_kind"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("batches") as batch_op:
        batch_op.add_column(sa.Column("prepared_lines", sa.Integer(), nullable=False,
                                      server_default="0"))
        batch_op.add_column(sa.Column("prepared_at", service.db.UTCDateTime(timezone=True),
                                      nullable=True))
    op.execute("UPDATE batches SET prepared_at = COALESCE(in_progress_at, created_at) "
               "WHERE status <> 'validating'")


def downgrade() -> None:
    with op.batch_alter_table("batches") as batch_op:
        batch_op.drop_column("prepared_at")
        batch_op.drop_column("prepared_lines")
