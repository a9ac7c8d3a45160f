"""``boxcar status``'s database part, as the scale benchmark's poller measures it: one run of
the command less Python's start-up (``cli.status_reader.StatusCommand``: on PostgreSQL a new
connection and one round trip with the schema's revision and the reads; a report), timed; and
once, every statement that run sends explained (``EXPLAIN ANALYZE``): the rows its scans read,
table by table, so a report that grows with the lines or shards of the service's history shows.
"""

from __future__ import annotations

import time
from collections import Counter
from typing import Any

import psycopg

from cli.status_reader import StatusCommand, StatusReader
from service.compiled import conninfo
from service.db import utcnow


def timed_status(url: str, *, interval: float) -> tuple[float, float, dict[str, Any]]:
    """(ms to connect, ms of the rest: the reads, the schema's check and the report; the
    report). Raises if the report did not come the fast way: the figures would be another
    path's."""
    start = time.perf_counter()
    status = StatusCommand(url)
    try:
        report = status.collect(interval=interval)
        took = time.perf_counter() - start
    finally:
        status.close()
    if not status.fast:
        raise RuntimeError("boxcar status fell back from its one-round-trip read")
    return 1000 * status.connect_s, 1000 * (took - status.connect_s), report


def batch_status(report: dict[str, Any], batch_id: str) -> str:
    """The batch's status among the report's unfinished batches (``absent``: not listed)."""
    return next((b["status"] for b in report["active_batches"] if b["id"] == batch_id),
                "absent")


def _scanned(plan: dict[str, Any], rows: Counter[str]) -> None:
    """Rows each table's scans read: those they returned and those their filters dropped."""
    if "Relation Name" in plan:
        read = plan.get("Actual Rows", 0) + plan.get("Rows Removed by Filter", 0)
        rows[plan["Relation Name"]] += int(read * plan.get("Actual Loops", 1))
    for child in plan.get("Plans", []):
        _scanned(child, rows)


def explained_status(url: str, *, interval: float) -> dict[str, Any]:
    """The statements of one ``boxcar status`` explained: their number, the rows read by
    table, and PostgreSQL's execution ms summed."""
    sql = StatusReader(url).sql(now=utcnow(), interval=interval)
    rows: Counter[str] = Counter()
    execution_ms = 0.0
    with psycopg.connect(conninfo(url), autocommit=True) as conn:
        for statement, parameters in sql:
            [(plan,)] = conn.execute(f"EXPLAIN (ANALYZE, FORMAT JSON) {statement}",
                                     parameters).fetchall()
            _scanned(plan[0]["Plan"], rows)
            execution_ms += plan[0]["Execution Time"]
    return {"statements": len(sql), "rows_read": dict(rows.most_common()),
            "execution_ms": round(execution_ms, 2)}
