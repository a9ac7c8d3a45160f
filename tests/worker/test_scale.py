"""The control plane at scale: claims that skip each other's shards, batch counters that equal
the lines, one finalize per batch, status reads that never touch the lines, and the claim
counters the API's /metrics aggregates."""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager

from sqlalchemy import event, select, text

from api.poll_reads import FIRST_PAGE_STATEMENT, POLL_STATEMENT, Compiled
from engine.testing.fake_engine import FakeEngine
from service import counters
from service.models import LINE_COMPLETED, LINE_FAILED, BatchCounter, RequestLine, Shard
from tests.conftest_services import chat_line
from worker import claims, lease_keeper
from worker import finalize as finalize_module
from worker.items import LineResult, LineWork
from worker.lease_keeper import LeaseKeeper
from worker.prepare import prepare_batch
from worker.result_writer import write_results


def prepared(stack, lines, *, shard_size: int = 4) -> str:
    batch = stack.create_batch(lines)
    assert prepare_batch(stack.ctx.db, stack.ctx.storage, batch["id"], worker_id="prep",
                         shard_size=shard_size)
    return batch["id"]


def shard_ids(stack, batch_id: str) -> list[str]:
    with stack.ctx.db.read_session() as session:
        return sorted(session.scalars(select(Shard.id).where(Shard.batch_id == batch_id)).all())


def test_skip_locked_claims_of_two_sessions_are_disjoint(make_stack, pg_url):
    """Two workers claim from the same candidates at once: the second skips the rows the first
    holds (it would wait, and fail on lock_timeout, without SKIP LOCKED) and takes others."""
    stack = make_stack(pg_url)
    batch_id = prepared(stack, [chat_line(f"c{i}", f"line {i}") for i in range(32)])
    candidates = shard_ids(stack, batch_id)
    assert len(candidates) == 8
    db = stack.ctx.db
    with db.session() as first:
        won_first = claims.claim_shards(first, candidates, worker_id="w1", lease_seconds=30,
                                        max_bulk=4, max_jobs=0)
        with db.session() as second:  # the first has not committed: its rows are locked
            second.execute(text("SET LOCAL lock_timeout = '2s'"))
            won_second = claims.claim_shards(second, candidates, worker_id="w2",
                                             lease_seconds=30, max_bulk=8, max_jobs=0)
    first_ids, second_ids = {c.id for c in won_first}, {c.id for c in won_second}
    assert len(first_ids) == 4 and len(second_ids) == 4
    assert first_ids.isdisjoint(second_ids) and first_ids | second_ids == set(candidates)
    with db.read_session() as session:
        owners = dict(session.execute(select(Shard.id, Shard.lease_owner)).all())
        statuses = set(session.scalars(select(RequestLine.status)).all())
    assert {owners[s] for s in first_ids} == {"w1"} and {owners[s] for s in second_ids} == {"w2"}
    assert statuses == {"pending"}  # the claim writes the shard, not its lines


def test_claims_lost_to_another_worker_are_not_retaken(make_stack, any_db_url):
    stack = make_stack(any_db_url)
    batch_id = prepared(stack, [chat_line(f"c{i}", f"line {i}") for i in range(8)])
    candidates = shard_ids(stack, batch_id)
    with stack.ctx.db.session() as session:
        assert len(claims.claim_shards(session, candidates, worker_id="w1", lease_seconds=30,
                                       max_bulk=8, max_jobs=0)) == 2
    with stack.ctx.db.session() as session:
        assert claims.claim_shards(session, candidates, worker_id="w2", lease_seconds=30,
                                   max_bulk=8, max_jobs=0) == []


