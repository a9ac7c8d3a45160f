"""The chaos run's auditor: after the drain, every batch in the database is checked against the
invariants below, read back through the API as its tenant sees it (files, request_counts,
timestamps) and from the database (quotas, every batch of every tenant, also those whose
create call got no answer). Each check counts once per batch it is applied to."""

from __future__ import annotations

import json
import threading
from collections import Counter
from dataclasses import dataclass, field

import httpx
from sqlalchemy import create_engine, text

from service.db import Database
from service.models import BATCH_TERMINAL
from service.quotas import TOKEN_LIMIT_EXCEEDED, enqueued
from tests.system.audit import exactly_once, read_results

# Statuses in the order a batch may pass through them; a batch never moves to a lower rank
# (cancelling and finalizing share one: a cancel may find a batch finalizing and the reverse)
# and never leaves a terminal status.
RANK = {"validating": 0, "in_progress": 1, "cancelling": 2, "finalizing": 2,
        "completed": 3, "failed": 3, "expired": 3, "cancelled": 3}
TERMINAL_AT = {"completed": "completed_at", "failed": "failed_at", "expired": "expired_at",
               "cancelled": "cancelled_at"}


class StatusWatch:
    """Reads every batch's status from the database a few times a second (skipping the
    database's outages) and keeps each batch's sequence of distinct statuses."""

    def __init__(self, database_url: str, interval_s: float = 0.3) -> None:
        self.database_url, self.interval_s = database_url, interval_s
        self.seen: dict[str, list[str]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        engine = create_engine(self.database_url, pool_pre_ping=True,
                               connect_args={"connect_timeout": 2})
        try:
            while not self._stop.wait(self.interval_s):
                try:
                    with engine.connect() as conn:
                        rows = conn.execute(text("SELECT id, status FROM batches")).all()
                except Exception:  # the database is away: a fault of the run
                    continue
                for batch_id, status in rows:
                    statuses = self.seen.setdefault(batch_id, [])
                    if not statuses or statuses[-1] != status:
                        statuses.append(status)
        finally:
            engine.dispose()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


@dataclass
class Audit:
    checked: Counter[str] = field(default_factory=Counter)
    violations: list[tuple[str, str, str]] = field(default_factory=list)  # (check, object, what)
    outcomes: Counter[str] = field(default_factory=Counter)

    def check(self, name: str, subject: str, ok: bool, what: str = "") -> None:
        self.checked[name] += 1
        if not ok:
            self.violations.append((name, subject, what))


def batch_rows(database_url: str) -> list[tuple[str, str, str]]:
    """(batch id, status, tenant name) of every batch."""
    engine = create_engine(database_url)
    try:
        with engine.connect() as conn:
            return [tuple(r) for r in conn.execute(text(
                "SELECT b.id, b.status, t.name FROM batches b "
                "JOIN tenants t ON t.id = b.tenant_id ORDER BY b.created_at")).all()]
    finally:
        engine.dispose()


def audit(*, base_url: str, database_url: str, keys: dict[str, str],
          cancel_requested: set[str], watch: StatusWatch) -> Audit:
    """Every invariant over every batch; ``keys`` maps tenant name to an API key."""
    result = Audit()
    clients = {name: httpx.Client(base_url=base_url, timeout=60,
                                  headers={"Authorization": f"Bearer {key}"})
               for name, key in keys.items()}
    try:
        for batch_id, status, tenant in batch_rows(database_url):
            result.outcomes[f"batch {status}"] += 1
            _audit_batch(result, clients[tenant], batch_id, cancel_requested,
                         watch.seen.get(batch_id, []))
    finally:
        for client in clients.values():
            client.close()
    db = Database(database_url)
    try:
        with db.read_session() as session:
            held = enqueued(session)
            names = dict(session.execute(text("SELECT id, name FROM tenants")).all())
    finally:
        db.dispose()
    for (tenant_id, model), tokens in sorted(held.items(), key=str):
        result.check("quota released", names.get(tenant_id, tenant_id), tokens == 0,
                     f"{tokens} enqueued tokens still held for {model}")
    result.checked["quota released"] += len(keys) - len(held)  # tenants holding no row at all
    return result


def _audit_batch(result: Audit, client: httpx.Client, batch_id: str,
                 cancel_requested: set[str], statuses: list[str]) -> None:
    batch = client.get(f"/v1/batches/{batch_id}").json()
    status = batch["status"]
    result.check("terminal after drain", batch_id, status in BATCH_TERMINAL, status)
    if status not in BATCH_TERMINAL:
        return
    # The only failure the workload can meet: prepare's exact token count passes the quota
    # that create's estimate fitted under (OpenAI fails such a batch the same way).
    codes = {e["code"] for e in (batch.get("errors") or {}).get("data", [])}
    result.check("failed only over quota", batch_id,
                 status != "failed" or codes == {TOKEN_LIMIT_EXCEEDED}, str(batch.get("errors")))
    result.check("cancelled only when asked", batch_id,
                 status != "cancelled" or batch_id in cancel_requested)
    result.check("legal status changes", batch_id, legal_changes(statuses),
                 " -> ".join(statuses))
    audit_timestamps(result, batch)
    expected = _input_ids(client, batch)
    results = read_results(client, batch)
    # A batch admits its lines when it starts (in_progress); one that failed validation, or
    # was cancelled or expired before it started, answers none, or (cancelled while its
    # prepare ran on: the prepare writes the lines, finalize closes them) each line as
    # cancelled. Every other one answers each custom_id exactly once.
    admitted = status != "failed" and batch["in_progress_at"] is not None
    answers_all = admitted or bool(results.custom_ids)
    figures = exactly_once(expected if answers_all else [], results.custom_ids)
    result.check("each custom_id exactly once", batch_id, not any(figures.values()),
                 str(figures))
    counts = batch["request_counts"]
    result.check("request_counts equal the lines", batch_id,
                 counts["total"] in ((len(expected),) if admitted else (0, len(expected)))
                 and counts["completed"] == results.num_succeeded
                 and counts["failed"] == len(results.custom_ids) - results.num_succeeded,
                 f"{counts} vs {len(expected)} lines, {results.num_succeeded} succeeded, "
                 f"{len(results.custom_ids)} answered")
    usage = batch["usage"]
    result.check("usage equals the lines", batch_id,
                 usage["input_tokens"] == results.prompt_tokens
                 and usage["output_tokens"] == results.completion_tokens,
                 f"{usage['input_tokens']}/{usage['output_tokens']} vs "
                 f"{results.prompt_tokens}/{results.completion_tokens}")


def legal_changes(statuses: list[str]) -> bool:
    """Whether a batch's observed statuses (distinct in a row, some may have been missed
    between two looks) could be a legal path: never back to a lower rank, nothing after a
    final status."""
    ranks = [RANK[s] for s in statuses]
    return ranks == sorted(ranks) and all(s not in BATCH_TERMINAL for s in statuses[:-1])


def audit_timestamps(result: Audit, batch: dict) -> None:
    """The final status's timestamp and no other final one; each set timestamp no earlier than
    the one of the status before it."""
    status = batch["status"]
    finals = {at for at in TERMINAL_AT.values() if batch[at] is not None}
    ok = finals == {TERMINAL_AT[status]}
    chains = (("created_at", "in_progress_at", "finalizing_at", "completed_at"),
              ("created_at", "in_progress_at", "finalizing_at", "expired_at"),
              ("created_at", "cancelling_at", "cancelled_at"), ("created_at", "failed_at"))
    for chain in chains:
        times = [batch[at] for at in chain if batch[at] is not None]
        ok = ok and times == sorted(times)
    if status == "completed":
        ok = ok and batch["in_progress_at"] is not None and batch["finalizing_at"] is not None
    if status == "cancelled":
        ok = ok and batch["cancelling_at"] is not None
    result.check("timestamps ordered", batch["id"], ok,
                 str({k: v for k, v in batch.items() if k.endswith("_at")}))


def _input_ids(client: httpx.Client, batch: dict) -> list[str]:
    response = client.get(f"/v1/files/{batch['input_file_id']}/content")
    response.raise_for_status()
    return [json.loads(raw)["custom_id"] for raw in response.text.splitlines() if raw.strip()]
