"""scale: per-batch counters, lines that keep their custom_id, engine-ready fields

- ``batch_counters``: a batch's live counts and usage in ``COUNTER_SLOTS`` rows, kept with the
  line writes; filled here from the lines of every existing batch (slot 0).
- ``request_lines.engine_fields``: the validated fields the drain loop uses (NULL for old
  rows: they are parsed from ``body`` as before).
- ``uq_request_lines_batch_custom_id`` becomes a partial unique index over lines that were not
  failed, so a repeated custom_id is stored on its failed line; old rows get theirs back from
  the error JSON they kept it in.
- ``ix_request_lines_batch_line``: finalize reads a batch's lines in input order without a sort.
- lines marked "running" by the old claim go back to "pending" (claims no longer mark lines).

Revision ID: 0005_scale
Revises: 0004_deadlines
Create Date: 2026-12-01 06:00:00.000000
"""

from __future__ import annotations

import json

import sqlalchemy as sa
from alembic import op

revision = "0005_scale"
down_revision = "0004_deadlines"
branch_labels = None
depends_on = None

_NOT_FAILED = sa.text("status <> 'failed'")


def upgrade() -> None:
    op.create_table(
        "batch_counters",
        sa.Column("batch_id", sa.String(length=64), nullable=False),
        sa.Column("slot", sa.Integer(), nullable=False),
        sa.Column("num_open", sa.Integer(), nullable=False),
        sa.Column("num_completed", sa.Integer(), nullable=False),
        sa.Column("num_failed", sa.Integer(), nullable=False),
        sa.Column("input_tokens", sa.Integer(), nullable=False),
        sa.Column("output_tokens", sa.Integer(), nullable=False),
        sa.Column("cached_tokens", sa.Integer(), nullable=False),
        sa.ForeignKeyConstraint(["batch_id"], ["batches.id"]),
        sa.PrimaryKeyConstraint("batch_id", "slot"),
    )
    op.execute("""
        INSERT INTO batch_counters (batch_id, slot, num_open, num_completed, num_failed,
                                    input_tokens, output_tokens, cached_tokens)
        SELECT batch_id, 0,
               SUM(CASE WHEN status IN ('pending', 'running') THEN 1 ELSE 0 END),
               SUM(CASE WHEN status = 'completed' THEN 1 ELSE 0 END),
               SUM(CASE WHEN status IN ('pending', 'running', 'completed') THEN 0 ELSE 1 END),
               COALESCE(SUM(prompt_tokens), 0), COALESCE(SUM(completion_tokens), 0),
               COALESCE(SUM(cached_tokens), 0)
        FROM request_lines WHERE batch_id IS NOT NULL GROUP BY batch_id
    """)
    op.execute("UPDATE request_lines SET status = 'pending' WHERE status = 'running'")
    with op.batch_alter_table("request_lines") as batch_op:
        batch_op.add_column(sa.Column("engine_fields", sa.JSON(), nullable=True))
        batch_op.drop_constraint("uq_request_lines_batch_custom_id", type_="unique")
        batch_op.create_index("ix_request_lines_batch_line", ["batch_id", "line_no"],
                              unique=False)
    op.create_index("uq_request_lines_batch_custom_id", "request_lines",
                    ["batch_id", "custom_id"], unique=True,
                    postgresql_where=_NOT_FAILED, sqlite_where=_NOT_FAILED)
    _restore_custom_ids()


def _restore_custom_ids() -> None:
    """Failed lines stored without a custom_id that their error kept get it back."""
    conn = op.get_bind()
    lines = sa.table("request_lines", sa.column("pk", sa.Integer), sa.column("custom_id"),
                     sa.column("status"), sa.column("error", sa.JSON))
    rows = conn.execute(sa.select(lines.c.pk, lines.c.error).where(
        lines.c.custom_id.is_(None), lines.c.status == "failed")).all()
    for pk, error in rows:
        if isinstance(error, str):  # some drivers hand JSON back as text
            error = json.loads(error)
        custom_id = (error or {}).get("custom_id")
        if isinstance(custom_id, str) and custom_id:
            conn.execute(sa.update(lines).where(lines.c.pk == pk).values(custom_id=custom_id))


def downgrade() -> None:
    # The old unique constraint allows one row per custom_id: a failed line repeating another
    # line's custom_id keeps it only in its error JSON again (where the old finalize reads it).
    conn = op.get_bind()
    lines = sa.table("request_lines", sa.column("pk", sa.Integer), sa.column("batch_id"),
                     sa.column("custom_id"), sa.column("status"), sa.column("error", sa.JSON))
    other = lines.alias("other")
    repeated = conn.execute(sa.select(lines.c.pk, lines.c.custom_id, lines.c.error).where(
        lines.c.status == "failed", lines.c.custom_id.is_not(None),
        sa.exists().where(other.c.batch_id == lines.c.batch_id,
                          other.c.custom_id == lines.c.custom_id, other.c.pk < lines.c.pk),
    )).all()
    for pk, custom_id, error in repeated:
        if isinstance(error, str):
            error = json.loads(error)
        conn.execute(sa.update(lines).where(lines.c.pk == pk).values(
            custom_id=None, error={**(error or {}), "custom_id": custom_id}))
    op.drop_index("uq_request_lines_batch_custom_id", table_name="request_lines")
    with op.batch_alter_table("request_lines") as batch_op:
        batch_op.drop_index("ix_request_lines_batch_line")
        batch_op.create_unique_constraint("uq_request_lines_batch_custom_id",
                                          ["batch_id", "custom_id"])
        batch_op.drop_column("engine_fields")
    op.drop_table("batch_counters")
