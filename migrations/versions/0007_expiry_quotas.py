"""expiry and quotas: when a file expires, and the enqueued tokens a tenant's work holds

- ``files.expires_at`` (indexed: the housekeeper finds expired files by it) and
  ``files.enqueued_tokens`` (the upload's count of its valid lines' tokens);
- ``batches.output_expires_after`` (seconds after their creation that its output and error
  files expire) and ``batches.enqueued_tokens`` (reserved at create, made exact at prepare);
- ``jobs.enqueued_tokens``, ``request_lines.enqueued_tokens`` (each line's share, released when
  it closes) and ``batch_counters.released_tokens`` (what a batch's closed lines released);
- ``api_keys.max_enqueued_tokens``: a key's own limit (None: the deployment's).

Plain added columns with constant defaults: PostgreSQL adds them without rewriting a table.

Revision ID: 0007_expiry_quotas
Revises: 0006_hot_results
Create Date: 2026-12-01 22:00:00.000000
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0007_expiry_quotas"
down_revision = "0006_hot_results"
branch_labels = None
depends_on = None

TOKENS = {"files": "enqueued_tokens", "batches": "enqueued_tokens", "jobs": "enqueued_tokens",
          "request_lines": "enqueued_tokens", "batch_counters": "released_tokens"}


def upgrade() -> None:
    for table, column in TOKENS.items():
        with op.batch_alter_table(table) as batch_op:
            batch_op.add_column(sa.Column(column, sa.BigInteger(), nullable=False,
                                          server_default="0"))
    with op.batch_alter_table("files") as batch_op:
        batch_op.add_column(sa.Column("expires_at", sa.DateTime(timezone=True), nullable=True))
    op.create_index("ix_files_expires_at", "files", ["expires_at"])
    with op.batch_alter_table("batches") as batch_op:
        batch_op.add_column(sa.Column("output_expires_after", sa.Integer(), nullable=True))
    with op.batch_alter_table("api_keys") as batch_op:
        batch_op.add_column(sa.Column("max_enqueued_tokens", sa.BigInteger(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("api_keys") as batch_op:
        batch_op.drop_column("max_enqueued_tokens")
    with op.batch_alter_table("batches") as batch_op:
        batch_op.drop_column("output_expires_after")
    op.drop_index("ix_files_expires_at", table_name="files")
    with op.batch_alter_table("files") as batch_op:
        batch_op.drop_column("expires_at")
    for table, column in TOKENS.items():
        with op.batch_alter_table(table) as batch_op:
            batch_op.drop_column(column)
