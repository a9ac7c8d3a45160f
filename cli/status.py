"""``boxcar status``: the queue, the workers and the batches, read from the database.

``collect`` gathers one report (a JSON-able dict, what ``--json`` prints); ``format_status``
draws it for a terminal, a progress bar per unfinished batch. It reads the unfinished batches
and their counters (``service.counters``), never their lines, and of the shards only the ones
not done (the queue; done shards are the service's whole history): a few rows per unfinished
batch. Its counts come in one statement and the unfinished batches with their counters' sums in
one more, because on a machine whose CPUs the workers keep busy each round trip is a wait for
a CPU (docs/benchmarks.md, "Status polls under load").
"""

from __future__ import annotations

import time
from typing import Any

from sqlalchemy import String, bindparam, func, literal, select, union_all
from sqlalchemy.orm import Session

from api.eta import estimate
from api.metrics import enqueued_by_tenant
from service import counters
from service.counters import CounterDelta
from service.db import Database, utcnow
from service.liveness import live_workers
from service.models import (
    BATCH_UNFINISHED,
    SHARD_PENDING,
    SHARD_RUNNING,
    Batch,
    BatchCounter,
    Job,
    Shard,
    WebhookDelivery,
)

NUM_ACTIVE_BATCHES = 20  # unfinished batches listed with a progress bar
BAR_WIDTH = 30


def collect(db: Database, *, interval: float,
            max_enqueued_tokens: int | None = None) -> dict[str, Any]:
    """``max_enqueued_tokens``: the deployment's quota, shown beside what tenants hold."""
    now = utcnow()
    with db.read_session() as session:
        counts = _tallies(session, now)
        unfinished = _unfinished(session)
        total = sum((sums for _, sums in unfinished), CounterDelta())
        report: dict[str, Any] = {
            "batches": counts.get("batches", {}),
            "jobs": counts.get("jobs", {}),
            "shards": counts.get("shards", {}),
            "lines": {"open": total.num_open, "completed": total.num_completed,
                      "failed": total.num_failed},
            "webhook_deliveries": counts.get("webhook_deliveries", {}),
            "queue_depth_lines": sum(counts.get("queue_depth_lines", {}).values()),
            "lease_holders": sorted(counts.get("lease_holders", {})),
            "workers": [_worker(w, now) for w in live_workers(session, interval=interval)],
            "active_batches": [],
            "enqueued_tokens": [{"tenant": tenant, "model": model, "tokens": tokens,
                                 "limit": max_enqueued_tokens}
                                for tenant, model, tokens in enqueued_by_tenant(session)],
        }
        etas = estimate(session, worker_metrics_interval=interval)
        for batch, sums in unfinished[:NUM_ACTIVE_BATCHES]:
            totals = counters.as_totals(batch.num_total, sums)
            eta = etas.get(batch.id)
            report["active_batches"].append({
                "id": batch.id, "status": batch.status, "total": totals.total,
                "completed": totals.completed, "failed": totals.failed,
                "output_tokens": totals.output_tokens,
                "expires_at": batch.expires_at.timestamp() if batch.expires_at else None,
                "estimated_completion_at": eta.estimated_completion_at if eta else None,
                "deadline_at_risk": eta.late if eta else False})
    return report


def _part(name: str, key: Any, value: Any) -> Any:
    return select(literal(name, String).label("part"), key.label("key"), value.label("value"))


# Rows by status of batches, jobs, unfinished shards and webhook deliveries; the lines of
# pending shards (``queue_depth_lines``); the workers holding a shard's lease (``lease_holders``):
# one statement, built once, rows of (part, key, value).
_TALLIES = union_all(
    _part("batches", Batch.status, func.count()).group_by(Batch.status),
    _part("jobs", Job.status, func.count()).group_by(Job.status),
    _part("shards", Shard.status, func.count())
    .where(Shard.status.in_((SHARD_PENDING, SHARD_RUNNING))).group_by(Shard.status),
    _part("webhook_deliveries", WebhookDelivery.status, func.count())
    .group_by(WebhookDelivery.status),
    _part("queue_depth_lines", literal(None, String), func.sum(Shard.num_lines))
    .where(Shard.status == SHARD_PENDING),
    # A lease is only held on a running shard (done and pending ones have none).
    _part("lease_holders", Shard.lease_owner, func.count())
    .where(Shard.status == SHARD_RUNNING, Shard.lease_expires_at > bindparam("now"))
    .group_by(Shard.lease_owner))

# Every unfinished batch (oldest first) with its counters' sums.
_IS_UNFINISHED = Batch.status.in_(BATCH_UNFINISHED)
_SUMS = counters.sums_where(BatchCounter.batch_id.in_(select(Batch.id).where(_IS_UNFINISHED)))
_UNFINISHED = (select(Batch.id, Batch.status, Batch.num_total, Batch.expires_at,
                      *counters.sums_columns(_SUMS))
               .select_from(Batch.__table__.outerjoin(_SUMS, _SUMS.c.batch_id == Batch.id))
               .where(_IS_UNFINISHED).order_by(Batch.pk))
_NUM_BATCH_COLUMNS = 4


def _tallies(session: Session, now: Any) -> dict[str, dict[str | None, int]]:
    """``_TALLIES`` by part, then key."""
    found: dict[str, dict[str | None, int]] = {}
    for name, key, value in session.execute(_TALLIES, {"now": now}):
        if value is not None:
            found.setdefault(name, {})[key] = int(value)
    return found


def _unfinished(session: Session) -> list[tuple[Any, CounterDelta]]:
    return [(row, counters.delta_of(row[_NUM_BATCH_COLUMNS:]))
            for row in session.execute(_UNFINISHED)]


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
