"""/v1/batches: create (from a file or an inline ``requests`` array), list, retrieve, cancel."""

from __future__ import annotations

import datetime as dt
import logging
from typing import Annotated, Any

from fastapi import APIRouter, Query
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field
from sqlalchemy import bindparam, select, update
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session
from starlette.concurrency import run_in_threadpool

from api.create_eta import at_risk, create_estimate, line_estimates
from api.deps import AppContext, ContextDep, TenantDep, TenantRef
from api.errors import ApiError, not_found
from api.eta import LIVE_STATUSES, BatchEta
from api.pagination import paginate
from api.poll_reads import POLL_STATEMENT, batch_and_sums
from api.routes.files import get_file
from api.uploads import store_inline_requests
from metrics.counters import BATCHES_CREATED
from openai_format.types import ENDPOINTS, metadata_problem
from service import counters, ids
from service.counters import CounterDelta, LineTotals
from service.db import utcnow
from service.expiry import ExpiresAfterError, parse_expires_after
from service.models import (
    BATCH_UNFINISHED,
    CANCELLED,
    CANCELLING,
    FAILED,
    IN_PROGRESS,
    VALIDATING,
    Batch,
    File,
)
from service.objects import batch_object, live_totals, page
from service.queue_order import MAX_PRIORITY, MIN_PRIORITY
from service.quotas import TOKEN_LIMIT_EXCEEDED, QuotaExceeded, limit_for, reserve
from service.served_models import (
    ModelNotServed,
    WrongModelKind,
    check_endpoint,
    resolve_request_model,
)
from service.settings import parse_completion_window
from service.webhooks import check_url_literal, queue_event

log = logging.getLogger(__name__)

router = APIRouter(tags=["batches"])


class InlineRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    custom_id: str
    body: dict[str, Any]
    method: str = "POST"
    url: str | None = None


class ExpiresAfterRequest(BaseModel):
    """OpenAI's ``{anchor: "created_at", seconds}``; checked by ``service.expiry``."""

    model_config = ConfigDict(extra="forbid")

    anchor: Any
    seconds: Any


class BatchCreateRequest(BaseModel):
    """OpenAI's fields, plus boxcar's ``requests`` (instead of a file) and ``webhook_url``."""

    input_file_id: str | None = None
    endpoint: str
    completion_window: str = "24h"
    metadata: dict[str, str] | None = None
    # When the output and error files expire, counted from their creation.
    output_expires_after: ExpiresAfterRequest | None = None
    requests: list[InlineRequest] | None = None
    webhook_url: str | None = None
    # Among batches due in the same deadline bucket, higher runs first (service.queue_order).
    priority: int = Field(0, ge=MIN_PRIORITY, le=MAX_PRIORITY)


def check_priority(priority: int, *, max_priority: int) -> None:
    """The schema allows 0-100; a tenant may ask for at most the operator's cap."""
    if priority > max_priority:
        raise ApiError(400, f"priority {priority} is above the highest this service lets a "
                       f"tenant ask for ({max_priority}; BOXCAR_MAX_PRIORITY).",
                       param="priority", code="invalid_priority")


def check_metadata(metadata: dict[str, str] | None) -> None:
    """OpenAI's limits: 16 pairs, keys up to 64 characters, values up to 512."""
    problem = None if metadata is None else metadata_problem(metadata)
    if problem is not None:
        raise ApiError(400, f"metadata {problem}.", param="metadata", code="invalid_metadata")


# Built once (every status poll runs it): bound per call.
_GET_BATCH = select(Batch).where(Batch.id == bindparam("batch_id"),
                                 Batch.tenant_id == bindparam("tenant_id"))


def get_batch(session: Session, *, tenant_id: str, batch_id: str) -> Batch:
    row = session.scalars(_GET_BATCH, {"batch_id": batch_id, "tenant_id": tenant_id}).first()
    if row is None:
        raise not_found("batch", batch_id)
    return row


LIVE = BATCH_UNFINISHED


def render(session: Session, row: Batch, ctx: AppContext,
           sums: CounterDelta | None = None) -> dict:
    """The batch object; a live batch's counts come from its counters (``sums``, or read
    here), never from its lines. Its ETA from ``ctx.etas``, which a poll never waits on once
    it holds a value (``api.eta.EtaCache``)."""
    if row.status not in LIVE:
        return batch_object(row)
    etas = ctx.etas.get(session, estimated(row))
    if sums is None:
        return live_object(row, live_totals(session, [row])[row.id], etas)
    return live_object(row, counters.as_totals(row.num_total, sums), etas)


