"""Enqueued-token quotas per tenant and model, as OpenAI caps a batch queue per model and
organisation: the prompt tokens plus max output tokens (``service.lines.enqueued_tokens``) of
the tenant's unfinished work may not pass its limit.

What a tenant holds is read from rows that already exist, never from its lines: each live batch
reserved ``Batch.enqueued_tokens`` when it was created (its file's count; prepare makes it its
valid lines' exact sum) and its closed lines released theirs into the batch's counter slots
(``BatchCounter.released_tokens``, written in the transaction that closes them: a result, a
poison shard, cancel or expiry); an open job holds ``Job.enqueued_tokens`` until it settles. A
finished batch or job holds nothing.

``reserve`` is race-free across API processes: it locks the tenant's row (``FOR UPDATE`` on
PostgreSQL; SQLite has one writer at a time) before it sums, so two batches created at once
are checked one after the other; releases only ever lower the sum, so they need no lock.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from service.models import (
    BATCH_TERMINAL,
    JOB_IN_PROGRESS,
    JOB_QUEUED,
    Batch,
    BatchCounter,
    Job,
    Tenant,
)

TOKEN_LIMIT_EXCEEDED = "token_limit_exceeded"  # OpenAI's code


class QuotaExceeded(Exception):
    """``requested`` more tokens would take ``enqueued`` past ``limit`` for ``model``."""

    def __init__(self, model: str, limit: int, enqueued: int, requested: int) -> None:
        self.model, self.limit, self.enqueued, self.requested = model, limit, enqueued, requested
        super().__init__(
            f"Enqueued token limit reached for {model}: the limit is {limit:,} enqueued "
            f"tokens, {enqueued:,} are enqueued and this request needs {requested:,} more. "
            "Please try again once some in_progress batches have been completed.")


def limit_for(*, key_limit: int | None, default: int | None) -> int | None:
    """The limit that applies: the key's own, else the deployment's (None: no limit)."""
    return key_limit if key_limit is not None else default


def enqueued(session: Session, *, tenant_id: str | None = None,
             model: str | None = None) -> dict[tuple[str, str | None], int]:
    """Tokens held per (tenant, model): of every tenant, or of one tenant (and one model)."""
    live = Batch.status.not_in(BATCH_TERMINAL)
    batches = select(Batch.tenant_id, Batch.model, Batch.id, Batch.enqueued_tokens).where(live)
    jobs = (select(Job.tenant_id, Job.model, func.sum(Job.enqueued_tokens))
            .where(Job.status.in_((JOB_QUEUED, JOB_IN_PROGRESS)))
            .group_by(Job.tenant_id, Job.model))
    if tenant_id is not None:
        batches = batches.where(Batch.tenant_id == tenant_id)
        jobs = jobs.where(Job.tenant_id == tenant_id)
    if model is not None:
        batches = batches.where(Batch.model == model)
        jobs = jobs.where(Job.model == model)
    rows = session.execute(batches).all()
    released = dict(session.execute(
        select(BatchCounter.batch_id, func.sum(BatchCounter.released_tokens))
        .where(BatchCounter.batch_id.in_([r.id for r in rows]))
        .group_by(BatchCounter.batch_id)).all()) if rows else {}
    return held_tokens(
        ((row.tenant_id, row.model, row.enqueued_tokens, released.get(row.id)) for row in rows),
        session.execute(jobs).all())


def held_tokens(batches: Iterable[tuple[str, str | None, int, int | None]],
                jobs: Iterable[tuple[str, str | None, int | None]]
                ) -> dict[tuple[str, str | None], int]:
    """Tokens held per (tenant, model), from rows read already: each live batch's (tenant,
    model, ``enqueued_tokens``, its counters' ``released_tokens`` summed or None), and the open
    jobs' (tenant, model, ``enqueued_tokens`` summed)."""
    held: dict[tuple[str, str | None], int] = defaultdict(int)
    for tenant, model, reserved, released in batches:
        held[(tenant, model)] += reserved - int(released or 0)
    for tenant, model, tokens in jobs:
        held[(tenant, model)] += int(tokens or 0)
    return dict(held)


def by_tenant_name(held: dict[tuple[str, str | None], int],
                   names: dict[str, str]) -> list[tuple[str, str, int]]:
    """(tenant name, model, tokens) of every (tenant, model) of ``held`` holding some, sorted;
    a tenant missing from ``names`` (tenant id -> name) goes by its id."""
    return sorted((names.get(tenant, tenant), model or "", tokens)
                  for (tenant, model), tokens in held.items() if tokens)


def reserve(session: Session, *, tenant_id: str, model: str, tokens: int,
            limit: int | None) -> int:
    """Check that ``tokens`` more fit under ``limit`` for (tenant, model), holding the tenant's
    row lock until the caller's transaction ends (it then adds the batch or job that holds
    them); returns what was enqueued before. Raises ``QuotaExceeded``."""
    if limit is None:
        return 0
    session.execute(select(Tenant.id).where(Tenant.id == tenant_id).with_for_update())
    before = enqueued(session, tenant_id=tenant_id, model=model).get((tenant_id, model), 0)
    if before + tokens > limit:
        raise QuotaExceeded(model, limit, before, tokens)
    return before
