"""Leases: a dead worker's shards are taken over within seconds of its lease running out, a
clean shutdown hands them back at once, and no line is ever answered twice."""

from __future__ import annotations

from sqlalchemy import select, update

from engine.testing.fake_engine import FakeEngine
from service.models import LINE_COMPLETED, RequestLine, Shard
from tests.conftest_services import chat_line, wait_for
from tests.openai_shapes import error_of
from worker.items import LineResult, LineWork
from worker.prepare import prepare_batch
from worker.result_writer import write_results


def ids_of(lines):
    return [line["custom_id"] for line in lines]


def test_dead_workers_shards_are_taken_over(make_stack, any_db_url):
    stack = make_stack(any_db_url)
    slow = FakeEngine(max_num_seqs=2, step_time=0.05)
    first = stack.add_worker(slow)
    batch = stack.create_batch([chat_line(f"k{i}", f"line {i}", max_tokens=3) for i in range(24)])
    wait_for(lambda: stack.batch(batch["id"])["request_counts"]["completed"] >= 2, 20, 0.02,
             "the first worker to make progress")
    first.stop(release=False)  # as good as SIGKILL: no heartbeat, no hand-back
    second = stack.add_worker(FakeEngine())
    # Taken over once the 2 s lease ran out, not after a broker timeout: the embedded queue only
    # rings, and a shard the first worker held is claimable again only when its lease has
    # expired (its second attempt, below).
    done = stack.wait_status(batch["id"], "completed", timeout=30)
    output = stack.lines_of(done["output_file_id"])
    assert sorted(ids_of(output)) == sorted(f"k{i}" for i in range(24))
    assert done["error_file_id"] is None and done["request_counts"]["failed"] == 0
    with stack.ctx.db.read_session() as session:
        workers = set(session.scalars(select(RequestLine.worker_id)).all())
        attempts = session.scalars(select(Shard.attempts)).all()
    assert workers == {first.worker_id, second.worker_id}
    assert max(attempts) >= 2


def test_clean_shutdown_hands_shards_back_at_once(make_stack, sqlite_url):
    stack = make_stack(sqlite_url, lease_seconds=30.0)
    first = stack.add_worker(FakeEngine(max_num_seqs=1, step_time=0.05))
    batch = stack.create_batch([chat_line(f"s{i}", f"line {i}", max_tokens=3) for i in range(12)])
    wait_for(lambda: stack.batch(batch["id"])["request_counts"]["completed"] >= 1, 20, 0.02,
             "progress")
    first.stop()
    stack.add_worker(FakeEngine())
    done = stack.wait_status(batch["id"], "completed", timeout=10)  # well inside the 30 s lease
    assert sorted(ids_of(stack.lines_of(done["output_file_id"]))) == sorted(
        f"s{i}" for i in range(12))


def test_a_line_is_answered_once_whoever_writes_last(make_stack, any_db_url):
    stack = make_stack(any_db_url)
    batch = stack.create_batch([chat_line("only", "x")])
    prepare_batch(stack.ctx.db, stack.ctx.storage, batch["id"], worker_id="w0", shard_size=4)
    with stack.ctx.db.read_session() as session:
        line = session.scalars(select(RequestLine)).one()
    work = LineWork(line.pk, line.shard_id, line.tenant_id, line.batch_id, None,
                    line.endpoint, line.body)
    for worker, text in (("w1", "first"), ("w2", "second")):
        with stack.ctx.db.session() as session:
            write_results(session, [LineResult(work, LINE_COMPLETED, response={"text": text},
                                               request_id=worker)], worker_id=worker)
    with stack.ctx.db.read_session() as session:
        line = session.scalars(select(RequestLine)).one()
    assert (line.response, line.worker_id) == ({"text": "first"}, "w1")


def test_a_shard_that_keeps_killing_workers_fails_its_lines(make_stack, sqlite_url):
    stack = make_stack(sqlite_url, max_shard_attempts=2)
    batch = stack.create_batch([chat_line(f"p{i}", "poison") for i in range(3)])
    prepare_batch(stack.ctx.db, stack.ctx.storage, batch["id"], worker_id="w0", shard_size=4)
    with stack.ctx.db.session() as session:
        session.execute(update(Shard).values(attempts=2))
    stack.add_worker(FakeEngine())
    done = stack.wait_status(batch["id"], "completed")
    errors = stack.lines_of(done["error_file_id"])
    assert sorted(ids_of(errors)) == ["p0", "p1", "p2"]
    assert {error_of(e)["code"] for e in errors} == {"server_error"}


def test_claim_attempts_and_wins_reach_the_api_metrics(make_stack, sqlite_url):
    stack = make_stack(sqlite_url, worker_metrics_interval=0.1)
    worker = stack.add_worker(FakeEngine())
    batch = stack.create_batch([chat_line(f"m{i}", f"line {i}") for i in range(10)])
    stack.wait_status(batch["id"], "completed")
    with stack.ctx.db.read_session() as session:
        shard_ids = session.scalars(select(Shard.id)).all()
    counters = worker.recorder.snapshot()["counters"]
    assert counters["shard_claims"] == len(shard_ids) == 3  # 10 lines in shards of 4
    attempts = counters["shard_claim_attempts"]
    statements = counters["shard_claim_statements"]
    assert attempts >= 3 and statements >= 1
    assert counters["shard_claims_lost"] == counters["shard_claim_statements_contended"] == 0
    # A shard already claimed (done) is an attempt lost, not a claim: a statement that lost a
    # wanted shard.
    assert worker.leases.claim([shard_ids[0]], max_bulk=1, max_jobs=1) == 0
    counters = worker.recorder.snapshot()["counters"]
    assert (counters["shard_claim_attempts"], counters["shard_claims"]) == (attempts + 1, 3)
    assert (counters["shard_claim_statements"], counters["shard_claims_lost"],
            counters["shard_claim_statements_contended"]) == (statements + 1, 1, 1)

    label = f'{{worker="{worker.worker_id}"}}'

    def exposed() -> str | None:
        text = stack.client.get("/metrics").text
        return text if f"boxcar_shard_claim_attempts_total{label} {attempts + 1:.1f}" in text \
            else None

    text = wait_for(exposed, 10, 0.05, "the worker's snapshot with the lost attempt")
    assert f"boxcar_shard_claims_total{label} 3.0" in text
    assert f"boxcar_shard_claims_lost_total{label} 1.0" in text


def test_a_claim_counts_the_wanted_shards_it_lost_not_those_it_never_wanted():
    from worker.claims import ClaimedShard, num_lost

    def won(*shard_ids: str) -> list[ClaimedShard]:
        return [ClaimedShard(sid, "t", "b", None, 0, 1) for sid in shard_ids]

    wanted = ["shard_a", "shard_b", "shard_c"]
    # Two wanted (max_bulk 2): a and b. b went to another worker; the fill gave c instead.
    assert num_lost(wanted, won("shard_a", "shard_c"), max_bulk=2, max_jobs=0) == 1
    assert num_lost(wanted, won("shard_a", "shard_b"), max_bulk=2, max_jobs=0) == 0
    assert num_lost(wanted, won(), max_bulk=2, max_jobs=0) == 2
    assert num_lost(wanted, won(), max_bulk=0, max_jobs=0) == 0
