"""A boxcar batch of ``/v1/messages`` lines as Anthropic's Message Batches API shows it: the
``MessageBatch`` object (``processing_status``, ``request_counts``, RFC 3339 times) and its
results, one JSON line per request (``{custom_id, result}``), from the batch's line rows."""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Iterable, Iterator
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from openai_format.parse import SERVER_ERROR
from service.counters import LineTotals
from service.models import (
    BATCH_TERMINAL,
    CANCELLED,
    CANCELLING,
    EXPIRED,
    LINE_CANCELLED,
    LINE_COMPLETED,
    LINE_EXPIRED,
    LINE_FAILED,
    Batch,
    File,
    RequestLine,
)
from service.storage import ObjectStorage, iter_lines

# A line's status -> its key in ``request_counts`` and its result's ``type``.
_KINDS = {LINE_COMPLETED: "succeeded", LINE_FAILED: "errored", LINE_CANCELLED: "canceled",
          LINE_EXPIRED: "expired"}
KINDS = ("processing", "succeeded", "errored", "canceled", "expired")
_ROWS_PER_READ = 500


def rfc3339(value: dt.datetime | None) -> str | None:
    if value is None:
        return None
    if value.tzinfo is None:
        value = value.replace(tzinfo=dt.UTC)
    return value.isoformat().replace("+00:00", "Z")


def processing_status(row: Batch) -> str:
    if row.status in BATCH_TERMINAL:
        return "ended"
    return "canceling" if row.status == CANCELLING else "in_progress"


def _unrun_kind(row: Batch) -> str:
    """What a request of an ended batch that never got a line row counts as."""
    return {CANCELLED: "canceled", EXPIRED: "expired"}.get(row.status, "errored")


def live_counts(totals: LineTotals) -> dict[str, int]:
    """A running batch's counts: its finished lines so far (failed ones as errored; which of
    them end canceled or expired is known once it ends) and the rest processing."""
    return {"processing": totals.total - totals.completed - totals.failed,
            "succeeded": totals.completed, "errored": totals.failed, "canceled": 0,
            "expired": 0}


def num_requests(session: Session, rows: Iterable[Batch]) -> dict[str, int]:
    """The requests of each batch: its input file's lines (a batch ended before its prepare
    counted them has a ``num_total`` of 0)."""
    by_file = {row.input_file_id: row.id for row in rows}
    found = session.execute(select(File.id, File.num_lines).where(File.id.in_(list(by_file))))
    return {by_file[file_id]: num for file_id, num in found}


def ended_counts(session: Session, rows: Iterable[Batch]) -> dict[str, dict[str, int]]:
    """The counts of ended batches, by batch id, in two statements for all of them."""
    ended = {row.id: row for row in rows}
    counts = {batch_id: dict.fromkeys(KINDS, 0) for batch_id in ended}
    if not ended:
        return counts
    totals = num_requests(session, ended.values())
    found = session.execute(
        select(RequestLine.batch_id, RequestLine.status, func.count())
        .where(RequestLine.batch_id.in_(list(ended))).group_by(RequestLine.batch_id,
                                                               RequestLine.status))
    for batch_id, status, num in found:
        kind = _KINDS.get(status)
        if kind is not None and batch_id is not None:
            counts[batch_id][kind] += num
    for batch_id, row in ended.items():  # requests that never became a line row
        left = totals.get(batch_id, row.num_total) - sum(counts[batch_id].values())
        counts[batch_id][_unrun_kind(row)] += max(left, 0)
    return counts


def message_batch_object(row: Batch, counts: dict[str, int], *,
                         results_url: str) -> dict[str, Any]:
    """The ``MessageBatch``; ``results_url`` is shown once it has ended."""
    ended = row.status in BATCH_TERMINAL
    return {
        "id": row.id,
        "type": "message_batch",
        "processing_status": processing_status(row),
        "request_counts": counts,
        "created_at": rfc3339(row.created_at),
        "expires_at": rfc3339(row.expires_at),
        "ended_at": rfc3339(row.completed_at or row.cancelled_at or row.expired_at
                            or row.failed_at) if ended else None,
        "cancel_initiated_at": rfc3339(row.cancelling_at),
        "archived_at": None,
        "results_url": results_url if ended else None,
    }


def _errored(code: str | None, message: str) -> dict[str, Any]:
    kind = "api_error" if code == SERVER_ERROR else "invalid_request_error"
    return {"type": "errored",
            "error": {"type": "error", "error": {"type": kind, "message": message}}}


def _result(line: RequestLine) -> dict[str, Any]:
    kind = _KINDS.get(line.status)
    if kind == "succeeded":
        return {"type": "succeeded", "message": line.response}
    if kind == "errored":
        error = line.error or {}
        return _errored(error.get("code"), error.get("message") or "the request failed")
    return {"type": kind or "errored"}


def result_lines(session: Session, storage: ObjectStorage, row: Batch,
                 input_key: str | None) -> Iterator[bytes]:
    """The ended batch's results as JSONL, in request order; a request that never became a
    line row (a batch that failed at create, or ended before it was prepared) is read from the
    input file (``input_key``) and given the batch's outcome."""
    seen: set[str] = set()
    query = (select(RequestLine).where(RequestLine.batch_id == row.id)
             .order_by(RequestLine.line_no).execution_options(yield_per=_ROWS_PER_READ))
    for line in session.scalars(query):
        if line.custom_id is None or line.custom_id in seen:
            continue
        seen.add(line.custom_id)
        yield _dump(line.custom_id, _result(line))
    if input_key is None or len(seen) >= num_requests(session, [row]).get(row.id, 0):
        return
    kind = _unrun_kind(row)
    reason = (row.errors or [{}])[0].get("message") or f"the batch {row.status} before it ran"
    result = _errored(None, reason) if kind == "errored" else {"type": kind}
    for raw in iter_lines(storage, input_key):
        custom_id = json.loads(raw).get("custom_id") if raw.strip() else None
        if isinstance(custom_id, str) and custom_id not in seen:
            seen.add(custom_id)
            yield _dump(custom_id, result)


def _dump(custom_id: str, result: dict[str, Any]) -> bytes:
    return json.dumps({"custom_id": custom_id, "result": result},
                      ensure_ascii=False).encode() + b"\n"
