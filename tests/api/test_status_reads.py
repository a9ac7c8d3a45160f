"""``boxcar status`` reads a few rows per unfinished batch in a few statements: the shards of
finished batches (the service's history) are not read, nor any line, and its counts are the
ones a plain count of each table gives. On SQLite and PostgreSQL (where the counts' rows are
also checked with ``EXPLAIN ANALYZE``)."""

from __future__ import annotations

import pytest
from sqlalchemy import event, func, select, text, update

from api.status import collect
from bench.scale_status import explained_status
from cli.status import format_status
from service.counters import CounterDelta, add
from service.keys import create_key
from service.models import (
    COMPLETED,
    IN_PROGRESS,
    SHARD_DONE,
    SHARD_PENDING,
    SHARD_RUNNING,
    Batch,
    Shard,
)
from tests.batch_rows import add_batch
from tests.conftest_services import migrated

MAX_STATEMENTS = 10
NUM_DONE_SHARDS = 2_000  # enough that PostgreSQL's planner reads them by index


@pytest.fixture
def db(any_db_url):
    database = migrated(any_db_url)
    yield database
    database.dispose()


def test_status_reads_the_unfinished_batches_and_their_shards_only(db):
    with db.session() as session:
        create_key(session, tenant_name="acme")
        tenant_id = session.scalar(text("SELECT id FROM tenants"))
    add_batch(db, tenant_id, status=COMPLETED, shards=[SHARD_DONE] * NUM_DONE_SHARDS)
    live = add_batch(db, tenant_id, status=IN_PROGRESS,
                     shards=[SHARD_DONE, SHARD_RUNNING, SHARD_PENDING, SHARD_PENDING],
                     owner="host:1")
    with db.session() as session:
        add(session, {live: CounterDelta(num_open=16)}, slot=0)
        add(session, {live: CounterDelta.closed("completed", completion_tokens=7)}, slot=3)
    statements: list[str] = []

    def seen(conn, cursor, statement, parameters, context, executemany) -> None:
        statements.append(statement)

    event.listen(db.read_engine, "before_cursor_execute", seen)
    try:
        report = collect(db, interval=2.0)
    finally:
        event.remove(db.read_engine, "before_cursor_execute", seen)
    assert report["batches"] == {"completed": 1, "in_progress": 1}
    assert report["shards"] == {"pending": 2, "running": 1}  # done shards are history
    assert report["queue_depth_lines"] == 8 and report["lease_holders"] == ["host:1"]
    assert report["lines"] == {"open": 15, "completed": 1, "failed": 0}
    [active] = report["active_batches"]
    assert (active["id"], active["total"], active["completed"], active["output_tokens"]) == (
        live, 16, 1, 7)
    assert "8 lines waiting in 2 shards; 1 shards running" in format_status(report)
    with db.read_session() as session:  # the same as counting the tables
        assert session.scalar(select(func.count()).select_from(Shard).where(
            Shard.status == SHARD_PENDING)) == report["shards"]["pending"]
    assert len(statements) <= MAX_STATEMENTS, statements
    assert not [s for s in statements if "request_lines" in s]
    if not db.is_sqlite:  # the rows PostgreSQL's scans read: the live batch's shards only
        with db.session() as session:
            session.execute(text("ANALYZE shards"))
        explained = explained_status(db.url, interval=2.0)
        assert explained["rows_read"].get("shards", 0) < 20, explained
    with db.session() as session:  # the batch ends: nothing unfinished is left to read
        session.execute(update(Batch).values(status=COMPLETED))
        session.execute(update(Shard).values(status=SHARD_DONE, lease_owner=None,
                                             lease_expires_at=None))
    done = collect(db, interval=2.0)
    assert (done["shards"], done["lease_holders"], done["queue_depth_lines"],
            done["active_batches"]) == ({}, [], 0, [])
