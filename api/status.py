"""The service's status report (``boxcar status``, ``GET /v1/status``): the queue, the workers
and the batches, read from the database.

``collect`` gathers one report (a JSON-able dict). It reads the unfinished batches and their
counters (``service.counters``), never their lines, and of the shards only the ones not done (the
queue; done shards are the service's whole history): a few rows per unfinished batch. Four
statements (``statements``) read all of it: the counts in one; the unfinished batches with their
counters' sums and their tenant's name in one more (the progress bars, and from the same rows the
ETAs, ``api.eta.forecast``, and the tokens the batches hold, ``service.quotas.held_tokens``); the
live workers (of their metrics snapshots only what the report uses, ``WORKER_METRICS``); the
tokens open jobs hold. ``report`` makes the report from their rows, nothing else read.

On a machine whose CPUs the workers keep busy each round trip, and each new PostgreSQL backend,
is a wait for a CPU (docs/benchmarks.md, "Status polls under load"). So the API answers
``GET /v1/status`` from a report its poll snapshots keep fresh on a warm connection
(``api.poll_snapshots``), ``boxcar status --api`` asks it there, and without an API
``cli.status_reader`` sends the four statements in one round trip on a connection of its own;
``collect`` runs them through SQLAlchemy (SQLite, and the fallback).
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from typing import Any

from sqlalchemy import CompoundSelect, Select, String, bindparam, func, literal, select, union_all
from sqlalchemy.orm import Session

from api.eta import LIVE_STATUSES, forecast, live_batch
from service import counters
from service.compiled import Compiled
from service.counters import CounterDelta
from service.db import Database, utcnow
from service.liveness import beat_since, live_since
from service.models import (
    BATCH_UNFINISHED,
    JOB_IN_PROGRESS,
    JOB_QUEUED,
    SHARD_PENDING,
    SHARD_RUNNING,
    Batch,
    BatchCounter,
    Job,
    Shard,
    Tenant,
    WebhookDelivery,
    WorkerStatus,
)
from service.quotas import by_tenant_name, held_tokens

NUM_ACTIVE_BATCHES = 20  # unfinished batches listed with a progress bar


def _part(name: str, key: Any, value: Any) -> Any:
    return select(literal(name, String).label("part"), key.label("key"), value.label("value"))


# Rows by status of batches, jobs, unfinished shards and webhook deliveries; the lines of
# pending shards (``queue_depth_lines``); the workers holding a shard's lease (``lease_holders``):
# one statement, built once, rows of (part, key, value).
TALLIES = union_all(
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

# Every unfinished batch (oldest first) with its counters' sums and its tenant's name. The
# unfinished batches are the ones not terminal: those holding enqueued tokens (service.quotas).
_IS_UNFINISHED = Batch.status.in_(BATCH_UNFINISHED)
_SUMS = counters.sums_where(BatchCounter.batch_id.in_(select(Batch.id).where(_IS_UNFINISHED)))
_BATCH_COLUMNS = (Batch.id, Batch.status, Batch.num_total, Batch.expires_at, Batch.model,
                  Batch.priority, Batch.prepared_at, Batch.est_prompt_tokens_per_line,
                  Batch.est_output_tokens_per_line, Batch.tenant_id, Tenant.name,
                  Batch.enqueued_tokens)  # _Unfinished's fields
UNFINISHED = (select(*_BATCH_COLUMNS, *counters.sums_columns(_SUMS))
              .select_from(Batch.__table__
                           .outerjoin(_SUMS, _SUMS.c.batch_id == Batch.id)
                           .outerjoin(Tenant.__table__, Tenant.id == Batch.tenant_id))
              .where(_IS_UNFINISHED).order_by(Batch.pk))

# The live workers, oldest first (service.liveness: ``since`` is ``live_since``'s).
LIVE_WORKERS = (select(WorkerStatus.id, WorkerStatus.model, WorkerStatus.heartbeat_at,
                       WorkerStatus.metrics)
                .where(beat_since(bindparam("since"))).order_by(WorkerStatus.started_at))

# The tokens open jobs hold, per tenant (with its name) and model (service.quotas).
JOBS_HELD = (select(Job.tenant_id, Tenant.name, Job.model, func.sum(Job.enqueued_tokens))
             .select_from(Job.__table__.outerjoin(Tenant.__table__, Tenant.id == Job.tenant_id))
             .where(Job.status.in_((JOB_QUEUED, JOB_IN_PROGRESS)))
             .group_by(Job.tenant_id, Tenant.name, Job.model))


STATEMENTS = (TALLIES, UNFINISHED, LIVE_WORKERS, JOBS_HELD)  # StatusRows' order


def statements(*, now: dt.datetime,
               interval: float) -> list[tuple[Select | CompoundSelect, dict[str, Any]]]:
    """What one report reads, in ``StatusRows``' order: (statement, its parameters)."""
    params: list[dict[str, Any]] = [{"now": now}, {}, {"since": live_since(interval, now=now)},
                                    {}]
    return list(zip(STATEMENTS, params, strict=True))


@dataclass(frozen=True)
class StatusRows:
    """The rows of ``statements``, each a sequence of column values in its select's order."""

    tallies: Sequence[Sequence[Any]]
    unfinished: Sequence[Sequence[Any]]
    workers: Sequence[Sequence[Any]]
    jobs_held: Sequence[Sequence[Any]]


def read(session: Session, *, now: dt.datetime, interval: float) -> StatusRows:
    """``statements`` through a session."""
    return StatusRows(*(session.execute(statement, params).all()
                        for statement, params in statements(now=now, interval=interval)))


