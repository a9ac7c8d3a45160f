"""hot results: a line's result write changes no indexed column, in a page with room for it

A result write (``worker/result_writer.py``) rewrites the line's row. It changed ``status``, a
column in two indexes and in the predicate of the unique index, so every write was a non-HOT
update: a new row version wherever the free space map found room (COPY leaves the pages full, so
at the end of the table: 32 writers queued on the relation's extension lock) and a new entry in
each of the table's six indexes. Now:

- ``ix_request_lines_batch_status`` is dropped: a batch's lines are found by
  ``ix_request_lines_batch_line`` (batch_id leads it); the open lines of a batch are read once at
  finalize, the counters (``batch_counters``) answer everything else.
- ``ix_request_lines_shard_status`` becomes ``ix_request_lines_shard`` on ``shard_id`` alone (a
  shard's few hundred lines are read and filtered on status).
- ``uq_request_lines_batch_custom_id`` covers the lines that have a shard instead of those not
  failed: the same lines (prepare gives a shard to every line it does not fail, and only those,
  since before 0005), decided by a column no result write changes.
- ``request_lines`` gets fillfactor 40 (PostgreSQL): prepare's COPY fills 40% of each page, so
  the result versions of its lines fit in the page beside the versions they replace (a HOT
  update) while a result row is up to ~1.5x its line's row. Measured with bench.scale (16
  workers, 8,000 lines; rows of ~860 bytes, ~1,250 with the result): fillfactor 100 (before),
  0% of result writes HOT, 2,114 heap bytes a line; 50, 63% HOT, 2,681 bytes; 40, 100% HOT,
  2,048 bytes (every line's two versions in its own page, no page added for results).

Revision ID: 0006_hot_results
Revises: 0005_scale
Create Date: 2026-12-01 11:00:00.000000
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0006_hot_results"
down_revision = "0005_scale"
branch_labels = None
depends_on = None

FILLFACTOR = 40
UNIQUE = "uq_request_lines_batch_custom_id"


def upgrade() -> None:
    has_shard = sa.text("shard_id IS NOT NULL")
    if op.get_bind().dialect.name != "postgresql":
        op.drop_index("ix_request_lines_batch_status", table_name="request_lines")
        op.drop_index("ix_request_lines_shard_status", table_name="request_lines")
        op.create_index("ix_request_lines_shard", "request_lines", ["shard_id"])
        op.drop_index(UNIQUE, table_name="request_lines")
        op.create_index(UNIQUE, "request_lines", ["batch_id", "custom_id"], unique=True,
                        sqlite_where=has_shard)
        return
    # PostgreSQL: built and dropped CONCURRENTLY (outside a transaction), so a large table
    # keeps taking writes while this runs; the new unique index is built beside the old one
    # and renamed, so uniqueness holds throughout.
    with op.get_context().autocommit_block():
        op.create_index("ix_request_lines_shard", "request_lines", ["shard_id"],
                        postgresql_concurrently=True)
        op.create_index(f"{UNIQUE}_new", "request_lines", ["batch_id", "custom_id"],
                        unique=True, postgresql_where=has_shard, postgresql_concurrently=True)
        op.drop_index(UNIQUE, table_name="request_lines", postgresql_concurrently=True)
        op.execute(f"ALTER INDEX {UNIQUE}_new RENAME TO {UNIQUE}")
        op.drop_index("ix_request_lines_batch_status", table_name="request_lines",
                      postgresql_concurrently=True)
        op.drop_index("ix_request_lines_shard_status", table_name="request_lines",
                      postgresql_concurrently=True)
        # Pages written from now on (existing ones are left as they are until rewritten).
        op.execute(f"ALTER TABLE request_lines SET (fillfactor = {FILLFACTOR})")


def downgrade() -> None:
    not_failed = sa.text("status <> 'failed'")
    if op.get_bind().dialect.name != "postgresql":
        op.drop_index(UNIQUE, table_name="request_lines")
        op.create_index(UNIQUE, "request_lines", ["batch_id", "custom_id"], unique=True,
                        sqlite_where=not_failed)
        op.drop_index("ix_request_lines_shard", table_name="request_lines")
        op.create_index("ix_request_lines_shard_status", "request_lines", ["shard_id", "status"])
        op.create_index("ix_request_lines_batch_status", "request_lines", ["batch_id", "status"])
        return
    with op.get_context().autocommit_block():
        op.execute("ALTER TABLE request_lines RESET (fillfactor)")
        op.create_index("ix_request_lines_batch_status", "request_lines", ["batch_id", "status"],
                        postgresql_concurrently=True)
        op.create_index("ix_request_lines_shard_status", "request_lines", ["shard_id", "status"],
                        postgresql_concurrently=True)
        op.create_index(f"{UNIQUE}_old", "request_lines", ["batch_id", "custom_id"],
                        unique=True, postgresql_where=not_failed, postgresql_concurrently=True)
        op.drop_index(UNIQUE, table_name="request_lines", postgresql_concurrently=True)
        op.execute(f"ALTER INDEX {UNIQUE}_old RENAME TO {UNIQUE}")
        op.drop_index("ix_request_lines_shard", table_name="request_lines",
                      postgresql_concurrently=True)
