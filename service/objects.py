"""Rows to API objects, in OpenAI's shapes (unix timestamps, ``object`` fields, lists)."""

from __future__ import annotations

import datetime as dt
from typing import Any

from sqlalchemy.orm import Session

from service import counters
from service.counters import LineTotals
from service.models import (
    BATCH_TERMINAL,
    FINALIZING,
    IN_PROGRESS,
    LINE_COMPLETED,
    VALIDATING,
    Batch,
    File,
    Job,
    RequestLine,
    WebhookDelivery,
    WebhookEndpoint,
)

# Statuses whose batch object carries an estimated completion time.
LIVE_ETA = (VALIDATING, IN_PROGRESS, FINALIZING)


def unix(value: dt.datetime | None) -> int | None:
    return None if value is None else int(value.timestamp())


def file_object(row: File) -> dict[str, Any]:
    return {
        "id": row.id,
        "object": "file",
        "bytes": row.bytes,
        "created_at": unix(row.created_at),
        "filename": row.filename,
        "purpose": row.purpose,
        "status": "processed",
        "expires_at": unix(row.expires_at),
        "status_details": (
            f"{row.num_errors} of {row.num_lines} lines have problems" if row.num_errors else None
        ),
        # boxcar's additions: what the line-by-line check found.
        "line_count": row.num_lines,
        "error_count": row.num_errors,
        "line_errors": row.line_errors or [],
    }


def live_totals(session: Session, rows: list[Batch]) -> dict[str, LineTotals]:
    """Counts and usage of running batches, from their counters (``service.counters``): a
    status read costs the same for ten lines or fifty thousand."""
    return counters.totals(session, ((row.id, row.num_total) for row in rows))


def stored_totals(row: Batch) -> LineTotals:
    return LineTotals(row.num_total, row.num_completed, row.num_failed, row.input_tokens,
                      row.output_tokens, row.cached_tokens)


def batch_object(row: Batch, totals: LineTotals | None = None, *,
                 estimated_completion_at: float | None = None,
                 deadline_at_risk: bool = False) -> dict[str, Any]:
    """``totals``: live totals of a running batch (``live_totals``); the stored ones once it
    is final.
    ``estimated_completion_at`` (unix seconds) and ``deadline_at_risk`` (the estimate passes
    ``expires_at``): ``api.eta``'s figures for a live batch."""
    if totals is None or row.status in BATCH_TERMINAL:
        totals = stored_totals(row)
    errors = None
    if row.errors:
        errors = {"object": "list", "data": [
            {"code": e.get("code"), "message": e.get("message"), "param": e.get("param"),
             "line": e.get("line")} for e in row.errors
        ]}
    input_tokens, cached = totals.input_tokens, totals.cached_tokens
    return {
        "id": row.id,
        "object": "batch",
        "endpoint": row.endpoint,
        "errors": errors,
        "input_file_id": row.input_file_id,
        "completion_window": row.completion_window,
        "status": row.status,
        "output_file_id": row.output_file_id,
        "error_file_id": row.error_file_id,
        "created_at": unix(row.created_at),
        "in_progress_at": unix(row.in_progress_at),
        "expires_at": unix(row.expires_at),
        "finalizing_at": unix(row.finalizing_at),
        "completed_at": unix(row.completed_at),
        "failed_at": unix(row.failed_at),
        "expired_at": unix(row.expired_at),
        "cancelling_at": unix(row.cancelling_at),
        "cancelled_at": unix(row.cancelled_at),
        "request_counts": {
            "total": totals.total, "completed": totals.completed, "failed": totals.failed,
        },
        "usage": {
            "input_tokens": input_tokens,
            "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": totals.output_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": input_tokens + totals.output_tokens,
        },
        "metadata": row.metadata_,
        "model": row.model,
        # boxcar's addition: the share of prompt tokens served from the prefix cache.
        "prefix_cache_hit_rate": round(cached / input_tokens, 4) if input_tokens else 0.0,
        # boxcar's additions: when a live batch should be done (null while unknown) and whether
        # that passes its deadline, the end of its completion window. To the millisecond, not
        # the whole seconds of OpenAI's timestamps: a short batch has a second or two left when
        # a quarter of it is done, and rounding alone would move that by up to half a second.
        "estimated_completion_at": (
            None if estimated_completion_at is None or row.status not in LIVE_ETA
            else round(estimated_completion_at, 3)),
        "deadline_at_risk": deadline_at_risk and row.status in LIVE_ETA,
    }


def job_object(job: Job, line: RequestLine | None) -> dict[str, Any]:
    result = error = None
    usage = None
    if line is not None:
        result = line.response if line.status == LINE_COMPLETED else None
        error = line.error
        if line.status == LINE_COMPLETED:
            usage = (line.response or {}).get("usage")
    return {
        "id": job.id,
        "object": "job",
        "endpoint": job.endpoint,
        "model": job.model,
        "status": job.status,
        "priority": job.priority,
        "created_at": unix(job.created_at),
        "completed_at": unix(job.completed_at),
        "failed_at": unix(job.failed_at),
        "metadata": job.metadata_,
        "webhook_url": job.webhook_url,
        "result": result,
        "error": error,
        "usage": usage,
    }


def endpoint_object(row: WebhookEndpoint, *, with_secret: bool = False) -> dict[str, Any]:
    obj = {
        "id": row.id,
        "object": "webhook_endpoint",
        "url": row.url,
        "events": row.events,
        "created_at": unix(row.created_at),
    }
    if with_secret:
        obj["secret"] = row.secret
    return obj


def delivery_object(row: WebhookDelivery) -> dict[str, Any]:
    return {
        "id": row.id,
        "object": "webhook_delivery",
        "event_type": row.event_type,
        "object_id": row.object_id,
        "endpoint_id": row.endpoint_id,
        "url": row.url,
        "status": row.status,
        "attempts": row.attempts,
        "last_status_code": row.last_status_code,
        "last_error": row.last_error,
        "next_attempt_at": unix(row.next_attempt_at) if row.status == "pending" else None,
        "created_at": unix(row.created_at),
        "delivered_at": unix(row.delivered_at),
        "attempt_log": row.attempt_log or [],
    }


def page(items: list[dict[str, Any]], *, has_more: bool) -> dict[str, Any]:
    return {
        "object": "list",
        "data": items,
        "first_id": items[0]["id"] if items else None,
        "last_id": items[-1]["id"] if items else None,
        "has_more": has_more,
    }
