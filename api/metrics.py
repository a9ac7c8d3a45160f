"""What the API's /metrics serves: this process's counters, the service's state counted in the
database (batches, jobs and shards by status, queue depth, live workers, the tokens each tenant
has enqueued per model against its quota), and every live worker's
engine metrics from the snapshot it writes to the ``workers`` table (labelled ``worker``).

Workers publish their snapshots to the database rather than the API scraping them because the
database is the one thing every process shares in both modes: nothing has to know where workers
run, and ``boxcar serve`` and a production fleet go through the same code.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

from prometheus_client import REGISTRY, CollectorRegistry
from prometheus_client.core import GaugeMetricFamily
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from api.eta import estimate
from metrics.catalog import ForwardCollector, families_from_snapshots
from service.db import Database
from service.liveness import live_workers
from service.models import (
    CANCELLED,
    CANCELLING,
    COMPLETED,
    EXPIRED,
    FAILED,
    FINALIZING,
    IN_PROGRESS,
    JOB_COMPLETED,
    JOB_FAILED,
    JOB_IN_PROGRESS,
    JOB_QUEUED,
    SHARD_DONE,
    SHARD_PENDING,
    SHARD_RUNNING,
    VALIDATING,
    Batch,
    Job,
    Shard,
    Tenant,
)
from service.quotas import by_tenant_name, enqueued

log = logging.getLogger(__name__)

BATCH_STATUSES = (VALIDATING, IN_PROGRESS, FINALIZING, COMPLETED, FAILED, EXPIRED, CANCELLING,
                  CANCELLED)
JOB_STATUSES = (JOB_QUEUED, JOB_IN_PROGRESS, JOB_COMPLETED, JOB_FAILED)
SHARD_STATUSES = (SHARD_PENDING, SHARD_RUNNING, SHARD_DONE)
BATCHES_AT_RISK = "boxcar_batches_deadline_at_risk"
ENQUEUED_TOKENS = "boxcar_enqueued_tokens"


def counts_by(session: Session, column: Any, statuses: tuple[str, ...]) -> dict[str, int]:
    found = dict(session.execute(select(column, func.count()).group_by(column)).all())
    return {status: int(found.get(status, 0)) for status in (*statuses, *found)}


def enqueued_by_tenant(session: Session) -> list[tuple[str, str, int]]:
    """(tenant name, model, tokens held against the quota) of every tenant holding some."""
    held = {k: v for k, v in enqueued(session).items() if v}
    names = dict(session.execute(select(Tenant.id, Tenant.name).where(
        Tenant.id.in_({tenant for tenant, _ in held}))).all()) if held else {}
    return by_tenant_name(held, names)


def queue_depth(session: Session) -> int:
    """Lines in shards no worker has claimed yet."""
    return int(session.scalar(select(func.coalesce(func.sum(Shard.num_lines), 0))
                              .where(Shard.status == SHARD_PENDING)) or 0)


class ServiceCollector:
    """A prometheus_client collector reading the database at each scrape."""

    def __init__(self, db: Database, worker_metrics_interval: float,
                 max_enqueued_tokens: int | None = None) -> None:
        self._db = db
        self._interval = worker_metrics_interval
        self._max_enqueued_tokens = max_enqueued_tokens

    def collect(self) -> Iterator[Any]:
        try:
            with self._db.read_session() as session:
                batches = counts_by(session, Batch.status, BATCH_STATUSES)
                jobs = counts_by(session, Job.status, JOB_STATUSES)
                shards = counts_by(session, Shard.status, SHARD_STATUSES)
                depth = queue_depth(session)
                held = enqueued_by_tenant(session)
                workers = [(w.id, w.metrics) for w in live_workers(
                    session, interval=self._interval)]
                at_risk = sum(1 for eta in estimate(
                    session, worker_metrics_interval=self._interval).values() if eta.late)
        except Exception:  # a scrape reports what it can; the API's own counters still go out
            log.exception("could not read the service's state for /metrics")
            return
        for name, help, counts in (("boxcar_batches", "Batches by status", batches),
                                   ("boxcar_jobs", "Single jobs by status", jobs),
                                   ("boxcar_shards", "Shards by status", shards)):
            family = GaugeMetricFamily(name, help, labels=["status"])
            for status, count in counts.items():
                family.add_metric([status], count)
            yield family
        yield GaugeMetricFamily("boxcar_queue_depth_lines",
                                "Request lines in shards no worker has claimed yet", value=depth)
        yield GaugeMetricFamily("boxcar_workers", "Workers with a recent heartbeat",
                                value=len(workers))
        family = GaugeMetricFamily(ENQUEUED_TOKENS, "Prompt plus max output tokens of a "
                                   "tenant's unfinished lines, per model (its quota's use)",
                                   labels=["tenant", "model"])
        for tenant, model, tokens in held:
            family.add_metric([tenant, model], tokens)
        yield family
        if self._max_enqueued_tokens is not None:
            yield GaugeMetricFamily(f"{ENQUEUED_TOKENS}_limit", "The deployment's enqueued-"
                                    "token limit per tenant and model (a key may have its own)",
                                    value=self._max_enqueued_tokens)
        yield GaugeMetricFamily(BATCHES_AT_RISK, "Live batches whose estimated completion "
                                "passes their deadline (the end of the completion window)",
                                value=at_risk)
        yield from families_from_snapshots([({"worker": wid}, snapshot)
                                            for wid, snapshot in workers if snapshot])


def metrics_registry(db: Database, worker_metrics_interval: float,
                     max_enqueued_tokens: int | None = None) -> CollectorRegistry:
    """The API's /metrics: the process's own registry plus the service collector."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(ForwardCollector(REGISTRY))  # type: ignore[arg-type]
    registry.register(ServiceCollector(  # type: ignore[arg-type]
        db, worker_metrics_interval, max_enqueued_tokens))
    return registry
