"""models: the served-model registry, and the model of every file, job and shard

Revision ID: 0003_models
Revises: 0002
Create Date: 2026-12-01 03:00:00.000000
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

import service.db

revision = "0003_models"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "models",
        sa.Column("id", sa.String(length=200), nullable=False),
        sa.Column("aliases", sa.JSON(), nullable=True),
        sa.Column("created_at", service.db.UTCDateTime(timezone=True), nullable=False),
        sa.Column("last_seen_at", service.db.UTCDateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id"),
    )
    with op.batch_alter_table("files") as batch_op:
        batch_op.add_column(sa.Column("model", sa.String(length=200), nullable=True))
    with op.batch_alter_table("jobs") as batch_op:
        batch_op.add_column(sa.Column("model", sa.String(length=200), nullable=True))
    with op.batch_alter_table("shards") as batch_op:
        batch_op.add_column(sa.Column("model", sa.String(length=200), nullable=True))
        batch_op.create_index("ix_shards_model_claim", ["model", "status"], unique=False)
    # Shards made before routing run the model their batch was created under.
    op.execute("UPDATE shards SET model = (SELECT batches.model FROM batches "
               "WHERE batches.id = shards.batch_id) WHERE batch_id IS NOT NULL")


def downgrade() -> None:
    with op.batch_alter_table("shards") as batch_op:
        batch_op.drop_index("ix_shards_model_claim")
        batch_op.drop_column("model")
    with op.batch_alter_table("jobs") as batch_op:
        batch_op.drop_column("model")
    with op.batch_alter_table("files") as batch_op:
        batch_op.drop_column("model")
    op.drop_table("models")
