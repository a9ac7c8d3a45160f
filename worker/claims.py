"""Shard leases in the database: claim, heartbeat, release, reap.

A shard is claimable when it is pending, or running under a lease that has expired (its worker
died or stalled). ``find_candidates`` reads, without locking, the shards worth trying in
``service.queue_order``'s order: single jobs, then bulk shards by (deadline bucket, batch
priority), the tenants with the fewest running shards first among equals. ``claim_shards`` then
takes several of them in one short transaction: on PostgreSQL it locks the candidates that are
still claimable with ``FOR UPDATE SKIP LOCKED``, so a worker never waits for another's claim and
never takes a shard twice; it keeps the first it wants and writes their leases in one UPDATE. The
claim is written per shard only: the lines stay "pending" (the lease says who runs them) and
are read after the commit, with no lock held. SQLite (the embedded mode, one process) has no
SKIP LOCKED and needs none: its write transactions run one at a time (``BEGIN IMMEDIATE``).
A worker claims only shards of the model it serves (and shards from before routing, which name
none).
"""

from __future__ import annotations

import datetime as dt
from collections import Counter
from dataclasses import dataclass

from sqlalchemy import and_, case, func, or_, select, true, update
from sqlalchemy.orm import Session

from service import counters, ids
from service.counters import CounterDelta
from service.db import utcnow
from service.models import (
    IN_PROGRESS,
    JOB_IN_PROGRESS,
    JOB_QUEUED,
    LINE_FAILED,
    LINE_OPEN,
    SHARD_DONE,
    SHARD_PENDING,
    SHARD_RUNNING,
    Batch,
    Job,
    RequestLine,
    Shard,
)
from service.queue_order import bulk_rank
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
    deadline: float | None = None
    batch_id: str | None = None


def find_candidates(
    session: Session, *, now: dt.datetime, max_bulk: int, max_jobs: int,
    model: str | None = None, spread: int = 0,
) -> list[Candidate]:
    """Shards worth trying to claim, in the order to try them (``service.queue_order``): jobs
    by priority, then bulk shards by (deadline bucket, batch priority), spread over tenants
    (fewest running shards first) among equals, each tenant's in batch order.

    ``spread``: where this worker starts in each batch's run of equal shards (``rotated``): all
    workers read the same head of the queue, and when each tried the same first shards, most
    claim statements lost some to another worker (92% at 32 workers) and made up for them from
    further down. Which shard of a batch goes first changes no order the queue promises."""
    base = (
        select(Shard.id, Shard.tenant_id, Shard.priority, Shard.job_id, Batch.expires_at,
               Shard.batch_id)
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
        .order_by(Batch.expires_at, Shard.priority.desc(), Shard.created_at, Shard.id)
        .limit(max_bulk * 8)
    ).all() if max_bulk > 0 else []
    # Only bulk candidates are spread over tenants: a worker with no room for bulk shards (its
    # engine's queue is deep: most of its polls) asks for jobs alone, in one statement.
    running = Counter(dict(session.execute(
        select(Shard.tenant_id, func.count()).where(
            Shard.status == SHARD_RUNNING, Shard.lease_expires_at >= now, Shard.job_id.is_(None)
        ).group_by(Shard.tenant_id)
    ).all())) if bulk_rows else Counter()
    # Per tenant, its shards in claim order; a tenant's head decides when it is served.
    by_tenant: dict[str, list[Candidate]] = {}
    for row in bulk_rows:
        by_tenant.setdefault(row.tenant_id, []).append(Candidate(
            row.id, row.tenant_id, row.priority, False, unix_seconds(row.expires_at),
            row.batch_id))
    for tenant, shards in by_tenant.items():
        shards.sort(key=lambda c: bulk_rank(c.deadline, c.priority))  # stable: batch order kept
        by_tenant[tenant] = rotated(shards, spread)
    bulk: list[Candidate] = []
    while by_tenant and len(bulk) < max_bulk:
        tenant = min(by_tenant, key=lambda t: (
            bulk_rank(by_tenant[t][0].deadline, by_tenant[t][0].priority), running[t]))
        candidate = by_tenant[tenant].pop(0)
        if not by_tenant[tenant]:
            del by_tenant[tenant]
        running[tenant] += 1
        bulk.append(candidate)
    return [Candidate(r.id, r.tenant_id, r.priority, True) for r in jobs] + bulk


def rotated(shards: list[Candidate], spread: int) -> list[Candidate]:
    """``shards`` with each run of one batch's shards (consecutive, of one rank) rotated to
    start at ``spread`` (modulo its length); the runs keep their order."""
    if not spread:
        return shards
    out: list[Candidate] = []
    start = 0
    for end in range(1, len(shards) + 1):
        if end == len(shards) or shards[end].batch_id != shards[start].batch_id:
            run = shards[start:end]
            at = spread % len(run)
            out += run[at:] + run[:at]
            start = end
    return out


