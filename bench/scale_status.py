"""``boxcar status``'s database part, as the scale benchmark's poller measures it: one run of
the command less Python's start-up (open the database and check its schema, ``collect``, close),
timed; and once, every statement ``collect`` runs explained (``EXPLAIN ANALYZE``): the rows its
scans read, table by table, so a report that grows with the lines or shards of the service's
history shows.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from sqlalchemy import event

from cli.service_commands import open_database
from cli.status import collect
from service.db import Database


def timed_status(url: str, *, interval: float) -> tuple[float, float, dict[str, Any]]:
    """(ms to open the database and check its schema, ms of ``collect``, the report)."""
    start = time.perf_counter()
    db = open_database(url)
    opened = time.perf_counter()
    try:
        report = collect(db, interval=interval)
        collected = time.perf_counter()
    finally:
        db.dispose()
    return 1000 * (opened - start), 1000 * (collected - opened), report


def batch_status(report: dict[str, Any], batch_id: str) -> str:
    """The batch's status among the report's unfinished batches (``absent``: not listed)."""
    return next((b["status"] for b in report["active_batches"] if b["id"] == batch_id),
                "absent")


@contextmanager
def _statements(db: Database) -> Iterator[list[tuple[str, Any]]]:
    seen: list[tuple[str, Any]] = []

    def record(conn: Any, cursor: Any, statement: str, parameters: Any, context: Any,
               executemany: bool) -> None:
        seen.append((statement, parameters))

    engines = {id(e): e for e in (db.engine, db.read_engine)}.values()
    for engine in engines:
        event.listen(engine, "before_cursor_execute", record)
    try:
        yield seen
    finally:
        for engine in engines:
            event.remove(engine, "before_cursor_execute", record)


def _scanned(plan: dict[str, Any], rows: Counter[str]) -> None:
    """Rows each table's scans read: those they returned and those their filters dropped."""
    if "Relation Name" in plan:
        read = plan.get("Actual Rows", 0) + plan.get("Rows Removed by Filter", 0)
        rows[plan["Relation Name"]] += int(read * plan.get("Actual Loops", 1))
    for child in plan.get("Plans", []):
        _scanned(child, rows)


def explained_status(url: str, *, interval: float) -> dict[str, Any]:
    """One ``collect`` with its statements explained: their number, the rows read by table, and
    PostgreSQL's execution ms summed."""
    db = open_database(url)
    try:
        with _statements(db) as seen:
            collect(db, interval=interval)
        rows: Counter[str] = Counter()
        execution_ms = 0.0
        with db.engine.connect() as conn:
            for statement, parameters in seen:
                plan = conn.exec_driver_sql(f"EXPLAIN (ANALYZE, FORMAT JSON) {statement}",
                                            parameters).scalar_one()[0]
                _scanned(plan["Plan"], rows)
                execution_ms += plan["Execution Time"]
            conn.rollback()
    finally:
        db.dispose()
    return {"statements": len(seen), "rows_read": dict(rows.most_common()),
            "execution_ms": round(execution_ms, 2)}