def estimated(row: Batch) -> str | None:
    """The id a poll names to ``ctx.etas`` (``api.eta.EtaCache``): a batch validating, in
    progress or finalizing, which every estimate covers, so a value without it predates it."""
    return row.id if row.status in LIVE_STATUSES else None


def live_object(row: Batch, totals: LineTotals, etas: dict[str, BatchEta]) -> dict:
    eta = etas.get(row.id)
    return batch_object(row, totals,
                        estimated_completion_at=eta.estimated_completion_at if eta else None,
                        deadline_at_risk=eta.late if eta else False)


@router.post("/v1/batches")
def create_batch(request: BatchCreateRequest, tenant: TenantDep, ctx: ContextDep) -> dict:
    settings = ctx.settings
    if request.endpoint not in ENDPOINTS:
        raise ApiError(400, f"Invalid endpoint {request.endpoint!r}: supported are "
                       f"{', '.join(ENDPOINTS)}.", param="endpoint", code="invalid_endpoint")
    if request.completion_window not in settings.completion_windows:
        raise ApiError(400, f"Invalid completion_window {request.completion_window!r}: supported "
                       f"are {', '.join(settings.completion_windows)}.",
                       param="completion_window", code="invalid_completion_window")
    window = parse_completion_window(request.completion_window)
    check_priority(request.priority, max_priority=settings.max_priority)
    check_metadata(request.metadata)
    output_lifetime = settings.output_expires_after
    if request.output_expires_after is not None:
        try:
            output_lifetime = parse_expires_after(
                request.output_expires_after.anchor, request.output_expires_after.seconds,
                field="output_expires_after").seconds
        except ExpiresAfterError as exc:
            raise ApiError(400, f"{exc}.", param=exc.param,
                           code="invalid_expires_after") from exc
    if request.webhook_url:
        try:
            check_url_literal(request.webhook_url, allow_private=settings.webhook_allow_private)
        except ValueError as exc:
            raise ApiError(400, str(exc), param="webhook_url", code="invalid_webhook_url") from exc
    if (request.input_file_id is None) == (request.requests is None):
        raise ApiError(400, "Give exactly one of input_file_id and requests.",
                       param="input_file_id", code="invalid_request")
    if request.requests is not None and not request.requests:
        raise ApiError(400, "requests must not be empty.", param="requests",
                       code="invalid_request")
    if request.requests is not None and len(request.requests) > settings.max_inline_requests:
        raise ApiError(400, f"requests holds more than {settings.max_inline_requests} items; "
                       "upload a file instead.", param="requests", code="invalid_request")

    body = create_from_request(request, tenant, ctx, window, output_lifetime)
    announce_created(ctx, tenant_id=tenant.id, batch_id=body["id"])
    return body


def announce_created(ctx: AppContext, *, tenant_id: str, batch_id: str) -> None:
    """After a create's commit: the tenant's list in this process shows the batch from now on,
    and a worker is woken to prepare it."""
    if ctx.polls is not None:
        ctx.polls.forget(tenant_id=tenant_id)
    BATCHES_CREATED.inc()
    ctx.queue.batch_changed(batch_id)


