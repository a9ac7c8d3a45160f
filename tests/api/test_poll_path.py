"""A live batch's status poll on PostgreSQL: one statement (the batch with its counters' sums)
outside a transaction, no ping of a connection used a moment ago, and an ETA it never waits
for once there is one; the pool still pings, and replaces, a connection that sat idle."""

from __future__ import annotations

import threading
import uuid
from contextlib import contextmanager

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import create_engine, event, text, update

import api.eta
from api.app import build_context, create_app
from api.eta import BatchEta, EtaCache
from api.poll_reads import POLL_STATEMENT, AsyncReader
from api.poll_snapshots import PollSnapshots
from service.counters import CounterDelta, add
from service.db import ping_when_idle
from service.models import IN_PROGRESS, Batch
from service.settings import Settings
from tests.api.conftest import RecordingQueue
from tests.api.test_batches import chat_line, make_batch
from tests.conftest_services import make_key, migrated


@pytest.fixture
def pg_client(pg_url, tmp_path):
    # Every poll reads the database here (no snapshots: tests/api/test_poll_snapshots.py).
    settings = Settings(database_url=pg_url, storage_url=str(tmp_path / "storage"),
                        shard_size=4, completion_windows=["24h"], api_poll_snapshot_seconds=0)
    ctx = build_context(settings, db=migrated(pg_url), queue=RecordingQueue())
    key = make_key(ctx.db, "acme")
    with TestClient(create_app(context=ctx), headers={"Authorization": f"Bearer {key}"}) as c:
        yield c, ctx
    ctx.db.dispose()


@pytest.mark.parametrize("path", ["event loop", "thread"])
def test_a_live_batch_poll_is_one_statement_outside_a_transaction(pg_client, path):
    client, ctx = pg_client
    if path == "thread":  # as on SQLite
        ctx.poll_reader = ctx.polls = None
    batch = make_batch(client, [chat_line(f"l{i}", "x") for i in range(6)]).json()
    with ctx.db.session() as session:
        session.execute(update(Batch).where(Batch.id == batch["id"])
                        .values(status=IN_PROGRESS, num_total=6))
        add(session, {batch["id"]: CounterDelta(num_open=6)}, slot=0)
    with ctx.db.session() as session:  # two workers' slots
        add(session, {batch["id"]: CounterDelta.closed("completed", prompt_tokens=5)}, slot=7)
        add(session, {batch["id"]: CounterDelta.closed("failed")}, slot=9)
    client.get(f"/v1/batches/{batch['id']}")  # the key checked and the ETA computed once
    in_transaction: list[bool] = []

    @event.listens_for(ctx.db.engine, "before_cursor_execute")
    def _seen(conn, cursor, statement, parameters, context, executemany) -> None:
        in_transaction.append(not conn.connection.dbapi_connection.autocommit)

    response = client.get(f"/v1/batches/{batch['id']}")
    event.remove(ctx.db.engine, "before_cursor_execute", _seen)
    body = response.json()
    assert body["status"] == "in_progress"
    assert body["request_counts"] == {"total": 6, "completed": 1, "failed": 1}
    assert body["usage"]["input_tokens"] == 5
    assert 'desc="1 statements"' in response.headers["server-timing"]
    # On the loop the statement is psycopg's own (autocommit): none of SQLAlchemy's.
    assert in_transaction == ([] if path == "event loop" else [False])
    assert client.get("/v1/batches/batch_nope").status_code == 404
    listed = client.get("/v1/batches").json()["data"]
    assert listed[0]["request_counts"] == body["request_counts"]
    with ctx.db.session() as session:  # a finished batch: its stored totals
        session.execute(update(Batch).where(Batch.id == batch["id"])
                        .values(status="completed", num_completed=5, num_failed=1))
    done = client.get(f"/v1/batches/{batch['id']}").json()
    assert done["request_counts"] == {"total": 6, "completed": 5, "failed": 1}


