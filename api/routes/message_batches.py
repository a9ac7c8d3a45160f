"""/v1/messages/batches: Anthropic's Message Batches API (create, retrieve, list, cancel,
delete, results), on boxcar's batches. A Message Batch is a batch of ``/v1/messages`` lines (each
request's ``params`` its body, ``openai_format.messages_request``) created as OpenAI's inline
``requests`` are, so storage, quotas, prepare, the engine, finalize and webhooks are the same;
only the objects shown differ (``service.message_batches``). Errors are in Anthropic's shape
(``api.errors``); a request whose ``params`` cannot run fails alone, as an ``errored`` result."""

from __future__ import annotations

import re
from typing import Annotated, Any

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse, StreamingResponse
from sqlalchemy import select
from sqlalchemy.orm import Session
from starlette.concurrency import run_in_threadpool

from api.body import feed_body
from api.deps import AppContext, ContextDep, TenantDep, TenantRef
from api.errors import ApiError, not_found
from api.json_items import ArrayItems, JsonBodyError
from api.routes.batches import (
    LIVE,
    BatchCreateRequest,
    announce_created,
    cancel_batch,
    create_from_request,
)
from api.uploads import InlineRequestsFile
from openai_format.messages_request import (
    CUSTOM_ID,
    MAX_MESSAGE_BATCH_BYTES,
    MAX_MESSAGE_BATCH_REQUESTS,
)
from openai_format.types import MESSAGES_URL
from service.batch_removal import BatchNotEnded, delete_batch
from service.message_batches import (
    ended_counts,
    live_counts,
    message_batch_object,
    result_lines,
)
from service.models import Batch, File
from service.objects import live_totals
from service.settings import parse_completion_window

router = APIRouter(tags=["message batches"])

_CUSTOM_ID = re.compile(CUSTOM_ID)
_WINDOW = "24h"  # Anthropic's: a Message Batch ends within 24 hours
_REQUEST_FIELDS = frozenset({"custom_id", "params"})


def _invalid(message: str) -> ApiError:
    return ApiError(400, message, code="invalid_request")


class _RequestsReader:
    """A create body's ``requests``, checked and written to the batch's input file as the body
    arrives (``api.json_items``): a 400 naming the field for a body Anthropic refuses whole (a
    bad or repeated ``custom_id``, a ``params`` that is no object), and never the whole body in
    memory."""

    def __init__(self, ctx: AppContext) -> None:
        self.ctx = ctx
        self.items = ArrayItems("requests")
        self.file = InlineRequestsFile(
            ctx.storage, endpoint=MESSAGES_URL, max_bytes=MAX_MESSAGE_BATCH_BYTES,
            max_lines=MAX_MESSAGE_BATCH_REQUESTS,
            max_embedding_inputs=ctx.settings.max_batch_embedding_inputs)
        self.seen: dict[str, int] = {}

    def feed(self, data: bytes) -> None:
        try:
            items = self.items.feed(data)
        except JsonBodyError as exc:
            raise _body_error(exc) from None
        for item in items:
            self.file.add(self._check(len(self.seen), item))

    def store(self, tenant: TenantRef) -> str:
        """The input file's id, stored and committed."""
        try:
            self.items.finish()
        except JsonBodyError as exc:
            raise _body_error(exc) from None
        if not self.seen:
            raise _invalid("requests: List should have at least 1 item")
        with self.ctx.db.session() as session:
            row = self.file.store(session, tenant_id=tenant.id,
                                  expires_after=self.ctx.settings.file_expires_after)
            return row.id

    def _check(self, i: int, item: Any) -> dict[str, Any]:
        where = f"requests.{i}"
        if i >= MAX_MESSAGE_BATCH_REQUESTS:
            raise _invalid(f"requests: List should have at most "
                           f"{MAX_MESSAGE_BATCH_REQUESTS:,} items")
        if not isinstance(item, dict):
            raise _invalid(f"{where}: Input should be an object")
        for name in item:
            if name not in _REQUEST_FIELDS:
                raise _invalid(f"{where}.{name}: Extra inputs are not permitted")
        custom_id = item.get("custom_id")
        if not isinstance(custom_id, str) or not _CUSTOM_ID.match(custom_id):
            raise _invalid(f"{where}.custom_id: String should match pattern '{CUSTOM_ID}'"
                           + (f", got {custom_id!r}" if custom_id is not None else ""))
        if custom_id in self.seen:
            raise _invalid(f"{where}.custom_id: {custom_id!r} is already used by "
                           f"requests.{self.seen[custom_id]}; custom_id must be unique in a "
                           "batch")
        self.seen[custom_id] = i
        params = item.get("params")
        if not isinstance(params, dict):
            raise _invalid(f"{where}.params: Field required (the Messages API body)"
                           if params is None else f"{where}.params: Input should be an object")
        return {"custom_id": custom_id, "body": params, "url": MESSAGES_URL}


