"""/v1/jobs: one chat or completion request, answered asynchronously ahead of bulk lines."""

from __future__ import annotations

import json
from typing import Annotated, Any

from fastapi import APIRouter, Query
from pydantic import BaseModel, Field
from sqlalchemy import select
from sqlalchemy.orm import Session

from api.deps import ContextDep, TenantDep
from api.errors import ApiError, not_found
from api.pagination import paginate
from api.routes.batches import check_metadata, check_priority, served_model
from metrics.counters import JOBS_CREATED
from openai_format.parse import LineError, parse_line
from openai_format.sampling import engine_fields
from openai_format.types import CHAT_URL, COMPLETIONS_URL, EMBEDDINGS_URL, ENDPOINTS
from service import ids
from service.lines import sort_key, stored_body
from service.models import JOB_PRIORITY_BASE, JOB_QUEUED, Job, RequestLine, Shard
from service.objects import job_object
from service.queue_order import MAX_PRIORITY, MIN_PRIORITY
from service.webhooks import check_url_literal

router = APIRouter(tags=["jobs"])


class JobCreateRequest(BaseModel):
    """``body`` is a /v1/chat/completions, /v1/completions or /v1/embeddings request body;
    ``endpoint`` defaults to chat when the body has ``messages``, to embeddings when it has
    ``input``."""

    body: dict[str, Any]
    endpoint: str | None = None
    webhook_url: str | None = None
    # Among jobs, higher runs first; every job runs ahead of bulk lines (service.queue_order).
    priority: int = Field(0, ge=MIN_PRIORITY, le=MAX_PRIORITY)
    metadata: dict[str, str] | None = None


def _endpoint_of(body: dict[str, Any]) -> str:
    """A body's endpoint when the job names none: chat with ``messages``, embeddings with
    ``input`` (and no ``prompt``), else completions."""
    if "messages" in body:
        return CHAT_URL
    if "input" in body and "prompt" not in body:
        return EMBEDDINGS_URL
    return COMPLETIONS_URL


def get_job(session: Session, *, tenant_id: str, job_id: str) -> Job:
    row = session.scalars(select(Job).where(Job.id == job_id, Job.tenant_id == tenant_id)).first()
    if row is None:
        raise not_found("job", job_id)
    return row


def job_line(session: Session, job_id: str) -> RequestLine | None:
    return session.scalars(select(RequestLine).where(RequestLine.job_id == job_id)).first()


@router.post("/v1/jobs")
def create_job(request: JobCreateRequest, tenant: TenantDep, ctx: ContextDep) -> dict:
    endpoint = request.endpoint or _endpoint_of(request.body)
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
    with ctx.db.session() as session:
        model = served_model(session, ctx, parsed.body.model, endpoint)
        job = Job(id=job_id, tenant_id=tenant.id, endpoint=endpoint, model=model,
                  status=JOB_QUEUED,
                  priority=request.priority, webhook_url=request.webhook_url,
                  metadata_=request.metadata)
        session.add(job)
        session.flush()
        session.add(Shard(id=shard_id, tenant_id=tenant.id, job_id=job_id, model=model,
                          priority=JOB_PRIORITY_BASE + request.priority, num_lines=1))
        session.add(RequestLine(
            tenant_id=tenant.id, job_id=job_id, shard_id=shard_id, line_no=1, position=0,
            custom_id=job_id, endpoint=endpoint, body=stored_body(parsed),
            engine_fields=engine_fields(parsed.body), sort_key=sort_key(parsed),
        ))
        session.flush()
        body = job_object(job, None)
    JOBS_CREATED.inc()
    ctx.queue.shards_ready([shard_id], jobs=True, model=model)
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
