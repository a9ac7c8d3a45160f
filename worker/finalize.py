"""Finalize: a batch's output and error files, built from its line rows, and its final status.

First a read with no lock: a running batch whose counters (``service.counters``) still show open
lines, within its window, is not ready, nor one whose prepare has not committed its last chunk
(``worker.prepare.prepare_unfinished``: its counters do not count the lines still to come), and
nothing is written. So a batch is finalized once,
when the writer that closed its last line (or a cancel, the deadline, the periodic scan) says so,
not tried at every finished shard. Then, under a lease on the batch row: decide the outcome
(completed when no line is open, which the lines themselves confirm; cancelled after a cancel;
expired past the completion window), close every open line with ``batch_cancelled`` /
``batch_expired`` (one conditional UPDATE, so a worker's late result either lands before it or
not at all, counted in the counters), stream the rows in input order into the two JSONL files,
then set counts, usage, file ids and the status, and queue the webhook event, in one
transaction. Files are written before that transaction, under fixed keys: a retry overwrites
them.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
from typing import Any

from sqlalchemy import Text, cast, exists, func, select, update
from sqlalchemy.orm import Session

from metrics.counters import BATCHES_FINALIZED
from openai_format.ids import new_id
from openai_format.parse import SERVER_ERROR, status_code
from openai_format.responses import error_line, failed_line, output_line, output_line_json
from service import counters, ids
from service.counters import CounterDelta
from service.db import Database, utcnow
from service.expiry import expires_at
from service.models import (
    CANCELLED,
    CANCELLING,
    COMPLETED,
    EXPIRED,
    FINALIZING,
    IN_PROGRESS,
    LINE_CANCELLED,
    LINE_COMPLETED,
    LINE_EXPIRED,
    LINE_OPEN,
    SHARD_DONE,
    VALIDATING,
    Batch,
    BatchCounter,
    File,
    RequestLine,
    Shard,
)
from service.objects import batch_object
from service.storage import ObjectStorage
from service.webhooks import queue_event
from worker.prepare import claim_batch_lease, is_unfinished, prepare_unfinished

log = logging.getLogger(__name__)

FINALIZE_LEASE_SECONDS = 120.0
READ_CHUNK = 1000

_CLOSE = {
    CANCELLED: (LINE_CANCELLED, "batch_cancelled", "The batch was cancelled before this request "
                "ran."),
    EXPIRED: (LINE_EXPIRED, "batch_expired", "This request could not be executed before the "
              "completion window expired."),
}


def has_open_lines(session: Session, batch_id: str) -> bool:
    return session.scalar(select(exists().where(
        RequestLine.batch_id == batch_id, RequestLine.status.in_(LINE_OPEN)))) or False


def finalizable_batches(session: Session, *, now: dt.datetime | None = None,
                        limit: int = 50) -> list[str]:
    """Batches that need finalizing now: past their window, left half finalized by a worker
    whose lease ran out, or, once their prepare is over, cancelled or finished."""
    now = now or utcnow()
    lease_free = Batch.lease_expires_at.is_(None) | (Batch.lease_expires_at < now)
    num_open = (select(func.coalesce(func.sum(BatchCounter.num_open), 0))
                .where(BatchCounter.batch_id == Batch.id).scalar_subquery())
    query = select(Batch.id).where(lease_free, (
        (Batch.status == FINALIZING)
        # Even a prepare that never ends (its file is gone from storage) ends with its window.
        | (Batch.status.in_((VALIDATING, IN_PROGRESS, CANCELLING)) & (Batch.expires_at < now))
        | (~prepare_unfinished() & ((Batch.status == CANCELLING)
                                    | ((Batch.status == IN_PROGRESS) & (num_open <= 0))))
    )).order_by(Batch.pk).limit(limit)
    return list(session.scalars(query).all())


def _may_be_ready(session: Session, batch_id: str, now: dt.datetime) -> bool:
    """Whether finalize has anything to decide, read without a lock: a running batch with
    open lines left (its counters say) and time left is not ready, nor one whose prepare is
    unfinished (its lines are not all there)."""
    row = session.execute(select(Batch.status, Batch.outcome, Batch.expires_at,
                                 Batch.prepared_lines, Batch.prepared_at)
                          .where(Batch.id == batch_id)).one_or_none()
    if row is None or row.status not in (VALIDATING, IN_PROGRESS, CANCELLING, FINALIZING):
        return False
    expired = row.expires_at is not None and row.expires_at <= now
    if is_unfinished(row.status, row.prepared_lines, row.prepared_at):
        return expired
    if row.status != IN_PROGRESS or row.outcome is not None or expired:
        return row.status != VALIDATING or expired
    return counters.num_open(session, batch_id) <= 0


def _decide(session: Session, batch: Batch, now: dt.datetime) -> str | None:
    if batch.outcome is not None:
        return batch.outcome
    # Prepare stopped half way (its lease ran out): it resumes first, unless the window ended.
    if is_unfinished(batch.status, batch.prepared_lines, batch.prepared_at):
        return EXPIRED if batch.expires_at is not None and batch.expires_at <= now else None
    if batch.status == CANCELLING:
        return CANCELLED
    if batch.status == VALIDATING:
        return EXPIRED if batch.expires_at is not None and batch.expires_at <= now else None
    if batch.status != IN_PROGRESS:
        return None
    if counters.num_open(session, batch.id) <= 0:
        if not has_open_lines(session, batch.id):
            return COMPLETED
        # The counters and the lines disagree (they never should): the lines are the truth.
        log.error("batch %s: its counters show no open line but its lines do; recounting",
                  batch.id)
        counters.recount(session, batch.id)
    if batch.expires_at is not None and batch.expires_at <= now:
        return EXPIRED
    return None


def finalize_batch(
    db: Database, storage: ObjectStorage, batch_id: str, *, worker_id: str
) -> str | None:
    """Finalize ``batch_id`` if it is ready; returns its final status, or None."""
    now = utcnow()
    with db.read_session() as session:
        if not _may_be_ready(session, batch_id, now):
            return None
    with db.session() as session:
        if not claim_batch_lease(session, batch_id,
                                 statuses=(VALIDATING, IN_PROGRESS, CANCELLING, FINALIZING),
                                 worker_id=worker_id, seconds=FINALIZE_LEASE_SECONDS, now=now):
            return None
        batch = session.scalars(select(Batch).where(Batch.id == batch_id)).one()
        outcome = _decide(session, batch, now)
        if outcome is None:
            batch.lease_owner = batch.lease_expires_at = None
            return None
        batch.outcome = outcome
        if outcome != CANCELLED and batch.status != FINALIZING:
            batch.status = FINALIZING
            batch.finalizing_at = now
        if outcome in _CLOSE:
            status, code, message = _CLOSE[outcome]
            released = session.execute(
                update(RequestLine)
                .where(RequestLine.batch_id == batch_id, RequestLine.status.in_(LINE_OPEN))
                .values(status=status, error={"code": code, "message": message},
                        finished_at=now)
                .returning(RequestLine.enqueued_tokens)
                .execution_options(synchronize_session=False)
            ).scalars().all()
            num_closed = len(released)
            counters.add(session, {batch_id: CounterDelta(
                num_open=-num_closed, num_failed=num_closed, released_tokens=sum(released))},
                         slot=counters.slot_of(worker_id))
        session.execute(
            update(Shard).where(Shard.batch_id == batch_id, Shard.status != SHARD_DONE)
            .values(status=SHARD_DONE, finished_at=now, lease_expires_at=None)
            .execution_options(synchronize_session=False)
        )
    try:
        return _write_and_close(db, storage, batch_id, outcome, worker_id=worker_id)
    except Exception:
        log.exception("finalizing %s failed; another attempt follows when the lease ends",
                      batch_id)
        raise


def _write_files(
    db: Database, storage: ObjectStorage, batch_id: str
) -> tuple[int, int, int, int, int, int, int]:
    """Stream the rows into the output and error files; returns their byte sizes and totals."""
    completed = failed = input_tokens = output_tokens = cached = 0
    with (db.read_session() as session,
          storage.writer(f"batches/{batch_id}/output.jsonl") as out,
          storage.writer(f"batches/{batch_id}/errors.jsonl") as err):
        # The response as its stored text: spliced into the output line as it is (no decode
        # and encode per line) unless it needs unescaping (``output_line_json``).
        rows = session.execute(
            select(RequestLine.custom_id, RequestLine.status,
                   cast(RequestLine.response, Text).label("response_text"),
                   RequestLine.error, RequestLine.request_id, RequestLine.prompt_tokens,
                   RequestLine.completion_tokens, RequestLine.cached_tokens)
            .where(RequestLine.batch_id == batch_id)
            .order_by(RequestLine.line_no)
            .execution_options(yield_per=READ_CHUNK)
        )
        for row in rows:
            if row.status == LINE_COMPLETED:
                request_id = row.request_id or new_id("req_")
                text = row.response_text
                encoded = None if text is None else output_line_json(
                    row.custom_id, text, request_id=request_id)
                if encoded is None:
                    encoded = json.dumps(output_line(
                        row.custom_id, None if text is None else json.loads(text),
                        request_id=request_id), ensure_ascii=False)
                completed += 1
                input_tokens += row.prompt_tokens
                output_tokens += row.completion_tokens
                cached += row.cached_tokens
                out.write(encoded.encode() + b"\n")
            else:
                failed += 1
                line = _error_file_line(row)
                if line is not None:
                    err.write(json.dumps(line, ensure_ascii=False).encode() + b"\n")
        out_bytes, err_bytes = out.num_bytes, err.num_bytes
    return out_bytes, err_bytes, completed, failed, input_tokens, output_tokens, cached


def _error_file_line(row: Any) -> dict[str, Any] | None:
    """OpenAI's error-file line: a line that never ran (cancelled, expired) has ``error``; a
    refused or failed request has ``response`` with its HTTP error. A line without a custom_id
    (not JSON, none given) has no error-file line: the batch's ``errors`` name it by line."""
    error = row.error or {"code": SERVER_ERROR, "message": "no result"}
    custom_id = row.custom_id or error.get("custom_id")
    if not custom_id:
        return None
    code, message = error.get("code", SERVER_ERROR), error.get("message", "")
    if row.status in (LINE_CANCELLED, LINE_EXPIRED):
        return error_line(custom_id, code, message)
    return failed_line(custom_id, code, message, request_id=row.request_id or new_id("req_"),
                       param=error.get("param"), status_code=status_code(code))


