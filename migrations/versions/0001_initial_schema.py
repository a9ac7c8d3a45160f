"""initial schema

Revision ID: 0001
Revises:
Create Date: 2026-11-29 09:39:20.525470
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

import service.db

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "tenants",
        sa.Column("id", sa.String(length=64), nullable=False),
        sa.Column("name", sa.String(length=200), nullable=False),
        sa.Column("webhook_secret", sa.String(length=100), nullable=False),
        sa.Column("created_at", service.db.UTCDateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_table(
        "api_keys",
        sa.Column("id", sa.String(length=64), nullable=False),
        sa.Column("tenant_id", sa.String(length=64), nullable=False),
        sa.Column("key_hash", sa.String(length=64), nullable=False),
        sa.Column("key_prefix", sa.String(length=16), nullable=False),
        sa.Column("name", sa.String(length=200), nullable=True),
        sa.Column("created_at", service.db.UTCDateTime(timezone=True), nullable=False),
        sa.Column("revoked_at", service.db.UTCDateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(
            ["tenant_id"],
            ["tenants.id"],
        ),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("key_hash"),
    )
    with op.batch_alter_table("api_keys", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_api_keys_tenant_id"), ["tenant_id"], unique=False)

    op.create_table(
        "files",
        sa.Column("pk", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("id", sa.String(length=64), nullable=False),
        sa.Column("tenant_id", sa.String(length=64), nullable=False),
        sa.Column("filename", sa.String(length=500), nullable=False),
        sa.Column("purpose", sa.String(length=32), nullable=False),
        sa.Column("bytes", sa.Integer(), nullable=False),
        sa.Column("storage_key", sa.String(length=500), nullable=False),
        sa.Column("num_lines", sa.Integer(), nullable=False),
        sa.Column("num_errors", sa.Integer(), nullable=False),
        sa.Column("line_errors", sa.JSON(), nullable=True),
        sa.Column("created_at", service.db.UTCDateTime(timezone=True), nullable=False),
        sa.Column("deleted_at", service.db.UTCDateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(
            ["tenant_id"],
            ["tenants.id"],
        ),
        sa.PrimaryKeyConstraint("pk"),
        sa.UniqueConstraint("id"),
    )
    with op.batch_alter_table("files", schema=None) as batch_op:
        batch_op.create_index("ix_files_tenant_pk", ["tenant_id", "pk"], unique=False)

    op.create_table(
        "jobs",
        sa.Column("pk", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("id", sa.String(length=64), nullable=False),
        sa.Column("tenant_id", sa.String(length=64), nullable=False),
        sa.Column("endpoint", sa.String(length=64), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("priority", sa.Integer(), nullable=False),
        sa.Column("webhook_url", sa.String(length=2000), nullable=True),
        sa.Column("metadata", sa.JSON(), nullable=True),
        sa.Column("created_at", service.db.UTCDateTime(timezone=True), nullable=False),
        sa.Column("completed_at", service.db.UTCDateTime(timezone=True), nullable=True),
        sa.Column("failed_at", service.db.UTCDateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(
            ["tenant_id"],
            ["tenants.id"],
        ),
        sa.PrimaryKeyConstraint("pk"),
        sa.UniqueConstraint("id"),
    )
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.create_index("ix_jobs_tenant_pk", ["tenant_id", "pk"], unique=False)

    op.create_table(
        "webhook_deliveries",
        sa.Column("pk", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("id", sa.String(length=64), nullable=False),
        sa.Column("tenant_id", sa.String(length=64), nullable=False),
        sa.Column("endpoint_id", sa.String(length=64), nullable=True),
        sa.Column("event_type", sa.String(length=64), nullable=False),
        sa.Column("object_id", sa.String(length=64), nullable=False),
        sa.Column("url", sa.String(length=2000), nullable=False),
        sa.Column("payload", sa.Text(), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("next_attempt_at", service.db.UTCDateTime(timezone=True), nullable=True),
        sa.Column("last_status_code", sa.Integer(), nullable=True),
        sa.Column("last_error", sa.Text(), nullable=True),
        sa.Column("attempt_log", sa.JSON(), nullable=True),
        sa.Column("created_at", service.db.UTCDateTime(timezone=True), nullable=False),
        sa.Column("delivered_at", service.db.UTCDateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(
            ["tenant_id"],
            ["tenants.id"],
        ),
        sa.PrimaryKeyConstraint("pk"),
        sa.UniqueConstraint("id"),
    )
    with op.batch_alter_table("webhook_deliveries", schema=None) as batch_op:
        batch_op.create_index(
            "ix_webhook_deliveries_due", ["status", "next_attempt_at"], unique=False
        )
        batch_op.create_index("ix_webhook_deliveries_tenant_pk", ["tenant_id", "pk"], unique=False)

    op.create_table(
        "webhook_endpoints",
        sa.Column("id", sa.String(length=64), nullable=False),
        sa.Column("tenant_id", sa.String(length=64), nullable=False),
        sa.Column("url", sa.String(length=2000), nullable=False),
        sa.Column("events", sa.JSON(), nullable=True),
        sa.Column("secret", sa.String(length=100), nullable=False),
        sa.Column("created_at", service.db.UTCDateTime(timezone=True), nullable=False),
        sa.Column("deleted_at", service.db.UTCDateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(
            ["tenant_id"],
            ["tenants.id"],
        ),
        sa.PrimaryKeyConstraint("id"),
    )
    with op.batch_alter_table("webhook_endpoints", schema=None) as batch_op:
        batch_op.create_index(
            batch_op.f("ix_webhook_endpoints_tenant_id"), ["tenant_id"], unique=False
        )

    op.create_table(
        "batches",
        sa.Column("pk", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("id", sa.String(length=64), nullable=False),
        sa.Column("tenant_id", sa.String(length=64), nullable=False),
        sa.Column("endpoint", sa.String(length=64), nullable=False),
        sa.Column("input_file_id", sa.String(length=64), nullable=False),
        sa.Column("completion_window", sa.String(length=16), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("outcome", sa.String(length=16), nullable=True),
        sa.Column("output_file_id", sa.String(length=64), nullable=True),
        sa.Column("error_file_id", sa.String(length=64), nullable=True),
        sa.Column("errors", sa.JSON(), nullable=True),
        sa.Column("metadata", sa.JSON(), nullable=True),
        sa.Column("model", sa.String(length=200), nullable=True),
        sa.Column("webhook_url", sa.String(length=2000), nullable=True),
        sa.Column("priority", sa.Integer(), nullable=False),
        sa.Column("created_at", service.db.UTCDateTime(timezone=True), nullable=False),
        sa.Column("in_progress_at", service.db.UTCDateTime(timezone=True), nullable=True),
        sa.Column("expires_at", service.db.UTCDateTime(timezone=True), nullable=True),
        sa.Column("finalizing_at", service.db.UTCDateTime(timezone=True), nullable=True),
        sa.Column("completed_at", service.db.UTCDateTime(timezone=True), nullable=True),
        sa.Column("failed_at", service.db.UTCDateTime(timezone=True), nullable=True),
        sa.Column("expired_at", service.db.UTCDateTime(timezone=True), nullable=True),
        sa.Column("cancelling_at", service.db.UTCDateTime(timezone=True), nullable=True),
        sa.Column("cancelled_at", service.db.UTCDateTime(timezone=True), nullable=True),
        sa.Column("num_total", sa.Integer(), nullable=False),
        sa.Column("num_completed", sa.Integer(), nullable=False),
        sa.Column("num_failed", sa.Integer(), nullable=False),
        sa.Column("input_tokens", sa.Integer(), nullable=False),
        sa.Column("output_tokens", sa.Integer(), nullable=False),
        sa.Column("cached_tokens", sa.Integer(), nullable=False),
        sa.Column("lease_owner", sa.String(length=100), nullable=True),
        sa.Column("lease_expires_at", service.db.UTCDateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(
            ["input_file_id"],
            ["files.id"],
        ),
        sa.ForeignKeyConstraint(
            ["tenant_id"],
            ["tenants.id"],
        ),
        sa.PrimaryKeyConstraint("pk"),
        sa.UniqueConstraint("id"),
    )
    with op.batch_alter_table("batches", schema=None) as batch_op:
        batch_op.create_index("ix_batches_status", ["status"], unique=False)
        batch_op.create_index("ix_batches_tenant_pk", ["tenant_id", "pk"], unique=False)

    op.create_table(
        "request_lines",
        sa.Column("pk", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("tenant_id", sa.String(length=64), nullable=False),
        sa.Column("batch_id", sa.String(length=64), nullable=True),
        sa.Column("job_id", sa.String(length=64), nullable=True),
        sa.Column("shard_id", sa.String(length=100), nullable=True),
        sa.Column("line_no", sa.Integer(), nullable=False),
        sa.Column("position", sa.Integer(), nullable=True),
        sa.Column("custom_id", sa.String(length=512), nullable=True),
        sa.Column("endpoint", sa.String(length=64), nullable=False),
        sa.Column("body", sa.JSON(), nullable=True),
        sa.Column("sort_key", sa.String(length=200), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("response", sa.JSON(), nullable=True),
        sa.Column("error", sa.JSON(), nullable=True),
        sa.Column("request_id", sa.String(length=64), nullable=True),
        sa.Column("prompt_tokens", sa.Integer(), nullable=False),
        sa.Column("completion_tokens", sa.Integer(), nullable=False),
        sa.Column("cached_tokens", sa.Integer(), nullable=False),
        sa.Column("worker_id", sa.String(length=100), nullable=True),
        sa.Column("finished_at", service.db.UTCDateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(
            ["batch_id"],
            ["batches.id"],
        ),
        sa.ForeignKeyConstraint(
            ["job_id"],
            ["jobs.id"],
        ),
        sa.PrimaryKeyConstraint("pk"),
        sa.UniqueConstraint("batch_id", "custom_id", name="uq_request_lines_batch_custom_id"),
    )
    with op.batch_alter_table("request_lines", schema=None) as batch_op:
        batch_op.create_index("ix_request_lines_batch_status", ["batch_id", "status"], unique=False)
        batch_op.create_index("ix_request_lines_job", ["job_id"], unique=False)
        batch_op.create_index("ix_request_lines_shard_status", ["shard_id", "status"], unique=False)

    op.create_table(
        "shards",
        sa.Column("id", sa.String(length=100), nullable=False),
        sa.Column("tenant_id", sa.String(length=64), nullable=False),
        sa.Column("batch_id", sa.String(length=64), nullable=True),
        sa.Column("job_id", sa.String(length=64), nullable=True),
        sa.Column("priority", sa.Integer(), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("num_lines", sa.Integer(), nullable=False),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("lease_owner", sa.String(length=100), nullable=True),
        sa.Column("lease_expires_at", service.db.UTCDateTime(timezone=True), nullable=True),
        sa.Column("created_at", service.db.UTCDateTime(timezone=True), nullable=False),
        sa.Column("finished_at", service.db.UTCDateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(
            ["batch_id"],
            ["batches.id"],
        ),
        sa.ForeignKeyConstraint(
            ["job_id"],
            ["jobs.id"],
        ),
        sa.ForeignKeyConstraint(
            ["tenant_id"],
            ["tenants.id"],
        ),
        sa.PrimaryKeyConstraint("id"),
    )
    with op.batch_alter_table("shards", schema=None) as batch_op:
        batch_op.create_index("ix_shards_batch", ["batch_id"], unique=False)
        batch_op.create_index("ix_shards_claim", ["status", "priority", "created_at"], unique=False)



def downgrade() -> None:
    with op.batch_alter_table("shards", schema=None) as batch_op:
        batch_op.drop_index("ix_shards_claim")
        batch_op.drop_index("ix_shards_batch")

    op.drop_table("shards")
    with op.batch_alter_table("request_lines", schema=None) as batch_op:
        batch_op.drop_index("ix_request_lines_shard_status")
        batch_op.drop_index("ix_request_lines_job")
        batch_op.drop_index("ix_request_lines_batch_status")

    op.drop_table("request_lines")
    with op.batch_alter_table("batches", schema=None) as batch_op:
        batch_op.drop_index("ix_batches_tenant_pk")
        batch_op.drop_index("ix_batches_status")

    op.drop_table("batches")
    with op.batch_alter_table("webhook_endpoints", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_webhook_endpoints_tenant_id"))

    op.drop_table("webhook_endpoints")
    with op.batch_alter_table("webhook_deliveries", schema=None) as batch_op:
        batch_op.drop_index("ix_webhook_deliveries_tenant_pk")
        batch_op.drop_index("ix_webhook_deliveries_due")

    op.drop_table("webhook_deliveries")
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.drop_index("ix_jobs_tenant_pk")

    op.drop_table("jobs")
    with op.batch_alter_table("files", schema=None) as batch_op:
        batch_op.drop_index("ix_files_tenant_pk")

    op.drop_table("files")
    with op.batch_alter_table("api_keys", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_api_keys_tenant_id"))

    op.drop_table("api_keys")
    op.drop_table("tenants")