def create_from_request(request: BatchCreateRequest, tenant: TenantRef, ctx: AppContext,
                        window: int, output_lifetime: int | None, *,
                        max_bytes: int | None = None, max_lines: int | None = None,
                        all_invalid_ok: bool = False) -> dict:
    """The batch row (and, for inline ``requests``, its input file) of a checked create
    request, committed; its batch object. ``max_bytes`` / ``max_lines``: an inline file's
    limits where they are not the service's; ``all_invalid_ok``: a file without a valid line
    still makes a batch, which fails at prepare with each line's error (Anthropic's Message
    Batches, where each request is then an errored result)."""
    settings = ctx.settings
    tenant_id = tenant.id
    inline_file: File | None = None
    try:
        with ctx.db.session() as session:
            if request.requests is not None:
                file = inline_file = store_inline_requests(
                    session, ctx.storage, tenant_id=tenant_id, endpoint=request.endpoint,
                    requests=(r.model_dump() for r in request.requests),
                    max_bytes=max_bytes or settings.max_file_bytes,
                    max_lines=max_lines or settings.max_file_lines,
                    expires_after=settings.file_expires_after,
                    max_embedding_inputs=settings.max_batch_embedding_inputs,
                )
            else:
                file = get_file(session, tenant_id=tenant_id, file_id=request.input_file_id)
                if file.purpose != "batch":
                    raise ApiError(400, f"File {file.id} has purpose {file.purpose!r}; a batch "
                                   "needs a file uploaded with purpose 'batch'.",
                                   param="input_file_id", code="invalid_file")
            if file.num_lines - file.num_errors <= 0 and not all_invalid_ok:
                raise ApiError(400, f"File {file.id} has no valid request lines "
                               f"({file.num_errors} lines with problems; see the file's "
                               "line_errors).", param="input_file_id", code="invalid_file")
            model = served_model(session, ctx, file.model, request.endpoint)
            now = utcnow()
            row = Batch(
                id=ids.batch_id(), tenant_id=tenant_id, endpoint=request.endpoint,
                input_file_id=file.id, completion_window=request.completion_window,
                status=VALIDATING, metadata_=request.metadata, model=model,
                webhook_url=request.webhook_url, priority=request.priority, created_at=now,
                output_expires_after=output_lifetime, enqueued_tokens=file.enqueued_tokens,
                expires_at=now + dt.timedelta(seconds=window), num_total=file.num_lines,
            )
            limit = limit_for(key_limit=tenant.max_enqueued_tokens,
                              default=settings.max_enqueued_tokens)
            try:
                reserve(session, tenant_id=tenant_id, model=model,
                        tokens=file.enqueued_tokens, limit=limit)
            except QuotaExceeded as exc:
                # OpenAI's answer: the batch is created and fails its validation.
                row.status, row.failed_at, row.enqueued_tokens = FAILED, now, 0
                row.errors = [{"code": TOKEN_LIMIT_EXCEEDED, "message": str(exc),
                               "param": None, "line": None}]
            eta = _estimate_at_create(session, ctx, row, file)
            risk = None if eta is None else at_risk(eta)
            if risk is not None and settings.refuse_at_risk:
                row.status, row.failed_at, row.enqueued_tokens = FAILED, now, 0
                row.errors = [risk.error()]
            session.add(row)
            session.flush()
            body = batch_object(
                row, estimated_completion_at=None if eta is None else eta.estimated_completion_at,
                deadline_at_risk=risk is not None)
            if risk is not None and row.status != FAILED:
                body["boxcar_warnings"] = [risk.warning()]
                queue_event(session, tenant_id=tenant_id, event_type="batch.at_risk",
                            object_id=row.id, data=body, object_url=row.webhook_url)
            if row.status == FAILED:
                queue_event(session, tenant_id=tenant_id, event_type="batch.failed",
                            object_id=row.id, data=body, object_url=row.webhook_url)
            return body
    except Exception:
        if inline_file is not None:  # its row is rolled back: drop its bytes too
            ctx.storage.delete(inline_file.storage_key)
        raise


def _estimate_at_create(session: Session, ctx: AppContext, row: Batch,
                        file: File) -> BatchEta | None:
    """The estimate of a batch being created (``api.create_eta``); None when it failed its
    validation already, or the estimate cannot be made (a storage error: logged, the batch is
    created without one). A database error is not swallowed: it leaves the session's
    transaction broken, so the create fails with it (a 503 when the database is away, not a
    500 from the next statement on that session)."""
    if row.status != VALIDATING:
        return None
    try:
        row.est_prompt_tokens_per_line, row.est_output_tokens_per_line = line_estimates(
            ctx.storage, file)
        return create_estimate(session, row,
                               worker_metrics_interval=ctx.settings.worker_metrics_interval)
    except SQLAlchemyError:
        raise
    except Exception:  # noqa: BLE001 - an estimate is a courtesy; the batch is still created
        log.exception("estimating batch %s at create failed", row.id)
        return None


def served_model(session: Session, ctx: AppContext, name: str | None, endpoint: str) -> str:
    """The id of the served model ``name`` names (None: the default); a 400 on ``model`` when
    no worker serves it (work is never run on another model) or when the model is of the other
    kind (a chat endpoint for an embedding model, or the reverse)."""
    try:
        entry = resolve_request_model(session, ctx.settings, name)
        check_endpoint(entry, endpoint)
    except ModelNotServed as exc:
        raise ApiError(400, str(exc), param="model", code="model_not_found") from exc
    except WrongModelKind as exc:
        raise ApiError(400, str(exc), param="model", code="wrong_model_kind") from exc
    return entry.id


