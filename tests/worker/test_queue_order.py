"""The queue discipline (service.queue_order) without a model: jobs first, then earliest
deadline, then batch priority, then tenants round-robin; and what the engine is told."""

from __future__ import annotations

from engine.testing.fake_engine import FakeEngine, StepGate
from service.queue_order import (
    AT_RISK_PRIORITY,
    DEADLINE_BUCKET_S,
    EngineOrder,
    bulk_rank,
    engine_order,
)
from tests.conftest_services import chat_line
from worker.items import LineWork
from worker.line_queue import LineQueue

NOW = 1_800_000_000.0


def work(pk: int, tenant: str, *, deadline: float | None, priority: int = 0,
         job: bool = False) -> LineWork:
    return LineWork(pk, f"s{pk}", tenant, None if job else "b", "j" if job else None,
                    "/v1/completions", {}, priority, deadline)


def test_engine_order_jobs_first_then_deadline_and_priority_as_rank():
    job_low = engine_order(is_job=True, priority=1000)
    job_high = engine_order(is_job=True, priority=1005)
    assert job_high.priority < job_low.priority < AT_RISK_PRIORITY < 0
    hour = engine_order(is_job=False, priority=0, deadline=NOW + 3600)
    day = engine_order(is_job=False, priority=100, deadline=NOW + 86400)
    day_low = engine_order(is_job=False, priority=0, deadline=NOW + 86400)
    # Bulk lines share one priority (none displaces another); the rank sorts as bulk_rank.
    assert hour.priority == day.priority == day_low.priority == 0
    assert hour.rank < day.rank < day_low.rank
    assert engine_order(is_job=False, priority=0, deadline=None).rank > day_low.rank
    for a, b in ((NOW + 3600, 0), (NOW + 3600, 100), (NOW + 7200, 0), (None, 50)):
        for c, d in ((NOW + 3600, 7), (NOW + 86400, 0), (None, 0)):
            assert (bulk_rank(a, b) < bulk_rank(c, d)) == (
                engine_order(is_job=False, priority=b, deadline=a).rank
                < engine_order(is_job=False, priority=d, deadline=c).rank)
    # A deadline at risk displaces other bulk lines, never a job.
    risky = engine_order(is_job=False, priority=0, deadline=NOW + 86400, at_risk=True)
    assert risky == EngineOrder(AT_RISK_PRIORITY, day_low.rank)


def test_deadline_buckets_and_priority_rank_bulk_classes():
    edge = 3000 * DEADLINE_BUCKET_S
    # Deadlines within one bucket are equal: tenants share them instead of FIFO.
    assert bulk_rank(edge - 1, 0) == bulk_rank(edge - DEADLINE_BUCKET_S + 1, 0)
    assert bulk_rank(edge + 1, 100) > bulk_rank(edge, 0)  # an earlier deadline beats priority
    assert bulk_rank(edge, 7) < bulk_rank(edge, 0)
    assert bulk_rank(None, 100) > bulk_rank(edge, 0)


def test_line_queue_pops_by_deadline_class_then_round_robin():
    day, hour = NOW + 86400, NOW + 3600
    queue = LineQueue()
    queue.push([work(1, "a", deadline=day), work(2, "a", deadline=day),
                work(3, "b", deadline=day)], is_job=False)
    queue.push([work(4, "a", deadline=hour), work(5, "c", deadline=hour)], is_job=False)
    queue.push([work(6, "c", deadline=day, priority=7)], is_job=False)
    queue.push([work(9, "c", deadline=None, priority=1000, job=True)], is_job=True)
    assert len(queue) == 7
    order = [queue.pop().line_pk for _ in range(7)]
    # the job; the 1h class round-robin (a, c); the 24h class at priority 7; then 24h at 0 by
    # tenant round-robin (a, b, a).
    assert order == [9, 4, 5, 6, 1, 3, 2]
    assert queue.pop() is None and len(queue) == 0


def test_line_queue_remove_across_classes():
    queue = LineQueue()
    queue.push([work(1, "a", deadline=NOW), work(2, "a", deadline=NOW + 86400)], is_job=False)
    assert [w.line_pk for w in queue.remove(lambda w: w.line_pk == 1)] == [1]
    assert len(queue) == 1 and queue.pop().line_pk == 2 and queue.pop() is None


def test_a_shorter_window_overtakes_and_a_job_overtakes_both(make_stack, sqlite_url):
    stack = make_stack(sqlite_url, shard_size=4, worker_max_shards=2,
                       completion_windows=["24h", "1h"])
    gate = StepGate()  # one step at a time, the worker settled between steps
    engine = FakeEngine(max_num_seqs=2, before_step=gate.wait)
    worker = stack.add_worker(engine)
    try:
        slow = stack.create_batch([chat_line(f"d{i}", f"day {i}") for i in range(40)])
        stack.step_settled(worker, gate, lambda: stack.batch(slow["id"])["request_counts"][
            "completed"] >= 2)
        fast = stack.create_batch([chat_line(f"h{i}", f"hour {i}") for i in range(8)],
                                  completion_window="1h", priority=0)
        stack.wait_status(fast["id"], "in_progress")
        job = stack.client.post("/v1/jobs", json={"body": {"prompt": "job", "max_tokens": 3},
                                                  "priority": 4}).json()

        def job_done() -> dict | None:
            j = stack.client.get(f"/v1/jobs/{job['id']}").json()
            return j if j["status"] == "completed" else None

        stack.step_settled(worker, gate, lambda: job_done() is not None)
        job_finished = job_done()
        fast_running = stack.batch(fast["id"])["status"]
        stack.step_settled(worker, gate,
                           lambda: stack.batch(fast["id"])["status"] == "completed")
        fast_done = stack.batch(fast["id"])
        slow_completed = stack.batch(slow["id"])["request_counts"]["completed"]
    finally:
        gate.open()
    # The 1h batch overtook the 24h one: at most the two shards held when it arrived (8 lines)
    # of the 24h batch finished before it; and the job overtook both.
    assert slow_completed <= 8
    assert fast_running == "in_progress" and fast_done["status"] == "completed"
    assert job_finished["completed_at"] <= fast_done["completed_at"]
    stack.wait_status(slow["id"], "completed")
    # What the engine was told: the job most urgent, every bulk line one priority, the 1h
    # batch's lines a lower rank than the 24h batch's.
    assert sorted(set(engine.priorities.values())) == [
        engine_order(is_job=True, priority=1004).priority, 0]
    by_prompt = {rid: rank for rid, rank in engine.ranks.items()
                 if engine.priorities[rid] == 0}
    assert len(set(by_prompt.values())) == 2