def collect(db: Database, *, interval: float,
            max_enqueued_tokens: int | None = None) -> dict[str, Any]:
    """``max_enqueued_tokens``: the deployment's quota, shown beside what tenants hold."""
    now = utcnow()
    with db.read_session() as session:
        rows = read(session, now=now, interval=interval)
    return report(rows, now=now, max_enqueued_tokens=max_enqueued_tokens)


@dataclass(frozen=True)
class _Unfinished:
    """An ``UNFINISHED`` row: its counters' sums, then its ``_BATCH_COLUMNS``."""

    sums: CounterDelta
    id: str
    status: str
    num_total: int
    expires_at: dt.datetime | None
    model: str | None
    priority: int
    prepared_at: dt.datetime | None
    est_prompt_tokens_per_line: float
    est_output_tokens_per_line: float
    tenant_id: str
    tenant_name: str | None
    enqueued_tokens: int

    @classmethod
    def of(cls, row: Any) -> _Unfinished:
        num = len(_BATCH_COLUMNS)
        return cls(counters.delta_of(row[num:]), *row[:num])


def report(rows: StatusRows, *, now: dt.datetime,
           max_enqueued_tokens: int | None = None) -> dict[str, Any]:
    """The report (``collect``'s) from the rows read at ``now``."""
    counts: dict[str, dict[str | None, int]] = {}
    for name, key, value in rows.tallies:
        if value is not None:
            counts.setdefault(name, {})[key] = int(value)
    unfinished = [_Unfinished.of(row) for row in rows.unfinished]
    total = sum((b.sums for b in unfinished), CounterDelta())
    names = {b.tenant_id: b.tenant_name for b in unfinished if b.tenant_name is not None}
    names.update((tenant, name) for tenant, name, _, _ in rows.jobs_held if name is not None)
    held = held_tokens(((b.tenant_id, b.model, b.enqueued_tokens, b.sums.released_tokens)
                        for b in unfinished),
                       ((tenant, model, tokens) for tenant, _, model, tokens in rows.jobs_held))
    live = [live_batch(b, b.sums) for b in unfinished if b.status in LIVE_STATUSES]
    etas = forecast(live, [(model, metrics) for _, model, _, metrics in rows.workers],
                    now=now.timestamp()) if live else {}
    active = []
    for b in unfinished[:NUM_ACTIVE_BATCHES]:
        totals = counters.as_totals(b.num_total, b.sums)
        eta = etas.get(b.id)
        active.append({
            "id": b.id, "status": b.status, "total": totals.total,
            "completed": totals.completed, "failed": totals.failed,
            "output_tokens": totals.output_tokens,
            "expires_at": b.expires_at.timestamp() if b.expires_at else None,
            "estimated_completion_at": eta.estimated_completion_at if eta else None,
            "deadline_at_risk": eta.late if eta else False})
    return {
        "read_at": now.timestamp(),  # unix seconds: the report is the database as of then
        "batches": counts.get("batches", {}),
        "jobs": counts.get("jobs", {}),
        "shards": counts.get("shards", {}),
        "lines": {"open": total.num_open, "completed": total.num_completed,
                  "failed": total.num_failed},
        "webhook_deliveries": counts.get("webhook_deliveries", {}),
        "queue_depth_lines": sum(counts.get("queue_depth_lines", {}).values()),
        "lease_holders": sorted(counts.get("lease_holders", {})),
        "workers": [_worker(row, now) for row in rows.workers],
        "active_batches": active,
        "enqueued_tokens": [{"tenant": tenant, "model": model, "tokens": tokens,
                             "limit": max_enqueued_tokens}
                            for tenant, model, tokens in by_tenant_name(held, names)],
    }


def _worker(row: Any, now: dt.datetime) -> dict[str, Any]:
    worker_id, model, heartbeat_at, metrics = row
    snapshot = metrics or {}
    gauges = snapshot.get("gauges", {})
    timeline = snapshot.get("timeline") or [{}]
    return {"id": worker_id, "model": model,
            "heartbeat_age_s": round((now - heartbeat_at).total_seconds(), 1),
            "running": gauges.get("running", 0), "waiting": gauges.get("waiting", 0),
            "kv_usage": gauges.get("kv_usage", 0.0),
            "generation_tokens_per_s": timeline[-1].get("generation_tokens_per_s", 0.0)}


@cache
def compiled_statements() -> list[Compiled]:
    """``STATEMENTS`` compiled for psycopg, once a process (``StatusQuery``,
    ``cli.status_reader``)."""
    return [Compiled(statement) for statement in STATEMENTS]


@dataclass(frozen=True)
class StatusQuery:
    """One report as a reader of compiled statements makes it (the API's, ``api.poll_snapshots``):
    ``runs`` at ``now``, then ``report`` from their rows. ``interval``: the workers' metrics
    interval (who counts as live); ``max_enqueued_tokens``: the deployment's quota."""

    interval: float
    max_enqueued_tokens: int | None = None

    def runs(self, now: dt.datetime) -> list[tuple[Compiled, dict[str, Any]]]:
        return [(compiled, params) for compiled, (_, params) in zip(
            compiled_statements(), statements(now=now, interval=self.interval), strict=True)]

    def report(self, found: Sequence[Sequence[Sequence[Any]]],
               now: dt.datetime) -> dict[str, Any]:
        return report(StatusRows(*found), now=now, max_enqueued_tokens=self.max_enqueued_tokens)
