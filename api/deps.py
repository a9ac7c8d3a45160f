"""FastAPI dependencies: the app's context (settings, database, storage, queue) and the tenant
behind the request's API key."""

from __future__ import annotations

import hmac
import threading
import time
from dataclasses import dataclass, field
from typing import Annotated

from fastapi import Depends, Request
from starlette.concurrency import run_in_threadpool

from api.errors import ApiError
from api.eta import EtaCache
from api.poll_reads import POLL_STATEMENT, AsyncReader
from api.poll_snapshots import PollSnapshots
from service.db import Database
from service.keys import authenticate, hash_key
from service.migrate import SchemaGate
from service.queue import TaskQueue
from service.settings import Settings
from service.storage import ObjectStorage


@dataclass(frozen=True)
class TenantRef:
    id: str
    name: str
    # The request's key's own enqueued-token limit (None: the deployment's).
    max_enqueued_tokens: int | None = None


class KeyCache:
    """The tenants of API keys this process checked in the last ``ttl`` seconds, by the key's
    hash: a client polling a batch costs no auth query (its key's lookup was ~4 of a status
    poll's ~9 database round trips, each a wait for the CPU on a busy machine). Only keys that
    were valid are kept, so a new key works at once; a revoked one for up to ``ttl``."""

    MAX_KEYS = 10_000  # a full cache starts over rather than grow without bound

    def __init__(self, ttl: float) -> None:
        self.ttl = ttl
        self._lock = threading.Lock()
        self._tenants: dict[str, tuple[float, TenantRef]] = {}

    def get(self, key_hash: str) -> TenantRef | None:
        if self.ttl <= 0:
            return None
        with self._lock:
            found = self._tenants.get(key_hash)
            if found is None:
                return None
            if time.monotonic() >= found[0]:
                del self._tenants[key_hash]
                return None
            return found[1]

    def put(self, key_hash: str, tenant: TenantRef) -> None:
        if self.ttl <= 0:
            return
        with self._lock:
            if len(self._tenants) >= self.MAX_KEYS:
                self._tenants.clear()
            self._tenants[key_hash] = (time.monotonic() + self.ttl, tenant)


@dataclass
class AppContext:
    settings: Settings
    db: Database
    storage: ObjectStorage
    queue: TaskQueue
    schema: SchemaGate = field(init=False)
    etas: EtaCache = field(init=False)
    keys: KeyCache = field(init=False)
    # A live batch's status poll on the event loop (PostgreSQL; None: on a thread).
    poll_reader: AsyncReader | None = field(init=False)
    # Its recent rows of the batches being polled (api.poll_snapshots; with poll_reader).
    polls: PollSnapshots | None = field(init=False)

    def __post_init__(self) -> None:
        self.schema = SchemaGate(self.db)
        self.etas = EtaCache(self.settings.worker_metrics_interval,
                             refresh_session=self.db.read_session)
        self.keys = KeyCache(self.settings.api_key_cache_seconds)
        self.poll_reader = None if self.db.is_sqlite else AsyncReader(self.db.url,
                                                                      POLL_STATEMENT)
        self.polls = None if self.poll_reader is None else PollSnapshots(
            self.poll_reader, max_age=self.settings.api_poll_snapshot_seconds)


async def get_context(request: Request) -> AppContext:
    # async: a plain function dependency would cost every request a hop to a worker thread.
    return request.app.state.context


ContextDep = Annotated[AppContext, Depends(get_context)]


def bearer_key(request: Request) -> str:
    """The request's ``Authorization: Bearer <key>``; 401 without one."""
    header = request.headers.get("authorization", "")
    scheme, _, key = header.partition(" ")
    if scheme and scheme.lower() != "bearer":  # not echoed: it may be the key itself
        raise ApiError(401, "Unsupported authorization scheme: send "
                       "'Authorization: Bearer <key>'.", code="invalid_api_key")
    if not key.strip():
        raise ApiError(401, "Missing API key: send 'Authorization: Bearer <key>'.",
                       code="invalid_api_key")
    return key.strip()


def request_key(request: Request) -> str:
    """The request's API key: Anthropic's ``x-api-key`` header where sent (its client's way),
    else OpenAI's ``Authorization: Bearer``; the same keys and tenants either way."""
    key = request.headers.get("x-api-key", "").strip()
    return key or bearer_key(request)


async def get_tenant(request: Request, ctx: ContextDep) -> TenantRef:
    # async: a key in the cache is answered on the event loop, without a hop to a thread.
    key = request_key(request)
    key_hash = hash_key(key)
    tenant = ctx.keys.get(key_hash)
    if tenant is None:
        tenant = await run_in_threadpool(_authenticate, ctx, key)
        ctx.keys.put(key_hash, tenant)
    return tenant


def _authenticate(ctx: AppContext, key: str) -> TenantRef:
    with ctx.db.read_session() as session:
        owner = authenticate(session, key=key)
        if owner is None:
            raise ApiError(401, "Incorrect API key provided.", code="invalid_api_key")
        return TenantRef(owner.tenant.id, owner.tenant.name, owner.max_enqueued_tokens)


TenantDep = Annotated[TenantRef, Depends(get_tenant)]


async def require_operator(request: Request, ctx: ContextDep) -> None:
    """The request bears the operator's key (``BOXCAR_OPERATOR_KEY``): 403 when this API has
    none, 401 for any other key (a tenant's too)."""
    expected = ctx.settings.operator_key
    if expected is None:
        raise ApiError(403, "This endpoint is the operator's and is off: the API has no "
                       "operator key (set BOXCAR_OPERATOR_KEY).", code="operator_key_not_set")
    given = bearer_key(request)
    # Compared as digests: equal lengths, so the time taken says nothing of the key's.
    if not hmac.compare_digest(hash_key(given), hash_key(expected.get_secret_value())):
        raise ApiError(401, "Incorrect operator key: this endpoint takes BOXCAR_OPERATOR_KEY, "
                       "not a tenant's API key.", code="invalid_api_key")


OperatorDep = Depends(require_operator)
