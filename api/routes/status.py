"""``GET /v1/status``: the operator's view of the whole service (``api.status``: the queue, the
live workers, every unfinished batch with its progress and ETA, the tokens tenants hold), what
``boxcar status --api`` prints. Only the operator's key opens it (``api.deps.require_operator``).

On PostgreSQL it is answered from the report the API's poll snapshots hold while it is asked for
(``api.poll_snapshots``: at most ``BOXCAR_API_POLL_SNAPSHOT_SECONDS`` old, read on a warm
connection in one round trip), so a poll costs no new database backend and, mostly, no read; its
``read_at`` says when the database was read. SQLite reads it on a thread.
"""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool

from api.deps import ContextDep, OperatorDep
from api.status import StatusQuery, collect

router = APIRouter(tags=["status"])


@router.get("/v1/status", dependencies=[OperatorDep])
async def status(ctx: ContextDep) -> JSONResponse:
    settings = ctx.settings
    query = StatusQuery(settings.worker_metrics_interval, settings.max_enqueued_tokens)
    if ctx.polls is not None:
        report = await ctx.polls.status(query)
    else:
        report = await run_in_threadpool(collect, ctx.db, interval=query.interval,
                                         max_enqueued_tokens=query.max_enqueued_tokens)
    return JSONResponse(report)
