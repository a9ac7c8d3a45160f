"""``boxcar status`` drawn for a terminal: a progress bar per unfinished batch
(``format_status``) of the report ``api.status`` makes; and the worker heartbeat check of
``boxcar worker --check``.
"""

from __future__ import annotations

import time
from typing import Any

from sqlalchemy import func, select

from service.db import Database, utcnow

BAR_WIDTH = 30


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
