"""deadlines: a batch's per-line token estimates, where its estimated completion starts

Revision ID: 0004_deadlines
Revises: 0003_models
Create Date: 2026-12-01 03:00:00.000000
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004_deadlines"
down_revision = "0003_models"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("batches") as batch_op:
        batch_op.add_column(sa.Column("est_prompt_tokens_per_line", sa.Float(), nullable=False,
                                      server_default="0"))
        batch_op.add_column(sa.Column("est_output_tokens_per_line", sa.Float(), nullable=False,
                                      server_default="0"))


def downgrade() -> None:
    with op.batch_alter_table("batches") as batch_op:
        batch_op.drop_column("est_output_tokens_per_line")
        batch_op.drop_column("est_prompt_tokens_per_line")