def _body_error(exc: JsonBodyError) -> ApiError:
    return _invalid(f"The request body is not {{\"requests\": [...]}} JSON: {exc}.")


async def _read_requests(request: Request, ctx: AppContext, tenant: TenantRef) -> str:
    """The body through a ``_RequestsReader`` as it arrives (``api.body``); the stored input
    file's id. A refused body's partial file is removed."""
    reader = _RequestsReader(ctx)
    try:
        await feed_body(request, reader.feed, max_bytes=MAX_MESSAGE_BATCH_BYTES,
                        too_large=f"The request is larger than the limit of "
                                  f"{MAX_MESSAGE_BATCH_BYTES:,} bytes per Message Batch.")
        return await run_in_threadpool(reader.store, tenant)
    except BaseException:
        reader.file.abort()
        raise


def results_url(request: Request, batch_id: str) -> str:
    return str(request.url_for("message_batch_results", message_batch_id=batch_id))


def _get(session: Session, *, tenant_id: str, batch_id: str) -> Batch:
    row = session.scalars(select(Batch).where(
        Batch.id == batch_id, Batch.tenant_id == tenant_id,
        Batch.endpoint == MESSAGES_URL)).first()
    if row is None:
        raise not_found("message batch", batch_id)
    return row


def _render(session: Session, rows: list[Batch], request: Request) -> list[dict[str, Any]]:
    """The batches' objects, their counts read in two statements for all of them."""
    live = live_totals(session, [row for row in rows if row.status in LIVE])
    ended = ended_counts(session, [row for row in rows if row.status not in LIVE])
    return [message_batch_object(
        row, live_counts(live[row.id]) if row.id in live else ended[row.id],
        results_url=results_url(request, row.id)) for row in rows]


def _object(ctx: AppContext, tenant: TenantRef, batch_id: str, request: Request) -> dict:
    with ctx.db.read_session() as session:
        return _render(session, [_get(session, tenant_id=tenant.id, batch_id=batch_id)],
                       request)[0]


# The body the create reads itself (streamed and checked by ``_RequestsReader``), for the
# OpenAPI docs.
_CREATE_BODY = {"requestBody": {"required": True, "content": {"application/json": {"schema": {
    "type": "object", "required": ["requests"], "additionalProperties": False, "properties": {
        "requests": {"type": "array", "minItems": 1, "maxItems": MAX_MESSAGE_BATCH_REQUESTS,
                     "items": {"type": "object", "required": ["custom_id", "params"],
                               "additionalProperties": False, "properties": {
                                   "custom_id": {"type": "string", "pattern": CUSTOM_ID},
                                   "params": {"type": "object",
                                              "description": "a Messages API body"}}}}}}}}}}


@router.post("/v1/messages/batches", openapi_extra=_CREATE_BODY)
async def create_message_batch(request: Request, tenant: TenantDep,
                               ctx: ContextDep) -> JSONResponse:
    file_id = await _read_requests(request, ctx, tenant)
    return JSONResponse(await run_in_threadpool(_create, file_id, tenant, ctx, request))