def test_a_claim_that_lost_its_candidates_fills_from_the_queue(make_stack, any_db_url):
    """Two workers read the same candidates; the second claims after the first took them. With
    ``fill`` its statement takes the next claimable shards in queue order instead of coming
    back empty (an attempt lost); without, empty; on a dry queue, empty either way."""
    stack = make_stack(any_db_url)
    batch_id = prepared(stack, [chat_line(f"c{i}", f"line {i}") for i in range(24)])
    order = shard_ids(stack, batch_id)  # 6 shards, created in queue order

    def claim(worker: str, wanted: list[str], max_bulk: int, fill: bool = True) -> list[str]:
        with stack.ctx.db.session() as session:
            return [c.id for c in claims.claim_shards(
                session, wanted, worker_id=worker, lease_seconds=30, max_bulk=max_bulk,
                max_jobs=0, fill=fill)]

    candidates = order[:2]  # what both workers read
    assert set(claim("w1", candidates, 2, fill=False)) == set(candidates)
    assert claim("w2", candidates, 2, fill=False) == []
    second = claim("w2", candidates, 2)
    assert len(second) == 2 and not set(second) & set(candidates)
    third = claim("w3", [], 1)  # no candidate named: the queue's next one
    assert len(third) == 1 and not set(third) & set(candidates + second)
    last = claim("w4", candidates, 4)
    assert set(last) == set(order) - set(candidates + second + third)
    assert claim("w5", candidates, 2) == []  # every shard is held: nothing to fill from


def test_a_dry_queue_runs_no_claim_statement(make_stack, any_db_url):
    """An attempt is a claim statement that ran: a worker that finds no candidate runs none
    and counts none."""
    stack = make_stack(any_db_url)
    worker = stack.add_worker(FakeEngine())
    batch = stack.create_batch([chat_line(f"d{i}", f"line {i}") for i in range(8)])
    stack.wait_status(batch["id"], "completed", timeout=30)
    before = worker.recorder.snapshot()["counters"]
    statements: list[str] = []

    def record(conn, cursor, statement, parameters, context, executemany):
        statements.append(statement)

    event.listen(stack.ctx.db.engine, "before_cursor_execute", record)
    try:
        for _ in range(3):
            assert worker.leases.claim_some() == 0
    finally:
        event.remove(stack.ctx.db.engine, "before_cursor_execute", record)
    after = worker.recorder.snapshot()["counters"]
    assert (after["shard_claim_attempts"], after["shard_claims"]) == (
        before["shard_claim_attempts"], before["shard_claims"])
    # (The keeper's own thread may reap meanwhile: an UPDATE of shards that claims nothing.)
    assert not [s for s in statements if "FOR UPDATE" in s
                or (s.lstrip().startswith("UPDATE shards") and "attempts" in s)]


def _work(line: RequestLine) -> LineWork:
    return LineWork(line.pk, line.shard_id, line.tenant_id, line.batch_id, None, line.endpoint,
                    line.body or {})


def test_counters_equal_the_lines_after_failures_and_a_redelivery(make_stack, any_db_url):
    stack = make_stack(any_db_url)
    lines = [chat_line(f"r{i}", f"line {i}") for i in range(6)]
    lines.append(chat_line("r0", "a repeated custom_id"))  # fails at prepare, keeps its id
    batch_id = prepared(stack, lines)
    with stack.ctx.db.read_session() as session:
        rows = session.scalars(select(RequestLine).where(RequestLine.status == "pending")
                               .order_by(RequestLine.pk)).all()
        repeated = session.scalars(select(RequestLine).where(RequestLine.line_no == 7)).one()
    assert (repeated.custom_id, repeated.status) == ("r0", LINE_FAILED)
    results = [
        LineResult(_work(row), LINE_COMPLETED, response={"n": i}, prompt_tokens=10 + i,
                   completion_tokens=3, cached_tokens=4) if i % 3 else
        LineResult(_work(row), LINE_FAILED, error={"code": "x", "message": "m"})
        for i, row in enumerate(rows[:5])
    ]
    with stack.ctx.db.session() as session:
        closed = write_results(session, results, worker_id="w1")
    assert closed == {batch_id}
    # The broker redelivers: another worker ran the same lines and writes them again.
    with stack.ctx.db.session() as session:
        assert write_results(session, results[::-1], worker_id="w2") == set()
    with stack.ctx.db.read_session() as session:
        live = counters.sums(session, [batch_id])[batch_id]
        truth = counters.from_lines(session, batch_id)
        slots = session.scalars(select(BatchCounter.slot)
                                .where(BatchCounter.batch_id == batch_id)).all()
    assert live == truth
    assert (truth.num_open, truth.num_completed, truth.num_failed) == (1, 3, 3)
    assert truth.input_tokens == 11 + 12 + 14 and truth.cached_tokens == 12
    assert set(slots) == {0, counters.slot_of("w1")}  # w2 wrote nothing
    body = stack.batch(batch_id)
    assert body["request_counts"] == {"total": 7, "completed": 3, "failed": 3}
    assert body["usage"]["input_tokens"] == 37 and body["usage"]["output_tokens"] == 9