def _write_and_close(
    db: Database, storage: ObjectStorage, batch_id: str, outcome: str, *, worker_id: str
) -> str:
    (out_bytes, err_bytes, completed, failed, input_tokens, output_tokens,
     cached) = _write_files(db, storage, batch_id)
    now = utcnow()
    with db.session() as session:
        batch = session.scalars(select(Batch).where(Batch.id == batch_id)).one()
        if batch.lease_owner != worker_id:
            log.warning("lost the finalize lease of %s; leaving it to the new holder", batch_id)
            return batch.status
        for kind, size, count in (("output", out_bytes, completed), ("errors", err_bytes, failed)):
            if not count:
                continue
            file = File(id=ids.file_id(), tenant_id=batch.tenant_id, purpose="batch_output",
                        filename=f"{batch_id}_{kind}.jsonl", bytes=size,
                        storage_key=f"batches/{batch_id}/{kind}.jsonl",
                        num_lines=count, num_errors=0, created_at=now,
                        expires_at=expires_at(now, batch.output_expires_after))
            session.add(file)
            if kind == "output":
                batch.output_file_id = file.id
            else:
                batch.error_file_id = file.id
        # Every line is final by now, and the files were written from all of them.
        batch.num_total, batch.num_completed, batch.num_failed = (
            completed + failed, completed, failed)
        batch.input_tokens, batch.output_tokens, batch.cached_tokens = (
            input_tokens, output_tokens, cached)
        batch.status = outcome
        setattr(batch, {COMPLETED: "completed_at", EXPIRED: "expired_at",
                        CANCELLED: "cancelled_at"}[outcome], now)
        batch.lease_owner = batch.lease_expires_at = None
        session.flush()
        queue_event(session, tenant_id=batch.tenant_id, event_type=f"batch.{outcome}",
                    object_id=batch.id, data=batch_object(batch), object_url=batch.webhook_url)
    BATCHES_FINALIZED.labels(outcome).inc()
    log.info("batch %s %s: %d completed, %d failed", batch_id, outcome, completed, failed)
    return outcome
