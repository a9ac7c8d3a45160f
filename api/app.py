"""The FastAPI application: OpenAI-compatible files and batches, single jobs, webhooks."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI
from fastapi.responses import JSONResponse
from prometheus_client import make_asgi_app
from starlette.concurrency import run_in_threadpool
from starlette.types import ASGIApp, Receive, Scope, Send

from api.deps import AppContext
from api.errors import RETRY_AFTER_SECONDS, error_body, install_error_handlers
from api.metrics import metrics_registry
from api.routes import (
    batches,
    files,
    health,
    jobs,
    message_batches,
    models,
    status,
    ui,
    webhooks,
)
from api.timing import ServerTiming, time_statements
from service.db import Database
from service.queue import TaskQueue, make_queue
from service.settings import Settings, get_settings
from service.storage import ObjectStorage, make_storage


def build_context(
    settings: Settings,
    *,
    db: Database | None = None,
    storage: ObjectStorage | None = None,
    queue: TaskQueue | None = None,
) -> AppContext:
    """The parts the settings choose; any of them can be handed in instead (tests, serve)."""
    return AppContext(
        settings=settings,
        db=db or Database(settings.database_url),
        storage=storage or make_storage(
            settings.storage_url, endpoint_url=settings.s3_endpoint_url,
            region=settings.s3_region, create_bucket=settings.s3_create_bucket,
        ),
        queue=queue or make_queue(settings.broker_url, namespace=settings.queue_namespace,
                                  transport_options=settings.broker_transport_options),
    )


def create_app(
    settings: Settings | None = None, *, context: AppContext | None = None
) -> FastAPI:
    context = context or build_context(settings or get_settings())

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        yield
        if context.polls is not None:
            await context.polls.close()
        if context.poll_reader is not None:  # its connections live on this loop
            await context.poll_reader.close()

    app = FastAPI(
        title="boxcar",
        version="0.1.0",
        description="Self-hosted batch inference with an OpenAI-compatible Files and Batches API.",
        lifespan=lifespan,
    )
    app.state.context = context
    install_error_handlers(app)
    app.add_middleware(SchemaGateMiddleware, context=context)
    for module in (files, batches, message_batches, jobs, models, webhooks, health, status, ui):
        app.include_router(module.router)
    app.mount("/metrics", make_asgi_app(metrics_registry(
        context.db, context.settings.worker_metrics_interval,
        context.settings.max_enqueued_tokens)))
    time_statements(context.db.engine)
    if context.db.read_engine is not context.db.engine:
        time_statements(context.db.read_engine)
    app.add_middleware(ServerTiming)  # added last: the outermost, so it times everything else
    return app


class SchemaGateMiddleware:
    """On a database whose schema is not the code's (``boxcar db upgrade`` has not run), the API
    answers 503 with the reason instead of failing on a missing table (/readyz says so too).
    Plain ASGI rather than ``@app.middleware("http")``: Starlette's BaseHTTPMiddleware runs the
    rest of the app in a task of its own and streams the response through it, a cost every
    request paid (a status poll too) for a check that passes."""

    def __init__(self, app: ASGIApp, context: AppContext) -> None:
        self.app = app
        self.context = context

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (scope["type"] == "http" and scope["path"].startswith("/v1/")
                and not self.context.schema.is_current):
            try:
                problem = await run_in_threadpool(self.context.schema.problem)
            except Exception:  # the database is down: the route's handlers answer 503 for it
                problem = None
            if problem is not None:
                response = JSONResponse(
                    error_body(503, f"The service is not ready: {problem}.",
                               code="schema_out_of_date"),
                    status_code=503, headers={"Retry-After": str(RETRY_AFTER_SECONDS)})
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)