def test_a_batch_runs_to_counters_that_match_and_is_finalized_once(make_stack, any_db_url,
                                                                    monkeypatch):
    tries, leases = [], []
    real = finalize_module.claim_batch_lease

    def counted(session, batch_id, **kw):
        tries.append(batch_id)
        won = real(session, batch_id, **kw)
        if won:
            leases.append(batch_id)
        return won

    monkeypatch.setattr(finalize_module, "claim_batch_lease", counted)
    stack = make_stack(any_db_url)
    lines = [chat_line(f"f{i}", f"line {i}", max_tokens=2) for i in range(30)]
    lines[4] = chat_line("f4", "TOO_LONG")  # fails in the engine's pipeline
    lines.append("not json")  # fails at prepare, without a custom_id
    for _ in range(2):
        stack.add_worker(FakeEngine(max_num_seqs=4))
    batch = stack.create_batch(lines)
    done = stack.wait_status(batch["id"], "completed", timeout=60)
    assert done["request_counts"] == {"total": 31, "completed": 29, "failed": 2}
    # One finalize: not an attempt per finished shard (8 shards). Both workers' writers may
    # see the batch drain at the same moment; the lease lets one of them in.
    assert leases == [batch["id"]] and len(tries) <= 2
    with stack.ctx.db.read_session() as session:
        assert counters.sums(session, [batch["id"]])[batch["id"]] == counters.from_lines(
            session, batch["id"])
    errors = stack.lines_of(done["error_file_id"])
    assert [e["custom_id"] for e in errors] == ["f4"]


@contextmanager
def statements(engine):
    seen: list[str] = []

    def record(conn, cursor, statement, parameters, context, executemany):
        seen.append(statement)

    event.listen(engine, "before_cursor_execute", record)
    try:
        yield seen
    finally:
        event.remove(engine, "before_cursor_execute", record)


def test_status_reads_no_lines(make_stack, any_db_url, monkeypatch):
    """Retrieving or listing live batches reads their counters, never their lines (the ETA,
    ``api.eta``, is left out here: it keeps its own cached read)."""
    stack = make_stack(any_db_url)
    batch_ids = [prepared(stack, [chat_line(f"s{i}", f"line {i}") for i in range(40)])
                 for _ in range(3)]
    monkeypatch.setattr(stack.ctx.etas, "get", lambda session, batch_id=None: {})
    with statements(stack.ctx.db.read_engine) as seen:
        one = stack.batch(batch_ids[0])
        listed = stack.client.get("/v1/batches").json()
    assert one["status"] == "in_progress" and one["request_counts"]["total"] == 40
    assert [b["id"] for b in listed["data"]] == batch_ids[::-1]
    if stack.ctx.poll_reader is not None:  # PostgreSQL: both are psycopg's own, on the loop
        seen += [Compiled(POLL_STATEMENT).sql, Compiled(FIRST_PAGE_STATEMENT).sql]
    assert seen and not [s for s in seen if "request_lines" in s]


def test_the_claim_counters_reach_the_apis_metrics(make_stack, sqlite_url):
    stack = make_stack(sqlite_url)
    worker = stack.add_worker(FakeEngine())
    batch = stack.create_batch([chat_line(f"m{i}", f"line {i}", max_tokens=2) for i in range(12)])
    stack.wait_status(batch["id"], "completed", timeout=30)
    snapshot = worker.recorder.snapshot()["counters"]
    assert snapshot["shard_claims"] == 3
    assert snapshot["shard_claim_attempts"] >= snapshot["shard_claims"]
    worker.publisher.publish()
    text_ = stack.client.get("/metrics").text
    assert f'boxcar_shard_claims_total{{worker="{worker.worker_id}"}} 3.0' in text_
    assert "boxcar_shard_claim_attempts_total{" in text_


