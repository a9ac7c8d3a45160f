"""Liveness and readiness probes."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse

from api.deps import ContextDep

router = APIRouter(tags=["health"])


@router.get("/healthz")
def healthz() -> dict:
    return {"status": "ok"}


@router.get("/readyz")
def readyz(ctx: ContextDep) -> JSONResponse:
    checks: dict[str, str] = {}
    for name, check in (("database", ctx.db.ping), ("storage", ctx.storage.check)):
        try:
            check()
            checks[name] = "ok"
        except Exception as exc:  # a probe reports, it does not raise
            checks[name] = f"error: {exc}"
    if checks["database"] == "ok":
        try:
            checks["schema"] = ctx.schema.problem() or "ok"
        except Exception as exc:
            checks["schema"] = f"error: {exc}"
    ready = all(v == "ok" for v in checks.values())
    return JSONResponse({"status": "ok" if ready else "unavailable", "checks": checks},
                        status_code=200 if ready else 503)