def _create(file_id: str, tenant: TenantRef, ctx: AppContext, request: Request) -> dict:
    create = BatchCreateRequest(endpoint=MESSAGES_URL, completion_window=_WINDOW,
                                input_file_id=file_id)
    body = create_from_request(create, tenant, ctx, parse_completion_window(_WINDOW),
                               ctx.settings.output_expires_after, all_invalid_ok=True)
    announce_created(ctx, tenant_id=tenant.id, batch_id=body["id"])
    return _object(ctx, tenant, body["id"], request)


@router.get("/v1/messages/batches/{message_batch_id}")
def retrieve_message_batch(message_batch_id: str, request: Request, tenant: TenantDep,
                           ctx: ContextDep) -> dict:
    return _object(ctx, tenant, message_batch_id, request)


@router.get("/v1/messages/batches")
def list_message_batches(
    request: Request, tenant: TenantDep, ctx: ContextDep,
    before_id: str | None = None, after_id: str | None = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 20,
) -> dict:
    """Newest first; ``after_id`` pages to older batches, ``before_id`` to newer ones."""
    if before_id is not None and after_id is not None:
        raise _invalid("before_id, after_id: give at most one of them")
    with ctx.db.read_session() as session:
        query = select(Batch).where(Batch.tenant_id == tenant.id, Batch.endpoint == MESSAGES_URL)
        if before_id is not None:
            cursor = _get(session, tenant_id=tenant.id, batch_id=before_id)
            rows = list(session.scalars(query.where(Batch.pk > cursor.pk)
                                        .order_by(Batch.pk.asc()).limit(limit + 1)))
            has_more = len(rows) > limit
            rows = rows[:limit][::-1]
        else:
            if after_id is not None:
                cursor = _get(session, tenant_id=tenant.id, batch_id=after_id)
                query = query.where(Batch.pk < cursor.pk)
            rows = list(session.scalars(query.order_by(Batch.pk.desc()).limit(limit + 1)))
            has_more = len(rows) > limit
            rows = rows[:limit]
        data = _render(session, rows, request)
    return {"data": data, "has_more": has_more,
            "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None}


@router.post("/v1/messages/batches/{message_batch_id}/cancel")
def cancel_message_batch(message_batch_id: str, request: Request, tenant: TenantDep,
                         ctx: ContextDep) -> dict:
    _object(ctx, tenant, message_batch_id, request)  # a 404 for another API's batch
    cancel_batch(message_batch_id, tenant, ctx)
    return _object(ctx, tenant, message_batch_id, request)


@router.delete("/v1/messages/batches/{message_batch_id}")
def delete_message_batch(message_batch_id: str, tenant: TenantDep, ctx: ContextDep) -> dict:
    with ctx.db.session() as session:
        row = _get(session, tenant_id=tenant.id, batch_id=message_batch_id)
        try:
            keys = delete_batch(session, batch=row)
        except BatchNotEnded as exc:
            raise _invalid(f"Message Batch {message_batch_id} cannot be deleted while it is "
                           "processing; cancel it and wait for it to end first.") from exc
    for key in keys:
        ctx.storage.delete(key)
    if ctx.polls is not None:
        ctx.polls.forget(tenant_id=tenant.id, batch_id=message_batch_id)
    return {"id": message_batch_id, "type": "message_batch_deleted"}


@router.get("/v1/messages/batches/{message_batch_id}/results",
            name="message_batch_results", response_model=None)
def message_batch_results(message_batch_id: str, tenant: TenantDep,
                          ctx: ContextDep) -> StreamingResponse:
    with ctx.db.read_session() as session:
        row = _get(session, tenant_id=tenant.id, batch_id=message_batch_id)
        if row.status in LIVE:
            raise _invalid(f"Message Batch {message_batch_id} has not ended: its results are "
                           "ready once processing_status is 'ended'.")
        file = session.scalars(select(File).where(File.id == row.input_file_id)).first()
        input_key = file.storage_key if file is not None and file.deleted_at is None else None
        session.expunge(row)

    def stream() -> Any:
        with ctx.db.read_session() as session:
            yield from result_lines(session, ctx.storage, row, input_key)

    return StreamingResponse(stream(), media_type="application/x-jsonl")
