"""/v1/files: upload (streamed and checked line by line), list, retrieve, content, delete."""

from __future__ import annotations

import itertools
from typing import Annotated, Literal

from fastapi import APIRouter, Query, Request
from fastapi.responses import StreamingResponse
from sqlalchemy import select
from sqlalchemy.orm import Session
from starlette.concurrency import run_in_threadpool

from api.body import feed_body
from api.deps import ContextDep, TenantDep
from api.errors import ApiError, not_found
from api.pagination import paginate
from api.uploads import JsonlIngest, MultipartStream, file_too_large
from metrics.counters import FILES_UPLOADED
from service import ids
from service.db import utcnow
from service.expiry import ExpiresAfterError, expires_at, not_expired, parse_expires_after
from service.models import File
from service.objects import file_object
from service.settings import Settings

router = APIRouter(tags=["files"])

MULTIPART_OVERHEAD = 64 << 10


def get_file(session: Session, *, tenant_id: str, file_id: str) -> File:
    """A file of the tenant's that is neither deleted nor expired (else a 404)."""
    row = session.scalars(
        select(File).where(File.id == file_id, File.tenant_id == tenant_id,
                           not_expired(utcnow()))
    ).first()
    if row is None:
        raise not_found("file", file_id)
    return row


# The body is parsed by hand (streamed); this tells clients and the OpenAPI schema its shape.
UPLOAD_BODY = {"requestBody": {"required": True, "content": {"multipart/form-data": {"schema": {
    "type": "object", "required": ["file", "purpose"],
    "properties": {"file": {"type": "string", "format": "binary"},
                   "purpose": {"type": "string", "enum": ["batch"]},
                   "expires_after[anchor]": {"type": "string", "enum": ["created_at"]},
                   "expires_after[seconds]": {"type": "integer", "minimum": 3600,
                                              "maximum": 2592000}},
}}}}}


@router.post("/v1/files", summary="Upload a JSONL batch input file (multipart: file, purpose)",
             openapi_extra=UPLOAD_BODY)
async def create_file(request: Request, tenant: TenantDep, ctx: ContextDep) -> dict:
    settings = ctx.settings
    length = request.headers.get("content-length")
    # A declared length past the limit is answered before the body is read (the same 400 as
    # the streamed check below gives; not a 413: OpenAI's shape names the field).
    if length and length.isdigit() and int(length) > settings.max_file_bytes + MULTIPART_OVERHEAD:
        raise file_too_large(settings.max_file_bytes)
    ingest = JsonlIngest(ctx.storage, ids.file_id(), settings.max_file_bytes,
                         settings.max_file_lines, settings.max_batch_embedding_inputs)
    parser = MultipartStream(request.headers.get("content-type"), ingest.feed)
    try:
        await _receive(request, parser)
        purpose = parser.fields.get("purpose")
        if purpose is None:
            raise ApiError(400, "Missing required parameter: 'purpose'.", param="purpose",
                           code="invalid_request")
        if purpose != "batch":
            raise ApiError(400, f"Invalid purpose {purpose!r}: this service accepts 'batch' files.",
                           param="purpose", code="invalid_purpose")
        if not parser.saw_file:
            raise ApiError(400, "Missing required parameter: 'file'.", param="file",
                           code="invalid_request")
        lifetime = upload_lifetime(parser.fields, settings)
        await run_in_threadpool(ingest.finish)
    except BaseException:
        await run_in_threadpool(ingest.abort)
        raise

    def save() -> dict:
        row = ingest.to_file(tenant_id=tenant.id, filename=parser.filename or "upload.jsonl",
                             purpose="batch")
        row.created_at = utcnow()
        row.expires_at = expires_at(row.created_at, lifetime)
        with ctx.db.session() as session:
            session.add(row)
        FILES_UPLOADED.inc()
        return file_object(row)

    try:
        return await run_in_threadpool(save)
    except Exception:
        await run_in_threadpool(ctx.storage.delete, ingest.storage_key)
        raise


def upload_lifetime(fields: dict[str, str], settings: Settings) -> int | None:
    """Seconds the upload lives: its ``expires_after`` (the form fields the openai SDK sends,
    ``expires_after[anchor]`` and ``expires_after[seconds]``), else the deployment's."""
    anchor = fields.get("expires_after[anchor]")
    seconds = fields.get("expires_after[seconds]")
    if anchor is None and seconds is None:
        return settings.file_expires_after
    try:
        return parse_expires_after(anchor, seconds, field="expires_after").seconds
    except ExpiresAfterError as exc:
        raise ApiError(400, f"{exc}.", param=exc.param, code="invalid_expires_after") from exc


async def _receive(request: Request, parser: MultipartStream) -> None:
    await feed_body(request, parser.feed)
    parser.finish()


@router.get("/v1/files")
def list_files(
    tenant: TenantDep,
    ctx: ContextDep,
    purpose: str | None = None,
    limit: Annotated[int, Query(ge=1, le=10_000)] = 10_000,
    order: Literal["asc", "desc"] = "desc",
    after: str | None = None,
) -> dict:
    with ctx.db.read_session() as session:
        query = select(File).where(File.tenant_id == tenant.id, not_expired(utcnow()))
        if purpose:
            query = query.where(File.purpose == purpose)
        cursor = get_file(session, tenant_id=tenant.id, file_id=after) if after else None
        return paginate(session, query, cursor=cursor, limit=limit, render=file_object,
                        descending=order == "desc")


@router.get("/v1/files/{file_id}")
def retrieve_file(file_id: str, tenant: TenantDep, ctx: ContextDep) -> dict:
    with ctx.db.read_session() as session:
        return file_object(get_file(session, tenant_id=tenant.id, file_id=file_id))


@router.get("/v1/files/{file_id}/content", response_class=StreamingResponse)
def file_content(file_id: str, tenant: TenantDep, ctx: ContextDep) -> StreamingResponse:
    with ctx.db.read_session() as session:
        row = get_file(session, tenant_id=tenant.id, file_id=file_id)
    chunks = ctx.storage.iter_chunks(row.storage_key)
    # Open the object before the status line goes out: storage that is down is then a 503,
    # not a 200 whose body breaks off.
    first = next(chunks, b"")
    return StreamingResponse(
        itertools.chain([first], chunks),
        media_type="application/octet-stream",
        headers={"content-disposition": f'attachment; filename="{row.filename}"',
                 "content-length": str(row.bytes)},
    )


@router.delete("/v1/files/{file_id}")
def delete_file(file_id: str, tenant: TenantDep, ctx: ContextDep) -> dict:
    with ctx.db.session() as session:
        row = get_file(session, tenant_id=tenant.id, file_id=file_id)
        row.deleted_at = utcnow()
        key = row.storage_key
    ctx.storage.delete(key)
    return {"id": file_id, "object": "file", "deleted": True}
