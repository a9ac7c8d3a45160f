"""``boxcar status`` on PostgreSQL (``cli.status_reader``): the same report as the SQLAlchemy
path (``cli.status.collect``) on a database with batches, shards, workers and jobs in every
state, on one connection of its own and in one round trip after connecting; a schema not at
the code's revision falls back to ``open_database``'s path and its message, as before."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

import psycopg
import pytest
from alembic.script import ScriptDirectory
from psycopg import pq

from api.status import collect, read, report
from cli.database import Refused
from cli.status_reader import StatusCommand, StatusReader
from service.db import Database, utcnow
from service.migrate import alembic_config, head, upgrade
from service.models import (
    FINALIZING,
    IN_PROGRESS,
    VALIDATING,
)
from service.revisions import code_head
from tests import batch_rows
from tests.conftest_services import REPO, migrated, pg_schema

INTERVAL = 2.0


@pytest.fixture
def pg_url():
    with pg_schema() as url:
        yield url


@pytest.fixture
def busy_db(pg_url):
    """A database with something in every part of the report."""
    db = migrated(pg_url)
    batch_rows.fill_every_part(db)
    yield db
    db.dispose()


def test_the_fast_path_reports_what_the_sqlalchemy_path_does(busy_db):
    now = utcnow()
    with busy_db.read_session() as session:
        expected = report(read(session, now=now, interval=INTERVAL), now=now,
                          max_enqueued_tokens=1_000)
    reader = StatusReader(busy_db.url)
    with reader.connect() as conn:
        found = report(reader.read(conn, now=now, interval=INTERVAL), now=now,
                       max_enqueued_tokens=1_000)
    assert found == expected
    # Every part has something in it, so the comparison above compares something.
    assert found["batches"] == {"completed": 1, "in_progress": 2, "finalizing": 1,
                                "validating": 1, "cancelling": 1}
    assert found["jobs"] == {"queued": 1, "in_progress": 1, "completed": 1}
    assert found["shards"] == {"pending": 3, "running": 2}
    assert found["webhook_deliveries"] == {"pending": 1}
    assert found["queue_depth_lines"] == 12 and found["lease_holders"] == ["host:1"]
    assert [w["id"] for w in found["workers"]] == ["host:1", "host:2"]
    etas = {b["status"]: b["estimated_completion_at"] for b in found["active_batches"]}
    # A validating batch is estimated too, from its file's lines (told at create).
    assert None not in (etas[IN_PROGRESS], etas[FINALIZING], etas[VALIDATING])
    assert found["enqueued_tokens"] == [
        {"tenant": "acme", "model": "m", "tokens": 5_000 - 90 + 300, "limit": 1_000},
        {"tenant": "globex", "model": "m", "tokens": 11 + 13 + 40, "limit": 1_000},
        {"tenant": "globex", "model": "other", "tokens": 700, "limit": 1_000}]
    # collect() (the SQLAlchemy path) and the command's way agree, up to the heartbeats' ages.
    command = StatusCommand(busy_db.url)
    try:
        fast = command.collect(interval=INTERVAL, max_enqueued_tokens=1_000)
        assert command.fast
    finally:
        command.close()
    slow = collect(busy_db, interval=INTERVAL, max_enqueued_tokens=1_000)
    for r in (fast, slow):
        assert abs(r.pop("read_at") - time.time()) < 60  # when the database was read
        for w in r["workers"]:
            w.pop("heartbeat_age_s")
        for b in r["active_batches"]:
            b.pop("estimated_completion_at")
    assert fast == slow


class TracedReader(StatusReader):
    """Counts its connections and traces each one's protocol messages after connecting."""

    def __init__(self, url: str, trace: Any) -> None:
        super().__init__(url)
        self.trace = trace
        self.num_connections = 0

    def connect(self) -> psycopg.Connection[Any]:
        conn = super().connect()
        self.num_connections += 1
        conn.pgconn.trace(self.trace.fileno())
        conn.pgconn.set_trace_flags(pq.Trace.SUPPRESS_TIMESTAMPS | pq.Trace.REGRESS_MODE)
        return conn


def test_one_connection_and_one_round_trip_and_no_engine(busy_db, monkeypatch):
    def no_engine(url: str, **kwargs: Any) -> Any:
        raise AssertionError("the fast path opened a SQLAlchemy engine")

    monkeypatch.setattr("cli.service_commands.open_database", no_engine)
    with tempfile.TemporaryFile("w+") as trace:
        command = StatusCommand(busy_db.url)
        reader = command._reader = TracedReader(busy_db.url, trace)
        command.collect(interval=INTERVAL)
        assert command.fast and reader.num_connections == 1
        trace.seek(0)
        messages = [line.split("\t") for line in trace.read().splitlines()]
    sent = [m[2].split(" ")[0] for m in messages if m[0] == "F"]
    received = [m[2].split(" ")[0] for m in messages if m[0] == "B"]
    # One Sync for everything, answered by one ReadyForQuery: the client waited once.
    assert sent.count("Sync") == 1 and received.count("ReadyForQuery") == 1, messages
    assert sent.count("Execute") == 5  # the schema's revision and the four reads
    assert "Terminate" in sent


def test_a_schema_not_at_head_falls_back_to_today_s_message(pg_url):
    before = ScriptDirectory.from_config(alembic_config("")).get_revision(head()).down_revision
    db = Database(pg_url)
    upgrade(db, before)
    db.dispose()
    command = StatusCommand(pg_url)
    with pytest.raises(Refused) as refused:
        command.collect(interval=INTERVAL)
    assert not command.fast
    assert str(refused.value) == (f"database schema at {before}, needs {head()}: "
                                  "run `boxcar db upgrade`")


def test_a_database_it_cannot_reach_falls_back_to_today_s_message():
    command = StatusCommand("postgresql+psycopg://nobody@127.0.0.1:1/none")
    with pytest.raises(Refused) as refused:
        command.collect(interval=INTERVAL)
    assert str(refused.value).startswith(
        "cannot use the database postgresql+psycopg://nobody@127.0.0.1:1/none: ")


def test_the_command_prints_the_fast_path_s_report(busy_db):
    env = {**os.environ, "PYTHONPATH": REPO, "BOXCAR_DATABASE_URL": busy_db.url,
           "BOXCAR_WORKER_METRICS_INTERVAL": str(INTERVAL)}
    done = subprocess.run([sys.executable, "-m", "cli.main", "status", "--json"], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    printed = json.loads(done.stdout)
    expected = collect(busy_db, interval=INTERVAL)
    assert printed.keys() == expected.keys()
    assert (printed["batches"], printed["enqueued_tokens"]) == (
        expected["batches"], expected["enqueued_tokens"])



def test_the_code_s_head_read_without_alembic_is_alembic_s():
    assert code_head() == head()
