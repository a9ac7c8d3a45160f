"""LineQueue: jobs first by priority, bulk lines round-robin over tenants in shard order."""

from __future__ import annotations

from worker.items import LineWork
from worker.line_queue import LineQueue


def work(pk: int, tenant: str, *, batch: str = "b", priority: int = 0) -> LineWork:
    return LineWork(pk, f"{batch}:0", tenant, batch, None, "/v1/completions", {},
                    priority)


def test_jobs_first_then_tenants_round_robin():
    queue = LineQueue()
    queue.push([work(1, "a"), work(2, "a"), work(3, "a")], is_job=False)
    queue.push([work(4, "b")], is_job=False)
    queue.push([work(9, "c", priority=1), work(8, "c", priority=5)], is_job=True)
    assert len(queue) == 6 and queue.num_jobs == 2
    order = [queue.pop().line_pk for _ in range(6)]
    assert order == [8, 9, 1, 4, 2, 3]
    assert queue.pop() is None and len(queue) == 0


def test_remove_takes_out_matching_lines():
    queue = LineQueue()
    queue.push([work(1, "a", batch="x"), work(2, "a", batch="y"), work(3, "b", batch="x")],
               is_job=False)
    queue.push([work(4, "a", batch="x")], is_job=True)
    removed = queue.remove(lambda w: w.batch_id == "x")
    assert sorted(w.line_pk for w in removed) == [1, 3, 4]
    assert len(queue) == 1 and queue.pop().line_pk == 2


def test_ordered_is_the_order_pop_hands_lines_out():
    queue = LineQueue()
    queue.push([work(1, "a"), work(2, "a"), work(3, "a")], is_job=False)
    queue.push([work(4, "b"), work(5, "b")], is_job=False)
    queue.push([work(6, "a", batch="urgent", priority=3)], is_job=False)
    queue.push([work(9, "c", priority=1), work(8, "c", priority=5)], is_job=True)
    ordered = [w.line_pk for w in queue.ordered()]
    assert len(queue) == 8  # looking takes nothing out
    assert ordered == [queue.pop().line_pk for _ in range(8)] == [8, 9, 6, 1, 4, 2, 5, 3]
