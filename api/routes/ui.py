"""/ui: the live dashboard. One static page (api/static/) polls ``/ui/api/summary``.

The summary is the caller's tenant's batches and jobs (live progress), the queue, and the live
workers' engines merged into one (latency percentiles and distributions, KV usage, running and
waiting requests, batch size over time). Engine figures are the whole service's: an engine
serves every tenant at once.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from fastapi import APIRouter
from fastapi.responses import FileResponse
from sqlalchemy import select

from api.deps import ContextDep, TenantDep
from api.errors import not_found
from api.metrics import JOB_STATUSES, queue_depth
from api.routes.batches import render
from metrics.snapshot import histogram_percentiles, merge_snapshots
from service.db import utcnow
from service.liveness import live_workers
from service.models import Batch, Job

router = APIRouter(tags=["dashboard"], include_in_schema=False)

STATIC = Path(__file__).resolve().parent.parent / "static"
ASSETS = {"dashboard.js": "text/javascript", "dashboard.css": "text/css"}
NUM_BATCHES = 20  # the most recent batches shown
NUM_JOBS = 10
TIMELINE_POINTS = 180  # three minutes of one-second points
LATENCIES = ("ttft_s", "tpot_s", "itl_s", "queue_time_s", "e2e_latency_s")
DISTRIBUTIONS = ("ttft_s", "tpot_s")


@router.get("/ui")
def dashboard() -> FileResponse:
    return FileResponse(STATIC / "dashboard.html", media_type="text/html",
                        headers={"Cache-Control": "no-cache"})


@router.get("/ui/{name}")
def asset(name: str) -> FileResponse:
    if name not in ASSETS:
        raise not_found("file", name)
    return FileResponse(STATIC / name, media_type=ASSETS[name],
                        headers={"Cache-Control": "no-cache"})


@router.get("/ui/api/summary")
def summary(tenant: TenantDep, ctx: ContextDep) -> dict[str, Any]:
    with ctx.db.read_session() as session:
        batches = [_batch(render(session, row, ctx)) for row in session.scalars(
            select(Batch).where(Batch.tenant_id == tenant.id).order_by(Batch.pk.desc())
            .limit(NUM_BATCHES))]
        jobs = list(session.scalars(select(Job).where(Job.tenant_id == tenant.id)
                                    .order_by(Job.pk.desc()).limit(200)))
        workers = live_workers(session, interval=ctx.settings.worker_metrics_interval)
        depth = queue_depth(session)
        now = utcnow()
        worker_rows = [(w.id, w.model, (now - w.heartbeat_at).total_seconds(), w.metrics or {})
                       for w in workers]
    job_counts = {status: 0 for status in JOB_STATUSES}
    for job in jobs:
        job_counts[job.status] = job_counts.get(job.status, 0) + 1
    return {
        "now": time.time(),
        "tenant": {"id": tenant.id, "name": tenant.name},
        "batches": batches,
        "jobs": {"counts": job_counts, "recent": [
            {"id": j.id, "status": j.status, "created_at": j.created_at.timestamp()}
            for j in jobs[:NUM_JOBS]]},
        "queue": {"depth_lines": depth},
        "workers": [{"id": wid, "model": model, "heartbeat_age_s": round(age, 1),
                     "running": snap.get("gauges", {}).get("running", 0),
                     "waiting": snap.get("gauges", {}).get("waiting", 0),
                     "kv_usage": snap.get("gauges", {}).get("kv_usage", 0)}
                    for wid, model, age, snap in worker_rows],
        "engine": _engine([snap for *_, snap in worker_rows if snap]),
    }


def _batch(obj: dict[str, Any]) -> dict[str, Any]:
    counts = obj["request_counts"]
    done = counts["completed"] + counts["failed"]
    return {"id": obj["id"], "status": obj["status"], "endpoint": obj["endpoint"],
            "created_at": obj["created_at"], "total": counts["total"],
            "completed": counts["completed"], "failed": counts["failed"],
            "progress": done / counts["total"] if counts["total"] else 0.0,
            "output_tokens": obj["usage"]["output_tokens"],
            "prefix_cache_hit_rate": obj["prefix_cache_hit_rate"],
            "expires_at": obj["expires_at"],
            "estimated_completion_at": obj["estimated_completion_at"],
            "deadline_at_risk": obj["deadline_at_risk"]}


def _engine(snapshots: list[dict[str, Any]]) -> dict[str, Any]:
    merged = merge_snapshots(snapshots)
    counters, gauges, hists = merged["counters"], merged["gauges"], merged["histograms"]
    timeline = merged["timeline"][-TIMELINE_POINTS:]
    recent = [p for p in timeline[-5:] if p.get("steps")] or timeline[-1:]
    prompt = hists["request_prompt_tokens"]["sum"]
    steps = hists["step_requests"]
    return {
        "num_workers": len(snapshots),
        "running": gauges.get("running", 0),
        "waiting": gauges.get("waiting", 0),
        "kv_usage": gauges.get("kv_usage", 0.0),
        "kv_usage_peak": gauges.get("kv_usage_peak", 0.0),
        "preemptions": counters.get("preemptions", 0.0),
        "requests_finished": counters.get("requests_finished", 0.0),
        "generation_tokens": counters.get("generation_tokens", 0.0),
        # The share of finished requests' prompt tokens that came from the prefix cache.
        "prefix_cache_hit_rate": counters.get("prompt_tokens_cached", 0.0) / prompt
        if prompt else 0.0,
        "generation_tokens_per_s": sum(p.get("generation_tokens_per_s", 0.0) for p in recent)
        / max(len(recent), 1),
        "batch_size_mean": steps["sum"] / steps["count"] if steps["count"] else 0.0,
        "latency": {key: histogram_percentiles(hists.get(key)) for key in LATENCIES},
        "distributions": {key: {"bounds": hists[key]["bounds"], "counts": hists[key]["counts"]}
                          for key in DISTRIBUTIONS},
        "timeline": timeline,
    }