def test_prepare_writes_every_field_of_valid_and_failed_lines(make_stack, any_db_url):
    """PostgreSQL inserts the lines with COPY, SQLite with INSERTs: the same rows either way,
    pks in input order, JSON columns that read back as written."""
    stack = make_stack(any_db_url)
    lines = [chat_line("a", "first prompt", max_tokens=3), "not json",
             chat_line("b", "second \u00e9 \"quoted\"\n tab\t", max_tokens=5),
             chat_line("a", "repeats a's custom_id")]
    batch_id = prepared(stack, lines, shard_size=1)
    with stack.ctx.db.read_session() as session:
        rows = session.scalars(select(RequestLine).order_by(RequestLine.pk)).all()
    assert [r.line_no for r in rows] == [1, 2, 3, 4]
    assert [r.status for r in rows] == ["pending", "failed", "pending", "failed"]
    a, bad, b, repeated = rows
    assert a.body["messages"][0]["content"] == "first prompt"
    assert b.body["messages"][0]["content"] == "second \u00e9 \"quoted\"\n tab\t"
    assert b.engine_fields is not None and a.engine_fields is not None
    assert (a.custom_id, b.custom_id, repeated.custom_id) == ("a", "b", "a")
    assert bad.error["code"] and repeated.error["code"] and a.error is None
    assert bad.finished_at is not None and a.finished_at is None
    assert {a.shard_id, b.shard_id} == {f"{batch_id}:0", f"{batch_id}:1"}
    assert sorted([a.position, b.position]) == [0, 1]
    assert bad.shard_id is None and bad.position is None
    with stack.ctx.db.read_session() as session:
        assert counters.sums(session, [batch_id])[batch_id].num_open == 2


def test_an_idle_workers_claim_poll_is_one_transaction_with_the_reap(make_stack, any_db_url):
    """Idle commits: the reap shares the claim poll's transaction (it has none of its own), and
    the lease check of a worker holding nothing touches the database not at all."""
    stack = make_stack(any_db_url)
    worker = stack.add_worker(FakeEngine())
    me = threading.get_ident()
    seen: list[str] = []  # this thread's statements and commits (the worker's run beside it)

    def statement(conn, cursor, text_, parameters, context, executemany):
        if threading.get_ident() == me:
            seen.append(text_.split()[0].upper())

    def commit(conn):
        if threading.get_ident() == me:
            seen.append("COMMIT")

    engines = {stack.ctx.db.engine, stack.ctx.db.read_engine}
    for engine in engines:
        event.listen(engine, "before_cursor_execute", statement)
        event.listen(engine, "commit", commit)
    try:
        worker.leases._last_reap = time.monotonic() - 3600  # the reap is due
        assert worker.leases.claim_some() == 0
        reap_poll = list(seen)
        seen.clear()
        worker.leases.check()
        check = list(seen)
    finally:
        for engine in engines:
            event.remove(engine, "before_cursor_execute", statement)
            event.remove(engine, "commit", commit)
    statements = [s for s in reap_poll if s not in ("BEGIN", "COMMIT")]  # SQLite's BEGIN
    assert reap_poll.count("COMMIT") == 1
    assert statements[0] == "UPDATE" and "SELECT" in statements  # the reap, then the read
    assert check == []


def test_result_writes_are_hot_updates_on_postgresql(make_stack, pg_url):
    """A result write changes no indexed column and finds room in its line's page (fillfactor,
    0006_hot_results): PostgreSQL counts every one as a HOT update, so results write no index
    entries and do not extend the table. 200 lines fill several pages, as a real batch does."""
    stack = make_stack(pg_url)
    batch_id = prepared(stack, [chat_line(f"r{i}", f"line {i} " + "x" * 200) for i in range(200)],
                        shard_size=64)
    with stack.ctx.db.read_session() as session:
        rows = session.scalars(select(RequestLine).where(RequestLine.batch_id == batch_id)
                               .order_by(RequestLine.pk)).all()
    results = [LineResult(_work(row), LINE_COMPLETED if i % 5 else LINE_FAILED,
                          response={"choices": [{"text": "y" * 300}]} if i % 5 else None,
                          error=None if i % 5 else {"code": "x", "message": "m"},
                          prompt_tokens=10, completion_tokens=3)
               for i, row in enumerate(rows)]
    with stack.ctx.db.session() as session:
        assert write_results(session, results, worker_id="w1") == {batch_id}
        # This transaction's own counts (pg_stat_get_xact_*): no wait for the stats collector.
        updated, hot = session.execute(text(
            "SELECT pg_stat_get_xact_tuples_updated('request_lines'::regclass), "
            "pg_stat_get_xact_tuples_hot_updated('request_lines'::regclass)")).one()
    assert (updated, hot) == (200, 200)


