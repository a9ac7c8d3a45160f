"""Shard leases in the database: claim, heartbeat, release, reap.

A shard is claimable when it is pending, or running under a lease that has expired (its worker
died or stalled); a claim is one conditional UPDATE, so of two workers racing for a shard exactly
one wins. Claims prefer single jobs, then the tenants with the fewest running shards. A worker
claims only shards of the model it serves (and shards from before routing, which name none).
"""

from __future__ import annotations

import datetime as dt
from collections import Counter
from dataclasses import dataclass

from sqlalchemy import and_, func, or_, select, true, update
from sqlalchemy.orm import Session

from service.db import utcnow
from service.models import (
    IN_PROGRESS,
    JOB_IN_PROGRESS,
    JOB_QUEUED,
    LINE_FAILED,
    LINE_OPEN,
    LINE_PENDING,
    LINE_RUNNING,
    SHARD_DONE,
    SHARD_PENDING,
    SHARD_RUNNING,
    Batch,
    Job,
    RequestLine,
    Shard,
)
from worker.items import HeldShard, LineWork


def _claimable(now: dt.datetime):
    return or_(
        Shard.status == SHARD_PENDING,
        and_(Shard.status == SHARD_RUNNING, Shard.lease_expires_at < now),
    )


def _of_model(model: str | None):
    """Shards a worker serving ``model`` may run (None: every shard, for tests of one model)."""
    if model is None:
        return true()
    return or_(Shard.model == model, Shard.model.is_(None))


@dataclass(frozen=True)
class Candidate:
    id: str
    tenant_id: str
    priority: int
    is_job: bool


def find_candidates(
    session: Session, *, now: dt.datetime, max_bulk: int, max_jobs: int,
    model: str | None = None,
) -> list[Candidate]:
    """Shards worth trying to claim, in the order to try them: jobs by priority, then bulk
    shards spread over tenants (fewest running shards first), each tenant's in batch order."""
    base = (
        select(Shard.id, Shard.tenant_id, Shard.priority, Shard.job_id)
        .outerjoin(Batch, Batch.id == Shard.batch_id)
        .where(_claimable(now), or_(Shard.job_id.is_not(None), Batch.status == IN_PROGRESS),
               _of_model(model))
    )
    jobs = session.execute(
        base.where(Shard.job_id.is_not(None))
        .order_by(Shard.priority.desc(), Shard.created_at, Shard.id).limit(max_jobs)
    ).all() if max_jobs > 0 else []
    bulk_rows = session.execute(
        base.where(Shard.job_id.is_(None))
        .order_by(Shard.priority.desc(), Shard.created_at, Shard.id).limit(max_bulk * 8)
    ).all() if max_bulk > 0 else []
    running = Counter(dict(session.execute(
        select(Shard.tenant_id, func.count()).where(
            Shard.status == SHARD_RUNNING, Shard.lease_expires_at >= now, Shard.job_id.is_(None)
        ).group_by(Shard.tenant_id)
    ).all()))
    by_tenant: dict[str, list] = {}
    for row in bulk_rows:
        by_tenant.setdefault(row.tenant_id, []).append(row)
    bulk: list[Candidate] = []
    while by_tenant and len(bulk) < max_bulk:
        tenant = min(by_tenant, key=lambda t: (running[t], -by_tenant[t][0].priority))
        row = by_tenant[tenant].pop(0)
        if not by_tenant[tenant]:
            del by_tenant[tenant]
        running[tenant] += 1
        bulk.append(Candidate(row.id, row.tenant_id, row.priority, False))
    return [Candidate(r.id, r.tenant_id, r.priority, True) for r in jobs] + bulk


@dataclass(frozen=True)
class Claim:
    shard: HeldShard
    lines: list[LineWork]
    attempts: int