def test_the_loop_reader_replaces_a_connection_the_server_dropped(pg_client):
    client, ctx = pg_client
    now = [0.0]
    name = f"boxcar-test-{uuid.uuid4().hex[:8]}"
    ctx.poll_reader = AsyncReader(ctx.db.url, POLL_STATEMENT, clock=lambda: now[0],
                                  application_name=name)
    ctx.polls = PollSnapshots(ctx.poll_reader, max_age=0)
    batch = make_batch(client).json()
    assert client.get(f"/v1/batches/{batch['id']}").status_code == 200
    with create_engine(ctx.db.url).connect() as other:  # the server drops the reader's
        dropped = other.execute(text("SELECT count(pg_terminate_backend(pid)) FROM "
                                     "pg_stat_activity WHERE application_name = :name"),
                                {"name": name}).scalar()
    assert dropped == 1
    now[0] = 5.0  # idle past the ping's threshold: pinged, found dead, replaced
    assert client.get(f"/v1/batches/{batch['id']}").status_code == 200


def test_the_pool_pings_only_connections_that_sat_idle(pg_url):
    now = [0.0]
    engine = create_engine(pg_url, pool_size=1, max_overflow=0)
    ping_when_idle(engine, 1.0, clock=lambda: now[0])
    pings: list[float] = []
    real_ping = engine.dialect.do_ping

    def counted(dbapi_conn) -> bool:
        pings.append(now[0])
        return real_ping(dbapi_conn)

    engine.dialect.do_ping = counted  # type: ignore[method-assign]
    try:
        with engine.connect() as conn:  # fresh: no ping
            pid = conn.execute(text("SELECT pg_backend_pid()")).scalar()
        now[0] = 0.5
        with engine.connect() as conn:  # used half a second ago: no ping
            conn.execute(text("SELECT 1"))
        assert pings == []
        now[0] = 2.0
        with engine.connect() as conn:  # idle past a second: pinged, and alive
            assert conn.execute(text("SELECT pg_backend_pid()")).scalar() == pid
        assert pings == [2.0]
        with create_engine(pg_url).connect() as other:  # the server drops it meanwhile
            other.execute(text("SELECT pg_terminate_backend(:pid)"), {"pid": pid})
        now[0] = 4.0
        with engine.connect() as conn:  # the ping finds it gone: a new one, no error
            assert conn.execute(text("SELECT pg_backend_pid()")).scalar() != pid
        assert pings == [2.0, 4.0]
    finally:
        engine.dispose()


def test_a_poll_gets_the_old_etas_while_one_thread_computes_the_next(monkeypatch):
    now = [0.0]
    computed: list[str] = []
    gate = threading.Event()

    def fake_estimate(session, *, worker_metrics_interval, now=None):
        if session == "refresh":
            gate.wait(10)
        computed.append(session)
        return {"b": BatchEta(float(len(computed)), None, 0.0)}

    @contextmanager
    def refresh_session():
        yield "refresh"

    monkeypatch.setattr(api.eta, "estimate", fake_estimate)
    cache = EtaCache(2.0, ttl=2.0, clock=lambda: now[0], refresh_session=refresh_session,
                     max_stale=10.0)
    assert cache.get_nowait() is None  # none yet: the event loop must go to a thread
    assert cache.get("poll")["b"].estimated_completion_at == 1.0  # ... which computes it
    assert cache.get_nowait() is cache.get("poll")
    now[0] = 3.0  # past the TTL: the old value at once, the next computed on the side
    assert cache.get("poll")["b"].estimated_completion_at == 1.0
    assert cache.get("poll")["b"].estimated_completion_at == 1.0  # one refresh, not two
    gate.set()
    for _ in range(200):
        if cache.get("poll")["b"].estimated_completion_at == 2.0:
            break
        threading.Event().wait(0.01)
    assert computed == ["poll", "refresh"]
    now[0] = 20.0  # older than max_stale (a quiet spell): the poll computes it itself
    assert cache.get_nowait() is None
    assert cache.get("poll")["b"].estimated_completion_at == 3.0


