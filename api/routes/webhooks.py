"""/v1/webhook_endpoints (per-tenant endpoints), /v1/webhook_deliveries (the delivery log) and
/v1/tenant (the secret that signs deliveries to a batch's or job's own ``webhook_url``)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query
from pydantic import BaseModel
from sqlalchemy import select

from api.deps import ContextDep, TenantDep
from api.errors import ApiError, not_found
from api.pagination import paginate
from service import ids
from service.db import utcnow
from service.keys import new_webhook_secret
from service.models import Tenant, WebhookDelivery, WebhookEndpoint
from service.objects import delivery_object, endpoint_object, page
from service.webhooks import EVENTS, check_url_literal

router = APIRouter(tags=["webhooks"])


class WebhookEndpointCreateRequest(BaseModel):
    url: str
    events: list[str] | None = None  # None: every event


@router.post("/v1/webhook_endpoints")
def create_endpoint(
    request: WebhookEndpointCreateRequest, tenant: TenantDep, ctx: ContextDep
) -> dict:
    try:
        check_url_literal(request.url, allow_private=ctx.settings.webhook_allow_private)
    except ValueError as exc:
        raise ApiError(400, str(exc), param="url", code="invalid_webhook_url") from exc
    unknown = sorted(set(request.events or []) - set(EVENTS))
    if unknown:
        raise ApiError(400, f"Unknown events {unknown}; known are {list(EVENTS)}.",
                       param="events", code="invalid_events")
    with ctx.db.session() as session:
        row = WebhookEndpoint(id=ids.webhook_endpoint_id(), tenant_id=tenant.id, url=request.url,
                              events=request.events, secret=new_webhook_secret())
        session.add(row)
        session.flush()
        return endpoint_object(row, with_secret=True)


@router.get("/v1/webhook_endpoints")
def list_endpoints(tenant: TenantDep, ctx: ContextDep) -> dict:
    with ctx.db.read_session() as session:
        rows = session.scalars(
            select(WebhookEndpoint).where(WebhookEndpoint.tenant_id == tenant.id,
                                          WebhookEndpoint.deleted_at.is_(None))
            .order_by(WebhookEndpoint.created_at)
        ).all()
        return page([endpoint_object(r) for r in rows], has_more=False)


@router.delete("/v1/webhook_endpoints/{endpoint_id}")
def delete_endpoint(endpoint_id: str, tenant: TenantDep, ctx: ContextDep) -> dict:
    with ctx.db.session() as session:
        row = session.get(WebhookEndpoint, endpoint_id)
        if row is None or row.tenant_id != tenant.id or row.deleted_at is not None:
            raise not_found("webhook endpoint", endpoint_id)
        row.deleted_at = utcnow()
    return {"id": endpoint_id, "object": "webhook_endpoint", "deleted": True}


@router.get("/v1/webhook_deliveries")
def list_deliveries(
    tenant: TenantDep,
    ctx: ContextDep,
    object_id: str | None = None,
    after: str | None = None,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
) -> dict:
    with ctx.db.read_session() as session:
        query = select(WebhookDelivery).where(WebhookDelivery.tenant_id == tenant.id)
        if object_id:
            query = query.where(WebhookDelivery.object_id == object_id)
        cursor = None
        if after:
            cursor = session.scalars(
                select(WebhookDelivery).where(WebhookDelivery.id == after,
                                              WebhookDelivery.tenant_id == tenant.id)
            ).first()
            if cursor is None:
                raise not_found("webhook delivery", after)
        return paginate(session, query, cursor=cursor, limit=limit, render=delivery_object)


@router.get("/v1/tenant")
def get_tenant_info(tenant: TenantDep, ctx: ContextDep) -> dict:
    with ctx.db.read_session() as session:
        row = session.get(Tenant, tenant.id)
        return {"id": row.id, "object": "tenant", "name": row.name,
                "webhook_secret": row.webhook_secret}