def unix_seconds(value: dt.datetime | None) -> float | None:
    return None if value is None else value.timestamp()


@dataclass(frozen=True)
class ClaimedShard:
    """A shard this worker now holds the lease on."""

    id: str
    tenant_id: str
    batch_id: str | None
    job_id: str | None
    priority: int
    attempts: int  # claims of it so far, this one included


@dataclass(frozen=True)
class Claim:
    shard: HeldShard
    lines: list[LineWork]
    attempts: int


def claim_shards(
    session: Session,
    shard_ids: list[str],
    *,
    worker_id: str,
    lease_seconds: float,
    max_bulk: int,
    max_jobs: int,
    now: dt.datetime | None = None,
    model: str | None = None,
    fill: bool = False,
) -> list[ClaimedShard]:
    """Take the leases on up to ``max_bulk`` bulk shards and ``max_jobs`` job shards among
    ``shard_ids`` (tried in that order) that are claimable, of ``model`` and whose batch is
    running; those another transaction is claiming right now are skipped, not waited for.

    ``fill``: bulk shards of ``shard_ids`` that others took since they were read are made up
    for, in the same statement, by other claimable bulk shards in queue order, so a claim comes
    back short only when the queue is (nearly) dry, not because racing workers read the same
    candidates."""
    if (not shard_ids and not fill) or (max_bulk <= 0 and max_jobs <= 0):
        return []
    now = now or utcnow()
    batch_running = or_(
        Shard.job_id.is_not(None),
        select(Batch.id).where(Batch.id == Shard.batch_id, Batch.status == IN_PROGRESS).exists(),
    )
    picked: list[ClaimedShard] = []
    job_ids = [sid for sid in shard_ids if ids.is_job_shard(sid)]
    bulk_ids = [sid for sid in shard_ids if not ids.is_job_shard(sid)]
    columns = (Shard.id, Shard.tenant_id, Shard.batch_id, Shard.job_id, Shard.priority,
               Shard.attempts)
    for wanted, limit, is_bulk in ((job_ids, max_jobs, False), (bulk_ids, max_bulk, True)):
        if (not wanted and not (fill and is_bulk)) or limit <= 0:
            continue
        # Lock only as many as wanted, the first free ones in the caller's order: the rest
        # stay free for the workers claiming beside this one.
        rank = [case({sid: i for i, sid in enumerate(wanted)}, value=Shard.id,
                     else_=len(wanted))] if wanted else []
        if is_bulk and fill:
            # The wanted ones first, then any claimable bulk shard in queue order (the order
            # find_candidates reads, without its spreading over tenants).
            query = (select(*columns).join(Batch, Batch.id == Shard.batch_id)
                     .where(Shard.job_id.is_(None), _claimable(now),
                            Batch.status == IN_PROGRESS, _of_model(model))
                     .order_by(*rank, Batch.expires_at, Shard.priority.desc(),
                               Shard.created_at, Shard.id))
        else:
            query = (select(*columns)
                     .where(Shard.id.in_(wanted), _claimable(now), batch_running,
                            _of_model(model))
                     .order_by(*rank))
        rows = session.execute(
            query.limit(limit).with_for_update(skip_locked=True, of=Shard)).all()
        picked += [ClaimedShard(r.id, r.tenant_id, r.batch_id, r.job_id, r.priority,
                                r.attempts + 1) for r in rows]
    if not picked:
        return []
    session.execute(
        update(Shard)
        .where(Shard.id.in_([c.id for c in picked]))
        .values(status=SHARD_RUNNING, lease_owner=worker_id, attempts=Shard.attempts + 1,
                lease_expires_at=now + dt.timedelta(seconds=lease_seconds))
        .execution_options(synchronize_session=False)
    )
    claimed_jobs = [c.job_id for c in picked if c.job_id is not None]
    if claimed_jobs:
        session.execute(
            update(Job).where(Job.id.in_(claimed_jobs), Job.status == JOB_QUEUED)
            .values(status=JOB_IN_PROGRESS).execution_options(synchronize_session=False)
        )
    return picked


def num_lost(shard_ids: list[str], claimed: list[ClaimedShard], *, max_bulk: int,
             max_jobs: int) -> int:
    """Shards a ``claim_shards`` statement wanted and did not get: of the first ``max_jobs``
    job and ``max_bulk`` bulk shards of ``shard_ids`` (those it locks first), the ones it did
    not win. Another worker's claim held their row locks (``SKIP LOCKED`` passed over them) or
    had taken them since they were read. ``fill`` makes up for them with other shards, so the
    shards won hide this contention; this counts it."""
    won = {c.id for c in claimed}
    jobs = [sid for sid in shard_ids if ids.is_job_shard(sid)][:max(max_jobs, 0)]
    bulk = [sid for sid in shard_ids if not ids.is_job_shard(sid)][:max(max_bulk, 0)]
    return sum(1 for sid in (*jobs, *bulk) if sid not in won)


