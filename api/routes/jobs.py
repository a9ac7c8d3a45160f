"""/v1/jobs: one chat or completion request, answered asynchronously ahead of bulk lines."""

from __future__ import annotations

import json
from typing import Annotated, Any

from fastapi import APIRouter, Query
from pydantic import BaseModel, Field
from sqlalchemy import select
from sqlalchemy.orm import Session

from api.deps import AppContext, ContextDep, TenantDep
from api.errors import ApiError, not_found
from api.pagination import paginate
from api.routes.batches import check_metadata, check_priority, served_model
from metrics.counters import JOBS_CREATED
from openai_format.engine_fields import engine_fields
from openai_format.parse import LineError, parse_line
from openai_format.types import (
    CHAT_URL,
    COMPLETIONS_URL,
    EMBEDDINGS_URL,
    ENDPOINTS,
    RERANK_URL,
    RESPONSES_URL,
    SCORE_URL,
)
from service import ids
from service.lines import enqueued_tokens, sort_key, stored_body
from service.models import JOB_PRIORITY_BASE, JOB_QUEUED, Job, RequestLine, Shard
from service.objects import job_object
from service.queue_order import MAX_PRIORITY, MIN_PRIORITY
from service.quotas import TOKEN_LIMIT_EXCEEDED, QuotaExceeded, limit_for, reserve
from service.served_models import (
    EMBEDDING,
    ModelNotServed,
    queue_model,
    resolve_request_model,
)
from service.webhooks import check_url_literal

router = APIRouter(tags=["jobs"])


class JobCreateRequest(BaseModel):
    """``body`` is a /v1/chat/completions, /v1/completions, /v1/responses or /v1/embeddings
    request body; ``endpoint`` defaults to chat when the body has ``messages``, to embeddings
    when it has ``input`` and names an embedding model (or names none and the default model is
    one), to responses when it has ``input`` otherwise, else to completions.
    """

    body: dict[str, Any]
    endpoint: str | None = None
    webhook_url: str | None = None
    # Among jobs, higher runs first; every job runs ahead of bulk lines (service.queue_order).
    priority: int = Field(0, ge=MIN_PRIORITY, le=MAX_PRIORITY)
    metadata: dict[str, str] | None = None


def _endpoint_of(body: dict[str, Any], ctx: AppContext) -> str:
    """A body's endpoint when the job names none (``JobCreateRequest``). Both /v1/responses and
    /v1/embeddings bodies carry ``input``: the model's kind, as its workers announced it,
    tells them apart (a model of no known kind, or a name no model answers to, is taken as a
    generation model; ``served_model`` then refuses what it must). A body with ``query`` and
    ``documents`` is a rerank, one with ``text_1`` and ``text_2`` a score."""
    if "messages" in body:
        return CHAT_URL
    if "query" in body and "documents" in body:
        return RERANK_URL
    if "text_1" in body and "text_2" in body:
        return SCORE_URL
    if "input" not in body or "prompt" in body:
        return COMPLETIONS_URL
    name = body.get("model")
    if name is not None and not isinstance(name, str):
        return RESPONSES_URL  # the body's own validation names the bad field
    with ctx.db.read_session() as session:
        try:
            entry = resolve_request_model(session, ctx.settings, name)
        except ModelNotServed:
            return RESPONSES_URL
    return EMBEDDINGS_URL if entry.kind == EMBEDDING else RESPONSES_URL


def get_job(session: Session, *, tenant_id: str, job_id: str) -> Job:
    row = session.scalars(select(Job).where(Job.id == job_id, Job.tenant_id == tenant_id)).first()
    if row is None:
        raise not_found("job", job_id)
    return row


def job_line(session: Session, job_id: str) -> RequestLine | None:
    return session.scalars(select(RequestLine).where(RequestLine.job_id == job_id)).first()


@router.post("/v1/jobs")
def create_job(request: JobCreateRequest, tenant: TenantDep, ctx: ContextDep) -> dict:
    endpoint = request.endpoint or _endpoint_of(request.body, ctx)
    if endpoint not in ENDPOINTS:
        raise ApiError(400, f"Invalid endpoint {endpoint!r}: supported are {', '.join(ENDPOINTS)}.",
                       param="endpoint", code="invalid_endpoint")
    check_priority(request.priority, max_priority=ctx.settings.max_priority)
    check_metadata(request.metadata)
    if request.webhook_url:
        try:
            check_url_literal(request.webhook_url,
                              allow_private=ctx.settings.webhook_allow_private)
        except ValueError as exc:
            raise ApiError(400, str(exc), param="webhook_url", code="invalid_webhook_url") from exc
    job_id = ids.job_id()
    raw = json.dumps({"custom_id": job_id, "method": "POST", "url": endpoint,
                      "body": request.body})
    parsed = parse_line(raw, line_no=1, endpoint=endpoint)
    if isinstance(parsed, LineError):
        raise ApiError(400, parsed.detail, code=parsed.code,
                       param="body")
    shard_id = ids.shard_id(job_id, 0)
    tokens = enqueued_tokens(parsed)
    with ctx.db.session() as session:
        model = served_model(session, ctx, parsed.body.model, endpoint)
        try:
            reserve(session, tenant_id=tenant.id, model=model, tokens=tokens,
                    limit=limit_for(key_limit=tenant.max_enqueued_tokens,
                                    default=ctx.settings.max_enqueued_tokens))
        except QuotaExceeded as exc:
            raise ApiError(429, str(exc), code=TOKEN_LIMIT_EXCEEDED,
                           retry_after=ctx.settings.quota_retry_after) from exc
        job = Job(id=job_id, tenant_id=tenant.id, endpoint=endpoint, model=model,
                  status=JOB_QUEUED,
                  priority=request.priority, webhook_url=request.webhook_url,
                  metadata_=request.metadata, enqueued_tokens=tokens)
        session.add(job)
        session.flush()
        queue = queue_model(ctx.settings, model)  # an adapter's job goes to its base's workers
        lora = model if queue != model else None
        session.add(Shard(id=shard_id, tenant_id=tenant.id, job_id=job_id, model=queue,
                          priority=JOB_PRIORITY_BASE + request.priority, num_lines=1))
        session.add(RequestLine(
            tenant_id=tenant.id, job_id=job_id, shard_id=shard_id, line_no=1, position=0,
            custom_id=job_id, endpoint=endpoint, body=stored_body(parsed),
            engine_fields=engine_fields(parsed.body, lora=lora), sort_key=sort_key(parsed),
            enqueued_tokens=tokens,
        ))
        session.flush()
        body = job_object(job, None)
    JOBS_CREATED.inc()
    ctx.queue.shards_ready([shard_id], jobs=True, model=queue)
    return body


@router.get("/v1/jobs")
def list_jobs(
    tenant: TenantDep,
    ctx: ContextDep,
    after: str | None = None,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
) -> dict:
    with ctx.db.read_session() as session:
        cursor = get_job(session, tenant_id=tenant.id, job_id=after) if after else None
        return paginate(session, select(Job).where(Job.tenant_id == tenant.id), cursor=cursor,
                        limit=limit, render=lambda row: job_object(row, job_line(session, row.id)))


@router.get("/v1/jobs/{job_id}")
def retrieve_job(job_id: str, tenant: TenantDep, ctx: ContextDep) -> dict:
    with ctx.db.read_session() as session:
        job = get_job(session, tenant_id=tenant.id, job_id=job_id)
        return job_object(job, job_line(session, job.id))