@router.get("/v1/batches", response_model=None)
async def list_batches(
    tenant: TenantDep,
    ctx: ContextDep,
    after: str | None = None,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
) -> JSONResponse:
    # The first page (what a client polling its batches asks) is one statement on the event
    # loop, as a retrieve is (``api.poll_reads``), or this process's recent read of it
    # (``api.poll_snapshots``); a page after a cursor reads on a thread.
    if after is None and ctx.polls is not None:
        rows = await ctx.polls.first_page(tenant_id=tenant.id, num_rows=limit + 1)
        shown = [batch_and_sums(row) for row in rows[:limit]]
        etas: dict[str, BatchEta] = {}
        for batch_id in (estimated(batch) for batch, _ in shown if batch.status in LIVE):
            found = ctx.etas.get_nowait(batch_id)  # as render() asks, never waiting on the loop
            etas = found if found is not None else await run_in_threadpool(
                _etas_on_thread, ctx, batch_id)
        items = [batch_object(batch) if batch.status not in LIVE else
                 live_object(batch, counters.as_totals(batch.num_total, sums), etas)
                 for batch, sums in shown]
        return JSONResponse(page(items, has_more=len(rows) > limit))
    return JSONResponse(await run_in_threadpool(_list_on_thread, ctx, tenant, after, limit))


def _list_on_thread(ctx: AppContext, tenant: TenantRef, after: str | None, limit: int) -> dict:
    with ctx.db.read_session() as session:
        cursor = get_batch(session, tenant_id=tenant.id, batch_id=after) if after else None
        found: dict[str, CounterDelta] = {}

        def sums_of_page(rows: list[Batch]) -> None:  # one statement for the page's live ones
            found.update(counters.sums(session, [r.id for r in rows if r.status in LIVE]))

        return paginate(session, select(Batch).where(Batch.tenant_id == tenant.id),
                        cursor=cursor, limit=limit, before_render=sums_of_page,
                        render=lambda row: render(session, row, ctx,
                                                  found.get(row.id, CounterDelta())))


@router.get("/v1/batches/{batch_id}", response_model=None)
async def retrieve_batch(batch_id: str, tenant: TenantDep, ctx: ContextDep) -> JSONResponse:
    # One statement, outside a transaction, on the event loop where the driver allows
    # (``api.poll_reads``): on a busy machine every round trip and every hop between threads is
    # a wait for a CPU. The body is encoded here: FastAPI's encoding of a returned dict would
    # walk it once more.
    # A batch polled in the last seconds is answered from this process's recent read of it
    # (``api.poll_snapshots``).
    if ctx.polls is None:
        params = {"batch_id": batch_id, "tenant_id": tenant.id}
        return JSONResponse(await run_in_threadpool(_retrieve_on_thread, ctx, params))
    row = await ctx.polls.row(batch_id=batch_id, tenant_id=tenant.id)
    if row is None:
        raise not_found("batch", batch_id)
    batch, sums = batch_and_sums(row)
    if batch.status not in LIVE:
        return JSONResponse(batch_object(batch))
    etas = ctx.etas.get_nowait(estimated(batch))
    if etas is None:  # none yet, or old: estimate on a thread, never on the loop
        etas = await run_in_threadpool(_etas_on_thread, ctx, estimated(batch))
    return JSONResponse(live_object(batch, counters.as_totals(batch.num_total, sums), etas))


def _retrieve_on_thread(ctx: AppContext, params: dict[str, str]) -> dict:
    with ctx.db.autocommit_session() as session:
        row = session.execute(POLL_STATEMENT, params).first()
        if row is None:
            raise not_found("batch", params["batch_id"])
        batch, sums = batch_and_sums(row)
        return render(session, batch, ctx, sums)


def _etas_on_thread(ctx: AppContext, batch_id: str | None) -> dict[str, BatchEta]:
    with ctx.db.read_session() as session:
        return ctx.etas.get(session, batch_id)


@router.post("/v1/batches/{batch_id}/cancel")
def cancel_batch(batch_id: str, tenant: TenantDep, ctx: ContextDep) -> dict:
    with ctx.db.session() as session:
        row = get_batch(session, tenant_id=tenant.id, batch_id=batch_id)
        if row.status not in (VALIDATING, IN_PROGRESS, CANCELLING, CANCELLED):
            raise ApiError(409, f"Batch {batch_id} cannot be cancelled: it is {row.status}.",
                           code="invalid_state")
        # Conditional, so a batch that finished meanwhile is left alone.
        session.execute(
            update(Batch)
            .where(Batch.id == row.id, Batch.status.in_((VALIDATING, IN_PROGRESS)))
            .values(status=CANCELLING, cancelling_at=utcnow())
        )
        session.refresh(row)
        body = render(session, row, ctx)
    if ctx.polls is not None:
        ctx.polls.forget(tenant_id=tenant.id, batch_id=batch_id)
    ctx.queue.batch_changed(batch_id)  # wakes a worker to abort and finalize
    return body
