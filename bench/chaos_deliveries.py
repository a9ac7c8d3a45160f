"""The chaos run's checks on single jobs and webhooks (the batch checks are bench/chaos_audit.py):

- every job is in a final status after the drain, a completed one with its result and usage,
  a failed one with its error, and holds exactly one request line;
- each final event (a job's ``job.<status>``; ``batch.<status>`` for a tenant with a webhook
  endpoint) is queued once per target, not once per worker that raced to finish it;
- each of those events reached the receiver at least once with a signature that verifies,
  and the receiver saw no delivery that does not verify.
"""

from __future__ import annotations

from collections import Counter

import httpx
from sqlalchemy import create_engine, text

from bench.chaos_audit import Audit
from bench.chaos_webhooks import WebhookReceiver
from service.models import BATCH_TERMINAL, JOB_COMPLETED, JOB_FAILED

JOB_TERMINAL = (JOB_COMPLETED, JOB_FAILED)


def job_rows(database_url: str) -> list[tuple[str, str, str, int]]:
    """(job id, status, tenant name, its request lines) of every job."""
    engine = create_engine(database_url)
    try:
        with engine.connect() as conn:
            return [tuple(r) for r in conn.execute(text(
                "SELECT j.id, j.status, t.name, "
                "(SELECT count(*) FROM request_lines l WHERE l.job_id = j.id) "
                "FROM jobs j JOIN tenants t ON t.id = j.tenant_id ORDER BY j.created_at")).all()]
    finally:
        engine.dispose()


def queued_events(database_url: str, url_prefix: str) -> Counter[tuple[str, str, str]]:
    """Delivery rows to the receiver: (event type, object id, url) -> how many were queued."""
    engine = create_engine(database_url)
    try:
        with engine.connect() as conn:
            rows = conn.execute(text(
                "SELECT event_type, object_id, url FROM webhook_deliveries "
                "WHERE url LIKE :prefix"), {"prefix": url_prefix + "%"}).all()
    finally:
        engine.dispose()
    return Counter((event, object_id, url) for event, object_id, url in rows)


def audit_jobs(result: Audit, clients: dict[str, httpx.Client], database_url: str) -> None:
    for job_id, _, tenant, num_lines in job_rows(database_url):
        job = clients[tenant].get(f"/v1/jobs/{job_id}").json()
        status = job["status"]
        code = (job.get("error") or {}).get("code") if status == JOB_FAILED else None
        result.outcomes[f"job {status}" + (f" ({code})" if code else "")] += 1
        result.check("job terminal after drain", job_id, status in JOB_TERMINAL, status)
        result.check("job holds one line", job_id, num_lines == 1, f"{num_lines} lines")
        if status == JOB_COMPLETED:
            result.check("job result once", job_id,
                         job["result"] is not None and job["usage"] is not None
                         and job["error"] is None and job["completed_at"] is not None,
                         str(job)[:300])
        elif status == JOB_FAILED:
            result.check("job result once", job_id,
                         job["result"] is None and job["error"] is not None
                         and job["failed_at"] is not None, str(job)[:300])


def audit_webhooks(result: Audit, receiver: WebhookReceiver, database_url: str, *,
                   endpoint_tenants: set[str]) -> None:
    """Every final job event, and every final batch event of ``endpoint_tenants``."""
    expected: list[tuple[str, str]] = []
    for job_id, status, _, _ in job_rows(database_url):
        if status in JOB_TERMINAL:
            expected.append((f"job.{status}", job_id))
    engine = create_engine(database_url)
    try:
        with engine.connect() as conn:
            batches = conn.execute(text(
                "SELECT b.id, b.status, t.name FROM batches b "
                "JOIN tenants t ON t.id = b.tenant_id")).all()
    finally:
        engine.dispose()
    expected += [(f"batch.{status}", batch_id) for batch_id, status, tenant in batches
                 if tenant in endpoint_tenants and status in BATCH_TERMINAL]
    check_webhooks(result, expected, queued_events(database_url, receiver.url_for("")),
                   receiver)


def check_webhooks(result: Audit, expected: list[tuple[str, str]],
                   queued: Counter[tuple[str, str, str]], receiver: WebhookReceiver) -> None:
    """``expected`` (event type, object id) pairs against the delivery rows ``queued`` and what
    the receiver got."""
    per_event: Counter[tuple[str, str]] = Counter()
    for (event, object_id, _), n in queued.items():
        per_event[(event, object_id)] += 1
        result.check("event queued once per target", object_id, n == 1,
                     f"{event} queued {n} times")
    received = receiver.received()
    for event, object_id in expected:
        result.check("event queued", object_id, per_event[(event, object_id)] >= 1, event)
        result.check("webhook delivered and verified", object_id,
                     bool(received.get((event, object_id))), f"{event} never received")
    bad = [d for d in receiver.deliveries if not d.verified]
    result.check("every delivery verifies", "receiver", not bad,
                 "; ".join(f"{d.webhook_id}: {d.error}" for d in bad[:5]))
