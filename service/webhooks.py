"""Webhooks: Standard Webhooks signatures, the address guard, and queueing events.

An event becomes one delivery row per target URL (the object's own ``webhook_url`` and each of
the tenant's endpoints that listens for it) in the same transaction as the change it reports;
the workers send them and retry with backoff (``worker.webhook_sender``).
"""

from __future__ import annotations

import ipaddress
import json
import socket
from typing import Any
from urllib.parse import urlparse

from sqlalchemy import select
from sqlalchemy.orm import Session

from service import ids
from service.db import utcnow
from service.models import Tenant, WebhookDelivery, WebhookEndpoint
from service.webhook_verify import Webhook

# batch.at_risk: once, at create, for a batch whose estimate passes its window (api.create_eta).
BATCH_EVENTS = ("batch.completed", "batch.failed", "batch.expired", "batch.cancelled",
                "batch.at_risk")
JOB_EVENTS = ("job.completed", "job.failed")
EVENTS = BATCH_EVENTS + JOB_EVENTS


def headers_for(secret: str, msg_id: str, timestamp: int, body: str) -> dict[str, str]:
    """A delivery's headers, signed by the one signer receivers verify with
    (``service.webhook_verify.Webhook``)."""
    return {
        "content-type": "application/json",
        "webhook-id": msg_id,
        "webhook-timestamp": str(timestamp),
        "webhook-signature": Webhook(secret).sign(msg_id, timestamp, body),
    }


def check_url_syntax(url: str) -> None:
    """``ValueError`` unless ``url`` is an absolute http(s) URL with a host."""
    parsed = urlparse(url)
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        raise ValueError(f"webhook url must be an absolute http(s) URL, got {url!r}")


def _is_private(address: str) -> bool:
    ip = ipaddress.ip_address(address.split("%")[0])
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped:
        ip = ip.ipv4_mapped
    return not ip.is_global or ip.is_multicast


def check_url_target(url: str, *, allow_private: bool) -> None:
    """``ValueError`` if ``url`` resolves to a loopback, private, link-local or reserved address
    (unless ``allow_private``): webhooks must not become a way into the service's network."""
    check_url_syntax(url)
    if allow_private:
        return
    parsed = urlparse(url)
    host = parsed.hostname or ""
    try:
        infos = socket.getaddrinfo(host, parsed.port or 443, proto=socket.IPPROTO_TCP)
    except socket.gaierror as exc:
        raise ValueError(f"webhook host {host!r} does not resolve: {exc}") from exc
    for info in infos:
        address = info[4][0]
        if _is_private(address):
            raise ValueError(
                f"webhook url {url!r} resolves to the non-public address {address}; "
                "set BOXCAR_WEBHOOK_ALLOW_PRIVATE=true to allow it"
            )


def check_url_literal(url: str, *, allow_private: bool) -> None:
    """The checks that need no DNS: syntax, and a literal non-public IP or ``localhost``."""
    check_url_syntax(url)
    if allow_private:
        return
    host = (urlparse(url).hostname or "").lower()
    if host == "localhost" or host.endswith(".localhost"):
        raise ValueError(f"webhook url {url!r} points at localhost")
    try:
        private = _is_private(host)
    except ValueError:
        return  # a name: checked again, resolved, at delivery
    if private:
        raise ValueError(f"webhook url {url!r} points at the non-public address {host}")


def queue_event(
    session: Session,
    *,
    tenant_id: str,
    event_type: str,
    object_id: str,
    data: dict[str, Any],
    object_url: str | None,
) -> int:
    """Queue deliveries of one event; returns how many were queued."""
    now = utcnow()
    targets: list[tuple[str | None, str]] = []
    if object_url:
        targets.append((None, object_url))
    endpoints = session.scalars(
        select(WebhookEndpoint).where(
            WebhookEndpoint.tenant_id == tenant_id, WebhookEndpoint.deleted_at.is_(None)
        )
    ).all()
    for endpoint in endpoints:
        if endpoint.events is None or event_type in endpoint.events:
            targets.append((endpoint.id, endpoint.url))
    for endpoint_id, url in targets:
        msg_id = ids.webhook_message_id()
        payload = json.dumps(
            {"type": event_type, "timestamp": now.isoformat(), "data": data},
            separators=(",", ":"), ensure_ascii=False,
        )
        session.add(WebhookDelivery(
            id=msg_id, tenant_id=tenant_id, endpoint_id=endpoint_id, event_type=event_type,
            object_id=object_id, url=url, payload=payload, next_attempt_at=now,
        ))
    return len(targets)


def delivery_secret(session: Session, delivery: WebhookDelivery) -> str:
    """An endpoint signs with its own secret; an object's own url with the tenant's."""
    if delivery.endpoint_id is not None:
        endpoint = session.get(WebhookEndpoint, delivery.endpoint_id)
        if endpoint is not None:
            return endpoint.secret
    return session.get(Tenant, delivery.tenant_id).webhook_secret