def try_claim(
    session: Session,
    shard_id: str,
    *,
    worker_id: str,
    lease_seconds: float,
    now: dt.datetime | None = None,
    model: str | None = None,
) -> Claim | None:
    """Take the lease on ``shard_id`` if it is claimable, of ``model`` and its batch is
    running; load its open lines and mark them running. None when someone else has it, it
    is another model's, or nothing is left."""
    now = now or utcnow()
    batch_running = or_(
        Shard.job_id.is_not(None),
        select(Batch.id).where(Batch.id == Shard.batch_id, Batch.status == IN_PROGRESS).exists(),
    )
    won = session.execute(
        update(Shard)
        .where(Shard.id == shard_id, _claimable(now), batch_running, _of_model(model))
        .values(status=SHARD_RUNNING, lease_owner=worker_id, attempts=Shard.attempts + 1,
                lease_expires_at=now + dt.timedelta(seconds=lease_seconds))
        .execution_options(synchronize_session=False)
    ).rowcount
    if won != 1:
        return None
    shard = session.get(Shard, shard_id)
    rows = session.scalars(
        select(RequestLine)
        .where(RequestLine.shard_id == shard_id, RequestLine.status.in_(LINE_OPEN))
        .order_by(RequestLine.position, RequestLine.pk)
    ).all()
    session.execute(
        update(RequestLine)
        .where(RequestLine.shard_id == shard_id, RequestLine.status == LINE_PENDING)
        .values(status=LINE_RUNNING)
        .execution_options(synchronize_session=False)
    )
    if shard.job_id is not None:
        session.execute(
            update(Job).where(Job.id == shard.job_id, Job.status == JOB_QUEUED)
            .values(status=JOB_IN_PROGRESS)
        )
    lines = [
        LineWork(
            line_pk=r.pk, shard_id=shard_id, tenant_id=r.tenant_id, batch_id=r.batch_id,
            job_id=r.job_id, endpoint=r.endpoint,
            body=r.body or {}, priority=shard.priority,
        )
        for r in rows
    ]
    held = HeldShard(shard.id, shard.tenant_id, shard.batch_id, shard.job_id, shard.priority,
                     {w.line_pk for w in lines})
    return Claim(held, lines, shard.attempts)


def fail_lines(
    session: Session, line_pks: list[int], *, code: str, message: str, worker_id: str
) -> None:
    """Give open lines a final error (a poison shard that keeps killing its workers)."""
    session.execute(
        update(RequestLine)
        .where(RequestLine.pk.in_(line_pks), RequestLine.status.in_(LINE_OPEN))
        .values(status=LINE_FAILED, error={"code": code, "message": message},
                finished_at=utcnow(), worker_id=worker_id)
        .execution_options(synchronize_session=False)
    )


def finish_shard(session: Session, shard_id: str, *, worker_id: str) -> bool:
    """Mark the shard done if this worker holds it and none of its lines is open (a result
    that could not be written leaves the shard to run again once the lease runs out)."""
    open_lines = select(RequestLine.pk).where(RequestLine.shard_id == shard_id,
                                              RequestLine.status.in_(LINE_OPEN)).exists()
    return session.execute(
        update(Shard)
        .where(Shard.id == shard_id, Shard.lease_owner == worker_id, ~open_lines)
        .values(status=SHARD_DONE, finished_at=utcnow(), lease_expires_at=None)
        .execution_options(synchronize_session=False)
    ).rowcount == 1


def heartbeat(
    session: Session, shard_ids: list[str], *, worker_id: str, lease_seconds: float
) -> set[str]:
    """Extend the leases this worker still holds; returns the shards it has lost."""
    if not shard_ids:
        return set()
    now = utcnow()
    session.execute(
        update(Shard)
        .where(Shard.id.in_(shard_ids), Shard.lease_owner == worker_id,
               Shard.status == SHARD_RUNNING)
        .values(lease_expires_at=now + dt.timedelta(seconds=lease_seconds))
        .execution_options(synchronize_session=False)
    )
    kept = set(session.scalars(
        select(Shard.id).where(Shard.id.in_(shard_ids), Shard.lease_owner == worker_id,
                               Shard.status == SHARD_RUNNING)
    ).all())
    return set(shard_ids) - kept


def release(session: Session, shard_ids: list[str], *, worker_id: str) -> None:
    """Hand shards back at once (a clean shutdown): the next worker need not wait for the lease."""
    if not shard_ids:
        return
    session.execute(
        update(Shard)
        .where(Shard.id.in_(shard_ids), Shard.lease_owner == worker_id,
               Shard.status == SHARD_RUNNING)
        .values(status=SHARD_PENDING, lease_owner=None, lease_expires_at=None)
        .execution_options(synchronize_session=False)
    )
    session.execute(
        update(RequestLine)
        .where(RequestLine.shard_id.in_(shard_ids), RequestLine.status == LINE_RUNNING)
        .values(status=LINE_PENDING)
        .execution_options(synchronize_session=False)
    )


def reap_expired(session: Session, *, now: dt.datetime | None = None) -> list[str]:
    """Shards whose lease ran out, made pending again; returns their ids (to ring for them)."""
    now = now or utcnow()
    ids = session.scalars(
        select(Shard.id).where(Shard.status == SHARD_RUNNING, Shard.lease_expires_at < now)
    ).all()
    if ids:
        session.execute(
            update(Shard)
            .where(Shard.id.in_(ids), Shard.status == SHARD_RUNNING, Shard.lease_expires_at < now)
            .values(status=SHARD_PENDING, lease_owner=None, lease_expires_at=None)
            .execution_options(synchronize_session=False)
        )
    return list(ids)


def batch_statuses(session: Session, batch_ids: set[str]) -> dict[str, str]:
    if not batch_ids:
        return {}
    return dict(session.execute(
        select(Batch.id, Batch.status).where(Batch.id.in_(batch_ids))
    ).all())