def test_boxcar_status_counts_unfinished_lines_from_their_counters(client, ctx):
    from api.status import collect

    batch = make_batch(client, [chat_line(f"l{i}", "x") for i in range(4)]).json()
    with ctx.db.session() as session:
        session.execute(update(Batch).where(Batch.id == batch["id"])
                        .values(status=IN_PROGRESS, num_total=4))
        add(session, {batch["id"]: CounterDelta(num_open=4)}, slot=0)
        add(session, {batch["id"]: CounterDelta.closed("completed")}, slot=3)
    statements: list[str] = []

    @event.listens_for(ctx.db.read_engine, "before_cursor_execute")
    def _seen(conn, cursor, statement, parameters, context, executemany) -> None:
        statements.append(statement)

    report = collect(ctx.db, interval=2.0)
    event.remove(ctx.db.read_engine, "before_cursor_execute", _seen)
    assert report["lines"] == {"open": 3, "completed": 1, "failed": 0}
    assert any("FROM batch_counters" in s for s in statements)
    assert not [s for s in statements if "FROM request_lines" in s]  # no line is read


def test_a_poll_of_a_batch_the_value_lacks_starts_the_refresh_after_soon(monkeypatch):
    """On the event loop's path too: a value without the polled batch (made before it went in
    progress) is served until it is ``soon`` seconds old, then refreshed on the side; polls
    that name no batch, or one it holds, keep it for the TTL."""
    now = [0.0]
    computed: list[str] = []

    def fake_estimate(session, *, worker_metrics_interval, now=None):
        computed.append(session)
        return {"held": BatchEta(1.0, None, 0.0)} if len(computed) == 1 else {
            "held": BatchEta(1.0, None, 0.0), "new": BatchEta(2.0, None, 0.0)}

    @contextmanager
    def refresh_session():
        yield "refresh"

    monkeypatch.setattr(api.eta, "estimate", fake_estimate)
    cache = EtaCache(2.0, ttl=2.0, clock=lambda: now[0], refresh_session=refresh_session,
                     soon=0.25)
    assert "new" not in cache.get("poll")
    now[0] = 0.5
    assert cache.get_nowait() is not None and cache.get_nowait("held") is not None
    assert computed == ["poll"]  # held for the TTL
    assert "new" not in cache.get_nowait("new")  # the old value at once, the next on the side
    for _ in range(200):
        if "new" in cache.get_nowait("new"):
            break
        threading.Event().wait(0.01)
    assert computed == ["poll", "refresh"]


def test_the_first_page_on_the_loop_equals_the_thread_path(pg_client):
    client, ctx = pg_client
    ids = [make_batch(client, [chat_line(f"l{i}", "x") for i in range(4)]).json()["id"]
           for _ in range(3)]
    with ctx.db.session() as session:  # one live with counts, one finished, one validating
        session.execute(update(Batch).where(Batch.id == ids[0])
                        .values(status=IN_PROGRESS, num_total=4))
        add(session, {ids[0]: CounterDelta(num_open=4)}, slot=0)
        add(session, {ids[0]: CounterDelta.closed("completed", prompt_tokens=2)}, slot=3)
        session.execute(update(Batch).where(Batch.id == ids[1])
                        .values(status="completed", num_total=4, num_completed=4))
    other = make_key(ctx.db, f"other-{uuid.uuid4().hex[:6]}")  # another tenant's batch
    own = client.headers["Authorization"]
    client.headers["Authorization"] = f"Bearer {other}"
    make_batch(client, [chat_line("o", "x")])
    client.headers["Authorization"] = own
    pages = {}
    reader = ctx.poll_reader
    for path in ("event loop", "thread"):
        ctx.poll_reader = reader if path == "event loop" else None
        pages[path] = [client.get("/v1/batches", params={"limit": n}).json() for n in (2, 3, 20)]
    ctx.poll_reader = reader
    assert pages["event loop"] == pages["thread"]
    two, three, twenty = pages["event loop"]
    assert [b["id"] for b in twenty["data"]] == ids[::-1]  # newest first, this tenant's only
    assert (two["has_more"], three["has_more"], twenty["has_more"]) == (True, False, False)
    live = next(b for b in twenty["data"] if b["id"] == ids[0])
    assert live["request_counts"] == {"total": 4, "completed": 1, "failed": 0}
