"""Tenants and API keys. A key is shown once; only its SHA-256 is stored."""

from __future__ import annotations

import base64
import hashlib
import secrets
from dataclasses import dataclass

from sqlalchemy import select
from sqlalchemy.orm import Session

from service import ids
from service.db import utcnow
from service.models import ApiKey, Tenant
from service.webhook_verify import SECRET_PREFIX

KEY_PREFIX = "bx-"


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def new_webhook_secret() -> str:
    """A Standard Webhooks secret: ``whsec_`` + base64 of 32 random bytes."""
    return SECRET_PREFIX + base64.b64encode(secrets.token_bytes(32)).decode()


@dataclass(frozen=True)
class CreatedKey:
    key: str  # the secret, shown once
    key_id: str
    tenant_id: str
    tenant_name: str
    webhook_secret: str


def get_or_create_tenant(session: Session, *, name: str) -> Tenant:
    tenant = session.scalars(select(Tenant).where(Tenant.name == name)).first()
    if tenant is None:
        tenant = Tenant(id=ids.tenant_id(), name=name, webhook_secret=new_webhook_secret())
        session.add(tenant)
        session.flush()
    return tenant


def create_key(
    session: Session, *, tenant_name: str, key: str | None = None, name: str | None = None,
    max_enqueued_tokens: int | None = None,
) -> CreatedKey:
    """A new key for the tenant called ``tenant_name`` (created if missing).

    ``key`` sets the secret instead of drawing one (for a bootstrap key from the environment);
    ``max_enqueued_tokens`` is the key's own quota (None: the deployment's).
    """
    if max_enqueued_tokens is not None and max_enqueued_tokens < 1:
        raise ValueError(f"max_enqueued_tokens must be >= 1, got {max_enqueued_tokens}")
    tenant = get_or_create_tenant(session, name=tenant_name)
    secret = key or KEY_PREFIX + secrets.token_urlsafe(32)
    if len(secret) < 16:
        raise ValueError("an API key must be at least 16 characters")
    row = ApiKey(
        id=ids.key_id(), tenant_id=tenant.id, key_hash=hash_key(secret), key_prefix=secret[:8],
        name=name, max_enqueued_tokens=max_enqueued_tokens,
    )
    session.add(row)
    session.flush()
    return CreatedKey(secret, row.id, tenant.id, tenant.name, tenant.webhook_secret)


def ensure_key(session: Session, *, key: str, tenant_name: str = "default") -> str:
    """Make ``key`` valid for ``tenant_name`` if it is not a key yet; returns the tenant id."""
    row = session.scalars(select(ApiKey).where(ApiKey.key_hash == hash_key(key))).first()
    if row is not None:
        return row.tenant_id
    return create_key(session, tenant_name=tenant_name, key=key, name="bootstrap").tenant_id


@dataclass(frozen=True)
class KeyOwner:
    """Who an API key speaks for, and the key's own enqueued-token limit (None: the
    deployment's, ``service.quotas``)."""

    tenant: Tenant
    max_enqueued_tokens: int | None


def authenticate(session: Session, *, key: str) -> KeyOwner | None:
    """The tenant of an unrevoked key, in one statement (every API request runs it)."""
    row = session.execute(
        select(Tenant, ApiKey.max_enqueued_tokens).join(ApiKey, ApiKey.tenant_id == Tenant.id)
        .where(ApiKey.key_hash == hash_key(key), ApiKey.revoked_at.is_(None))
    ).first()
    return None if row is None else KeyOwner(row[0], row[1])


def set_key_limit(session: Session, *, key_id: str, max_enqueued_tokens: int | None) -> bool:
    """Give a key its own enqueued-token limit (None: back to the deployment's)."""
    if max_enqueued_tokens is not None and max_enqueued_tokens < 1:
        raise ValueError(f"max_enqueued_tokens must be >= 1, got {max_enqueued_tokens}")
    row = session.get(ApiKey, key_id)
    if row is None:
        return False
    row.max_enqueued_tokens = max_enqueued_tokens
    return True


def revoke_key(session: Session, *, key_id: str) -> bool:
    row = session.get(ApiKey, key_id)
    if row is None or row.revoked_at is not None:
        return False
    row.revoked_at = utcnow()
    return True
