"""FastAPI dependencies: the app's context (settings, database, storage, queue) and the tenant
behind the request's API key."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated

from fastapi import Depends, Request

from api.errors import ApiError
from service.db import Database
from service.keys import authenticate
from service.migrate import SchemaGate
from service.queue import TaskQueue
from service.settings import Settings
from service.storage import ObjectStorage


@dataclass
class AppContext:
    settings: Settings
    db: Database
    storage: ObjectStorage
    queue: TaskQueue
    schema: SchemaGate = field(init=False)

    def __post_init__(self) -> None:
        self.schema = SchemaGate(self.db)


@dataclass(frozen=True)
class TenantRef:
    id: str
    name: str


def get_context(request: Request) -> AppContext:
    return request.app.state.context


ContextDep = Annotated[AppContext, Depends(get_context)]


def get_tenant(request: Request, ctx: ContextDep) -> TenantRef:
    header = request.headers.get("authorization", "")
    scheme, _, key = header.partition(" ")
    if scheme and scheme.lower() != "bearer":  # not echoed: it may be the key itself
        raise ApiError(401, "Unsupported authorization scheme: send "
                       "'Authorization: Bearer <key>'.", code="invalid_api_key")
    if not key.strip():
        raise ApiError(401, "Missing API key: send 'Authorization: Bearer <key>'.",
                       code="invalid_api_key")
    with ctx.db.read_session() as session:
        tenant = authenticate(session, key=key.strip())
        if tenant is None:
            raise ApiError(401, "Incorrect API key provided.", code="invalid_api_key")
        return TenantRef(tenant.id, tenant.name)


TenantDep = Annotated[TenantRef, Depends(get_tenant)]
