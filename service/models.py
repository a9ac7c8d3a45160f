"""SQLAlchemy models: tenants and keys, files, batches, jobs, shards, request lines, webhooks.

The database is the source of truth. A request line's result lives on its row, written once:
every result write is conditional on the line still being open, and a line is unique on
(batch_id, custom_id), so output files built from these rows never repeat or lose a line.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

from sqlalchemy import JSON, BigInteger, Float, ForeignKey, Index, Integer, String, Text, text
from sqlalchemy.orm import Mapped, mapped_column

from openai_format.engine_fields import EngineFields
from service.db import Base, utcnow

# Batch statuses (OpenAI's).
VALIDATING = "validating"
FAILED = "failed"
IN_PROGRESS = "in_progress"
FINALIZING = "finalizing"
COMPLETED = "completed"
EXPIRED = "expired"
CANCELLING = "cancelling"
CANCELLED = "cancelled"
BATCH_TERMINAL = (FAILED, COMPLETED, EXPIRED, CANCELLED)
BATCH_UNFINISHED = (VALIDATING, IN_PROGRESS, FINALIZING, CANCELLING)  # the others

# Request line statuses; "pending" and "running" are open, the rest are final. A claimed
# shard's lines stay "pending" (the shard's lease says who runs them); "running" is only
# found in rows from before 0005_scale, which its upgrade turns back into "pending".
LINE_PENDING = "pending"
LINE_RUNNING = "running"
LINE_COMPLETED = "completed"
LINE_FAILED = "failed"
LINE_CANCELLED = "cancelled"
LINE_EXPIRED = "expired"
LINE_OPEN = (LINE_PENDING, LINE_RUNNING)

# Shard statuses.
SHARD_PENDING = "pending"
SHARD_RUNNING = "running"
SHARD_DONE = "done"

# Job statuses.
JOB_QUEUED = "queued"
JOB_IN_PROGRESS = "in_progress"
JOB_COMPLETED = "completed"
JOB_FAILED = "failed"

# Webhook delivery statuses.
DELIVERY_PENDING = "pending"
DELIVERY_DELIVERED = "delivered"
DELIVERY_FAILED = "failed"

# Single jobs outrank every bulk shard.
JOB_PRIORITY_BASE = 1000


def _json() -> Any:
    return mapped_column(JSON, nullable=True)


class Tenant(Base):
    __tablename__ = "tenants"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    name: Mapped[str] = mapped_column(String(200))
    webhook_secret: Mapped[str] = mapped_column(String(100))
    created_at: Mapped[dt.datetime] = mapped_column(default=utcnow)


class ApiKey(Base):
    __tablename__ = "api_keys"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id"), index=True)
    key_hash: Mapped[str] = mapped_column(String(64), unique=True)
    key_prefix: Mapped[str] = mapped_column(String(16))
    name: Mapped[str | None] = mapped_column(String(200))
    created_at: Mapped[dt.datetime] = mapped_column(default=utcnow)
    revoked_at: Mapped[dt.datetime | None]
    # This key's enqueued-token limit per model (None: the deployment's, service.quotas).
    max_enqueued_tokens: Mapped[int | None] = mapped_column(BigInteger)


class File(Base):
    __tablename__ = "files"
    __table_args__ = (Index("ix_files_tenant_pk", "tenant_id", "pk"),
                      Index("ix_files_expires_at", "expires_at"))

    pk: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    id: Mapped[str] = mapped_column(String(64), unique=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id"))
    filename: Mapped[str] = mapped_column(String(500))
    purpose: Mapped[str] = mapped_column(String(32))
    bytes: Mapped[int] = mapped_column(Integer)
    storage_key: Mapped[str] = mapped_column(String(500))
    num_lines: Mapped[int] = mapped_column(Integer, default=0)
    num_errors: Mapped[int] = mapped_column(Integer, default=0)
    line_errors: Mapped[list[dict[str, Any]] | None] = _json()
    # The model its lines name (the first one named; None: no line names one).
    model: Mapped[str | None] = mapped_column(String(200))
    # Prompt plus output tokens of its valid lines (service.lines.enqueued_tokens).
    enqueued_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    created_at: Mapped[dt.datetime] = mapped_column(default=utcnow)
    # When the housekeeper deletes it (None: kept until deleted); past it, it is not found.
    expires_at: Mapped[dt.datetime | None]
    deleted_at: Mapped[dt.datetime | None]


class Batch(Base):
    __tablename__ = "batches"
    __table_args__ = (
        Index("ix_batches_tenant_pk", "tenant_id", "pk"),
        Index("ix_batches_status", "status"),
    )

    pk: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    id: Mapped[str] = mapped_column(String(64), unique=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id"))
    endpoint: Mapped[str] = mapped_column(String(64))
    input_file_id: Mapped[str] = mapped_column(ForeignKey("files.id"))
    completion_window: Mapped[str] = mapped_column(String(16))
    status: Mapped[str] = mapped_column(String(16), default=VALIDATING)
    # The final status finalize is heading for (completed, expired, cancelled).
    outcome: Mapped[str | None] = mapped_column(String(16))
    output_file_id: Mapped[str | None] = mapped_column(String(64))
    error_file_id: Mapped[str | None] = mapped_column(String(64))
    errors: Mapped[list[dict[str, Any]] | None] = _json()
    metadata_: Mapped[dict[str, str] | None] = mapped_column("metadata", JSON, nullable=True)
    model: Mapped[str | None] = mapped_column(String(200))
    webhook_url: Mapped[str | None] = mapped_column(String(2000))
    priority: Mapped[int] = mapped_column(Integer, default=0)
    # Seconds after their creation that the output and error files expire (None: never).
    output_expires_after: Mapped[int | None] = mapped_column(Integer)
    # The tokens its lines hold against the tenant's quota (service.quotas): the file's count
    # at create, its valid lines' exact sum from prepare on; its closed lines release theirs
    # (``BatchCounter.released_tokens``).
    enqueued_tokens: Mapped[int] = mapped_column(BigInteger, default=0)

    created_at: Mapped[dt.datetime] = mapped_column(default=utcnow)
    in_progress_at: Mapped[dt.datetime | None]
    expires_at: Mapped[dt.datetime | None]
    finalizing_at: Mapped[dt.datetime | None]
    completed_at: Mapped[dt.datetime | None]
    failed_at: Mapped[dt.datetime | None]
    expired_at: Mapped[dt.datetime | None]
    cancelling_at: Mapped[dt.datetime | None]
    cancelled_at: Mapped[dt.datetime | None]

    # num_total is set at prepare; the others at finalize. While the batch runs its live
    # figures are the sums of its ``BatchCounter`` rows.
    num_total: Mapped[int] = mapped_column(Integer, default=0)
    num_completed: Mapped[int] = mapped_column(Integer, default=0)
    num_failed: Mapped[int] = mapped_column(Integer, default=0)
    input_tokens: Mapped[int] = mapped_column(Integer, default=0)
    output_tokens: Mapped[int] = mapped_column(Integer, default=0)
    cached_tokens: Mapped[int] = mapped_column(Integer, default=0)
    # Prepare's per-line estimates (service.lines.estimate_tokens), where the ETA starts.
    est_prompt_tokens_per_line: Mapped[float] = mapped_column(Float, default=0.0)
    est_output_tokens_per_line: Mapped[float] = mapped_column(Float, default=0.0)

    # Prepare's cursor (worker.prepare): its input lines, by line number, whose rows are
    # committed (a resumed prepare inserts only the lines after it), and when its last chunk
    # committed (None until then: finalize waits for it).
    prepared_lines: Mapped[int] = mapped_column(Integer, default=0)
    prepared_at: Mapped[dt.datetime | None]

    # Lease for the one-worker stages (validating -> in_progress, finalizing).
    lease_owner: Mapped[str | None] = mapped_column(String(100))
    lease_expires_at: Mapped[dt.datetime | None]


class Job(Base):
    __tablename__ = "jobs"
    __table_args__ = (Index("ix_jobs_tenant_pk", "tenant_id", "pk"),)

    pk: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    id: Mapped[str] = mapped_column(String(64), unique=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id"))
    endpoint: Mapped[str] = mapped_column(String(64))
    model: Mapped[str | None] = mapped_column(String(200))  # the served model's id
    status: Mapped[str] = mapped_column(String(16), default=JOB_QUEUED)
    priority: Mapped[int] = mapped_column(Integer, default=0)
    webhook_url: Mapped[str | None] = mapped_column(String(2000))
    metadata_: Mapped[dict[str, str] | None] = mapped_column("metadata", JSON, nullable=True)
    # Held against the tenant's quota while the job is queued or in progress.
    enqueued_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    created_at: Mapped[dt.datetime] = mapped_column(default=utcnow)
    completed_at: Mapped[dt.datetime | None]
    failed_at: Mapped[dt.datetime | None]


class Shard(Base):
    """A unit of work with a lease: a few hundred lines of one batch, or one single job."""

    __tablename__ = "shards"
    __table_args__ = (
        Index("ix_shards_claim", "status", "priority", "created_at"),
        Index("ix_shards_batch", "batch_id"),
        Index("ix_shards_model_claim", "model", "status"),
    )

    id: Mapped[str] = mapped_column(String(100), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id"))
    batch_id: Mapped[str | None] = mapped_column(ForeignKey("batches.id"))
    job_id: Mapped[str | None] = mapped_column(ForeignKey("jobs.id"))
    # The id of the served model that runs it: only that model's workers claim it (None: a
    # shard from before routing, which any worker may run).
    model: Mapped[str | None] = mapped_column(String(200))
    priority: Mapped[int] = mapped_column(Integer, default=0)
    status: Mapped[str] = mapped_column(String(16), default=SHARD_PENDING)
    num_lines: Mapped[int] = mapped_column(Integer, default=0)
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    lease_owner: Mapped[str | None] = mapped_column(String(100))
    lease_expires_at: Mapped[dt.datetime | None]
    created_at: Mapped[dt.datetime] = mapped_column(default=utcnow)
    finished_at: Mapped[dt.datetime | None]


# Percent of a request_lines page that prepare fills: the rest is room for its lines' results.
REQUEST_LINES_FILLFACTOR = 40


class RequestLine(Base):
    """One request (a batch input line or a single job's body) and, once final, its result."""

    __tablename__ = "request_lines"
    # No index names a column that a result write changes (status, response, ...), and
    # prepare leaves half of each page free: a result is a HOT update, written in the line's
    # page with no new index entries (0006_hot_results).
    __table_args__ = (
        # Lines that run are unique on (batch_id, custom_id), so output files never repeat a
        # custom_id; a line failed at prepare (a repeated custom_id among them) has no shard
        # and keeps its custom_id for its error-file line without taking part.
        Index("uq_request_lines_batch_custom_id", "batch_id", "custom_id", unique=True,
              postgresql_where=text("shard_id IS NOT NULL"),
              sqlite_where=text("shard_id IS NOT NULL")),
        Index("ix_request_lines_shard", "shard_id"),
        Index("ix_request_lines_job", "job_id"),
        # Finalize streams a batch's lines in input order off this index (no sort); it also
        # finds a batch's lines for the rarer reads (its open lines at finalize or cancel).
        Index("ix_request_lines_batch_line", "batch_id", "line_no"),
        {"postgresql_with": {"fillfactor": REQUEST_LINES_FILLFACTOR}},
    )

    pk: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    tenant_id: Mapped[str] = mapped_column(String(64))
    batch_id: Mapped[str | None] = mapped_column(ForeignKey("batches.id"))
    job_id: Mapped[str | None] = mapped_column(ForeignKey("jobs.id"))
    shard_id: Mapped[str | None] = mapped_column(String(100))
    line_no: Mapped[int] = mapped_column(Integer)
    position: Mapped[int | None] = mapped_column(Integer)  # order within the batch's run
    # None only for lines that never had one (not JSON, none given): the batch's errors name
    # them by line number.
    custom_id: Mapped[str | None] = mapped_column(String(512))
    endpoint: Mapped[str] = mapped_column(String(64))
    body: Mapped[dict[str, Any] | None] = _json()
    # What the engine needs, validated once when the line was stored
    # (``openai_format.engine_fields``): the drain loop builds the prompt and SamplingParams
    # from it without parsing the body again. None in rows from before 0005_scale, which are
    # parsed from ``body`` as before. A JSON column: the type is what its readers get back.
    engine_fields: Mapped[EngineFields | None] = _json()
    sort_key: Mapped[str] = mapped_column(String(200), default="")
    status: Mapped[str] = mapped_column(String(16), default=LINE_PENDING)
    response: Mapped[dict[str, Any] | None] = _json()  # the response body of a completed line
    error: Mapped[dict[str, Any] | None] = _json()  # {"code", "message"} of a failed line
    request_id: Mapped[str | None] = mapped_column(String(64))
    prompt_tokens: Mapped[int] = mapped_column(Integer, default=0)
    completion_tokens: Mapped[int] = mapped_column(Integer, default=0)
    cached_tokens: Mapped[int] = mapped_column(Integer, default=0)
    # Its share of its batch's or job's quota (service.lines.enqueued_tokens), released when
    # it closes; written once, at prepare.
    enqueued_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    worker_id: Mapped[str | None] = mapped_column(String(100))
    finished_at: Mapped[dt.datetime | None]


# A batch's live counters are spread over one row per worker that wrote to it (its slot,
# ``service.counters.slot_of``) and slot 0 (prepare, recount): two workers never queue on one
# counter row, and a status read sums as many rows as workers ran the batch, not its lines.


class BatchCounter(Base):
    """One slot of a batch's live counters: lines still open, finished lines and their usage.

    Every change is made in the transaction that changes the lines it counts (prepare's insert,
    a result write, a poison shard, finalize closing what is left), so the sums over a batch's
    slots equal what its lines say; status reads them instead of the lines."""

    __tablename__ = "batch_counters"

    batch_id: Mapped[str] = mapped_column(ForeignKey("batches.id"), primary_key=True)
    slot: Mapped[int] = mapped_column(Integer, primary_key=True)
    num_open: Mapped[int] = mapped_column(Integer, default=0)
    num_completed: Mapped[int] = mapped_column(Integer, default=0)
    num_failed: Mapped[int] = mapped_column(Integer, default=0)
    input_tokens: Mapped[int] = mapped_column(Integer, default=0)
    output_tokens: Mapped[int] = mapped_column(Integer, default=0)
    cached_tokens: Mapped[int] = mapped_column(Integer, default=0)
    # Enqueued tokens of the lines this slot closed (released from the tenant's quota).
    released_tokens: Mapped[int] = mapped_column(BigInteger, default=0)


class WebhookEndpoint(Base):
    __tablename__ = "webhook_endpoints"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id"), index=True)
    url: Mapped[str] = mapped_column(String(2000))
    events: Mapped[list[str] | None] = _json()  # None: every event
    secret: Mapped[str] = mapped_column(String(100))
    created_at: Mapped[dt.datetime] = mapped_column(default=utcnow)
    deleted_at: Mapped[dt.datetime | None]


class WebhookDelivery(Base):
    """One event to one URL: the delivery log, and the retry queue while pending."""

    __tablename__ = "webhook_deliveries"
    __table_args__ = (
        Index("ix_webhook_deliveries_due", "status", "next_attempt_at"),
        Index("ix_webhook_deliveries_tenant_pk", "tenant_id", "pk"),
    )

    pk: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    id: Mapped[str] = mapped_column(String(64), unique=True)  # the webhook-id header
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id"))
    endpoint_id: Mapped[str | None] = mapped_column(String(64))  # None: the object's own url
    event_type: Mapped[str] = mapped_column(String(64))
    object_id: Mapped[str] = mapped_column(String(64))
    url: Mapped[str] = mapped_column(String(2000))
    payload: Mapped[str] = mapped_column(Text)  # the exact bytes signed and sent
    status: Mapped[str] = mapped_column(String(16), default=DELIVERY_PENDING)
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    next_attempt_at: Mapped[dt.datetime | None]
    last_status_code: Mapped[int | None] = mapped_column(Integer)
    last_error: Mapped[str | None] = mapped_column(Text)
    attempt_log: Mapped[list[dict[str, Any]] | None] = _json()
    created_at: Mapped[dt.datetime] = mapped_column(default=utcnow)
    delivered_at: Mapped[dt.datetime | None]


class WorkerStatus(Base):
    """A live worker: its heartbeat and latest engine metrics snapshot (``metrics.catalog``),
    written every few seconds; the API's /metrics, the dashboard and ``boxcar status`` read it."""

    __tablename__ = "workers"

    id: Mapped[str] = mapped_column(String(100), primary_key=True)
    model: Mapped[str | None] = mapped_column(String(200))
    started_at: Mapped[dt.datetime] = mapped_column(default=utcnow)
    heartbeat_at: Mapped[dt.datetime] = mapped_column(default=utcnow, index=True)
    metrics: Mapped[dict[str, Any] | None] = _json()


class ServedModel(Base):
    """A model some worker loaded: its id, the other names it answers to, and when a worker
    last said it serves it (``service.served_models``)."""

    __tablename__ = "models"

    id: Mapped[str] = mapped_column(String(200), primary_key=True)
    aliases: Mapped[list[str] | None] = _json()
    # "generation" or "embedding" (service.served_models.KINDS); None: not announced yet
    kind: Mapped[str | None] = mapped_column(String(20), nullable=True)
    created_at: Mapped[dt.datetime] = mapped_column(default=utcnow)  # first seen
    last_seen_at: Mapped[dt.datetime] = mapped_column(default=utcnow)