def _keeper(stack, worker) -> LeaseKeeper:
    """A lease keeper of the worker's shards that no thread runs: the test turns its rounds."""
    keeper = LeaseKeeper(worker.db, stack.settings, worker_id="k", held=worker.held,
                         drainer=worker.drainer, announce_shards=lambda ids: None,
                         on_batches_touched=lambda ids: None)
    keeper._stop = threading.Event()
    keeper._last_announce = keeper._last_check = time.monotonic()  # only the claim part runs
    return keeper


def test_a_hungry_engine_does_not_wake_a_claim_loop_that_found_the_queue_dry(make_stack,
                                                                            sqlite_url):
    """The drain loop asks for more at every step that leaves its queue low; after a claim that
    found nothing, those asks wait for the next poll, while a broker message still wakes the
    loop at once."""
    stack = make_stack(sqlite_url)
    keeper = _keeper(stack, stack.add_worker(FakeEngine()))
    assert keeper.claim_some() == 0  # nothing queued: dry
    keeper._wake.clear()
    keeper.wake_hungry()
    assert not keeper._wake.is_set()
    keeper.wake()  # a new shard's message
    assert keeper._wake.is_set()
    keeper._wake.clear()
    keeper._dry_until = 0.0  # a poll interval later
    keeper.wake_hungry()
    assert keeper._wake.is_set()


def test_a_busy_worker_polls_for_jobs_less_often_unless_asked(make_stack, sqlite_url):
    """With no room for bulk work, a round claims only when woken (a job's or a shard's
    message) or BUSY_CLAIM_POLL_S after its last claim poll; with room, every round does."""
    stack = make_stack(sqlite_url)
    keeper = _keeper(stack, stack.add_worker(FakeEngine()))
    polls: list[bool] = []
    keeper.claim_some = lambda: polls.append(True) and False
    room = [False]
    keeper.has_room = lambda *, is_job: room[0]
    keeper.run_round()  # the first round claims
    keeper.run_round()
    assert len(polls) == 1
    keeper.wake()
    keeper.run_round()
    assert len(polls) == 2
    keeper._last_claim_poll -= lease_keeper.BUSY_CLAIM_POLL_S
    keeper.run_round()
    assert len(polls) == 3
    room[0] = True
    keeper.run_round()
    keeper.run_round()
    assert len(polls) == 5


def test_a_claim_takes_only_the_shards_that_fill_the_engines_queue(make_stack, sqlite_url,
                                                                    monkeypatch):
    """A worker asks for as many bulk shards as bring its engine's queue up to its low water
    (at least one, at most BULK_PER_CLAIM): lines held beyond that are lines no idle worker can
    run at a batch's end."""
    stack = make_stack(sqlite_url)
    keeper = _keeper(stack, stack.add_worker(FakeEngine()))
    shard_size = stack.settings.shard_size
    asked: list[int] = []

    test_thread = threading.current_thread()

    def find_candidates(session, *, now, max_bulk, max_jobs, model=None, spread=0):
        if threading.current_thread() is test_thread:  # not the stack worker's own claim loop
            asked.append(max_bulk // lease_keeper.CANDIDATES_PER_WANT)
        return []

    monkeypatch.setattr(claims, "find_candidates", find_candidates)
    for low_water, queued in ((shard_size, 0), (shard_size, shard_size - 1),
                              (2 * shard_size, 0), (2 * shard_size, shard_size + 1),
                              (5 * shard_size, 0)):
        keeper.drainer = type("Drainer", (), {"low_water": low_water, "num_queued": queued})()
        keeper.claim_some()
    assert asked == [1, 1, 2, 1, lease_keeper.BULK_PER_CLAIM]
