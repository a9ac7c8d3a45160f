"""``boxcar status``: the queue, the workers and the batches, read from the database.

``collect`` gathers one report (a JSON-able dict, what ``--json`` prints); ``format_status``
draws it for a terminal, a progress bar per unfinished batch.
"""

from __future__ import annotations

import time
from typing import Any

from sqlalchemy import func, select

from api.eta import estimate
from api.metrics import enqueued_by_tenant, queue_depth
from service import counters
from service.counters import CounterDelta
from service.db import Database, utcnow
from service.liveness import live_workers
from service.models import (
    BATCH_TERMINAL,
    Batch,
    Job,
    Shard,
    WebhookDelivery,
)
from service.objects import live_totals

NUM_ACTIVE_BATCHES = 20  # unfinished batches listed with a progress bar
BAR_WIDTH = 30


def collect(db: Database, *, interval: float,
            max_enqueued_tokens: int | None = None) -> dict[str, Any]:
    """``max_enqueued_tokens``: the deployment's quota, shown beside what tenants hold."""
    now = utcnow()
    with db.read_session() as session:
        def grouped(column: Any) -> dict[str, int]:
            return dict(session.execute(select(column, func.count()).group_by(column)).all())

        active = list(session.scalars(
            select(Batch).where(Batch.status.not_in(BATCH_TERMINAL)).order_by(Batch.pk)
            .limit(NUM_ACTIVE_BATCHES)))
        report: dict[str, Any] = {
            "batches": grouped(Batch.status),
            "jobs": grouped(Job.status),
            "shards": grouped(Shard.status),
            "lines": _unfinished_lines(session),
            "webhook_deliveries": grouped(WebhookDelivery.status),
            "queue_depth_lines": queue_depth(session),
            "lease_holders": sorted(session.scalars(
                select(Shard.lease_owner).where(Shard.lease_expires_at > now).distinct()
            ).all()),
            "workers": [_worker(w, now) for w in live_workers(session, interval=interval)],
            "active_batches": [],
            "enqueued_tokens": [{"tenant": tenant, "model": model, "tokens": tokens,
                                 "limit": max_enqueued_tokens}
                                for tenant, model, tokens in enqueued_by_tenant(session)],
        }
        etas = estimate(session, worker_metrics_interval=interval)
        live = live_totals(session, list(active))
        for batch in active:
            totals = live[batch.id]
            eta = etas.get(batch.id)
            report["active_batches"].append({
                "id": batch.id, "status": batch.status, "total": totals.total,
                "completed": totals.completed, "failed": totals.failed,
                "output_tokens": totals.output_tokens,
                "expires_at": batch.expires_at.timestamp() if batch.expires_at else None,
                "estimated_completion_at": eta.estimated_completion_at if eta else None,
                "deadline_at_risk": eta.late if eta else False})
    return report


def _unfinished_lines(session: Any) -> dict[str, int]:
    """Open, completed and failed lines of the unfinished batches, from their counters
    (``service.counters``): a few rows a batch, where counting ``request_lines`` by status read
    every line the service ever held."""
    ids = session.scalars(select(Batch.id).where(Batch.status.not_in(BATCH_TERMINAL))).all()
    total = sum(counters.sums(session, ids).values(), CounterDelta())
    return {"open": total.num_open, "completed": total.num_completed,
            "failed": total.num_failed}


def _worker(row: Any, now: Any) -> dict[str, Any]:
    snapshot = row.metrics or {}
    gauges = snapshot.get("gauges", {})
    timeline = snapshot.get("timeline") or [{}]
    return {"id": row.id, "model": row.model,
            "heartbeat_age_s": round((now - row.heartbeat_at).total_seconds(), 1),
            "running": gauges.get("running", 0), "waiting": gauges.get("waiting", 0),
            "kv_usage": gauges.get("kv_usage", 0.0),
            "generation_tokens_per_s": timeline[-1].get("generation_tokens_per_s", 0.0)}


def bar(done: int, total: int, width: int = BAR_WIDTH) -> str:
    filled = round(width * done / total) if total else 0
    return "[" + "#" * filled + "." * (width - filled) + "]"


def _eta(b: dict[str, Any]) -> str:
    eta = b.get("estimated_completion_at")
    if eta is None:
        return ""
    left = max(0.0, eta - time.time())
    late = "  LATE: the estimate passes its deadline" if b.get("deadline_at_risk") else ""
    return f"  eta {time.strftime('%H:%M:%S', time.localtime(eta))} (in {left:.0f}s){late}"


def _counts(counts: dict[str, int]) -> str:
    return ", ".join(f"{status} {n}" for status, n in sorted(counts.items())) or "none"


def format_status(report: dict[str, Any]) -> str:
    shards = report["shards"]
    lines = [
        f"queue     {report['queue_depth_lines']} lines waiting in {shards.get('pending', 0)} "
        f"shards; {shards.get('running', 0)} shards running",
        f"workers   {len(report['workers'])} live",
    ]
    for w in report["workers"]:
        lines.append(
            f"  {w['id']}  {w['model'] or '-'}  heartbeat {w['heartbeat_age_s']:.0f}s ago  "
            f"running {w['running']:.0f}  waiting {w['waiting']:.0f}  "
            f"KV {100 * w['kv_usage']:.0f}%  {w['generation_tokens_per_s']:.1f} tok/s")
    lines.append(f"batches   {_counts(report['batches'])}")
    for b in report["active_batches"]:
        done = b["completed"] + b["failed"]
        share = f"{100 * done / b['total']:3.0f}%" if b["total"] else "  -"
        failed = f"  ({b['failed']} failed)" if b["failed"] else ""
        lines.append(f"  {b['id']}  {b['status']:<11} {bar(done, b['total'])} {share}  "
                     f"{done}/{b['total']}{failed}{_eta(b)}")
    lines.append(f"jobs      {_counts(report['jobs'])}")
    if report["enqueued_tokens"]:
        lines.append("enqueued  tokens held against quotas, per tenant and model")
    for q in report["enqueued_tokens"]:
        limit = f" of {q['limit']:,}" if q["limit"] is not None else ""
        lines.append(f"  {q['tenant']}  {q['model'] or '-'}  {q['tokens']:,}{limit}")
    lines.append(f"webhooks  {_counts(report['webhook_deliveries'])}")
    return "\n".join(lines)


def heartbeat_age(db: Database, *, host: str) -> float | None:
    """Seconds since the newest heartbeat of a worker on ``host`` (worker ids begin with the
    host name: one container, one worker), or None when there is none."""
    from service.models import WorkerStatus

    with db.read_session() as session:
        newest = session.scalar(select(func.max(WorkerStatus.heartbeat_at))
                                .where(WorkerStatus.id.startswith(f"{host}:")))
    return None if newest is None else (utcnow() - newest).total_seconds()