def load_lines(session: Session, claimed: list[ClaimedShard]) -> list[Claim]:
    """The open lines of claimed shards, in run order, as work for the drain loop."""
    if not claimed:
        return []
    batch_ids = {c.batch_id for c in claimed if c.batch_id is not None}
    deadlines = {batch_id: unix_seconds(expires_at) for batch_id, expires_at in session.execute(
        select(Batch.id, Batch.expires_at).where(Batch.id.in_(batch_ids))
    ).all()} if batch_ids else {}
    rows = session.execute(
        select(RequestLine.pk, RequestLine.shard_id, RequestLine.tenant_id,
               RequestLine.batch_id, RequestLine.job_id, RequestLine.endpoint, RequestLine.body,
               RequestLine.engine_fields)
        .where(RequestLine.shard_id.in_([c.id for c in claimed]),
               RequestLine.status.in_(LINE_OPEN))
        .order_by(RequestLine.shard_id, RequestLine.position, RequestLine.pk)
    ).all()
    lines: dict[str, list[LineWork]] = {c.id: [] for c in claimed}
    shards = {c.id: c for c in claimed}
    for r in rows:
        shard = shards[r.shard_id]
        lines[r.shard_id].append(LineWork(
            line_pk=r.pk, shard_id=r.shard_id, tenant_id=r.tenant_id, batch_id=r.batch_id,
            job_id=r.job_id, endpoint=r.endpoint, body=r.body or {},
            engine_fields=r.engine_fields, priority=shard.priority,
            deadline=deadlines.get(shard.batch_id or ""), attempt=shard.attempts))
    return [
        Claim(HeldShard(c.id, c.tenant_id, c.batch_id, c.job_id, c.priority,
                        {w.line_pk for w in lines[c.id]}, attempt=c.attempts), lines[c.id],
              c.attempts)
        for c in claimed
    ]


def try_claim(
    session: Session,
    shard_id: str,
    *,
    worker_id: str,
    lease_seconds: float,
    now: dt.datetime | None = None,
    model: str | None = None,
) -> Claim | None:
    """Claim one shard and load its lines in ``session``; None when it is not ours to take."""
    claimed = claim_shards(session, [shard_id], worker_id=worker_id, lease_seconds=lease_seconds,
                           max_bulk=1, max_jobs=1, now=now, model=model)
    found = load_lines(session, claimed)
    return found[0] if found else None


def fail_lines(
    session: Session, line_pks: list[int], *, code: str, message: str, worker_id: str
) -> None:
    """Give open lines a final error (a poison shard that keeps killing its workers), and
    count them in their batches' counters."""
    if not line_pks:
        return
    closed = session.execute(
        update(RequestLine)
        .where(RequestLine.pk.in_(line_pks), RequestLine.status.in_(LINE_OPEN))
        .values(status=LINE_FAILED, error={"code": code, "message": message},
                finished_at=utcnow(), worker_id=worker_id)
        .returning(RequestLine.batch_id, RequestLine.enqueued_tokens)
        .execution_options(synchronize_session=False)
    ).all()
    deltas: dict[str, CounterDelta] = {}
    for batch_id, tokens in closed:
        if batch_id is not None:
            deltas[batch_id] = deltas.get(batch_id, CounterDelta()) + CounterDelta.closed(
                LINE_FAILED, released_tokens=tokens)
    counters.add(session, deltas, slot=counters.slot_of(worker_id))


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
    kept = session.execute(
        update(Shard)
        .where(Shard.id.in_(shard_ids), Shard.lease_owner == worker_id,
               Shard.status == SHARD_RUNNING)
        .values(lease_expires_at=utcnow() + dt.timedelta(seconds=lease_seconds))
        .returning(Shard.id)
        .execution_options(synchronize_session=False)
    ).scalars().all()
    return set(shard_ids) - set(kept)


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


def reap_expired(session: Session, *, now: dt.datetime | None = None) -> list[str]:
    """Shards whose lease ran out, made pending again; returns their ids (to ring for them)."""
    now = now or utcnow()
    return list(session.execute(
        update(Shard)
        .where(Shard.status == SHARD_RUNNING, Shard.lease_expires_at < now)
        .values(status=SHARD_PENDING, lease_owner=None, lease_expires_at=None)
        .returning(Shard.id)
        .execution_options(synchronize_session=False)
    ).scalars().all())


def batch_statuses(session: Session, batch_ids: set[str]) -> dict[str, str]:
    if not batch_ids:
        return {}
    return dict(session.execute(
        select(Batch.id, Batch.status).where(Batch.id.in_(batch_ids))
    ).all())
