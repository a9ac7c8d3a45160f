"""Priority in the scheduler: lower values first; an urgent request displaces less urgent ones.

Driven with fake model outputs (no model).
"""

from __future__ import annotations

import pytest

from engine.core.request import RequestStatus
from tests.engine.test_scheduler import check_invariants, make_request, make_scheduler, step


def ids(out) -> set[str]:
    return {s.request_id for s in out.scheduled}


def drain(sched) -> list[str]:
    order = []
    for _ in range(500):
        if not sched.has_unfinished_requests():
            break
        _, done = step(sched)
        order += [r.request_id for r in done]
        check_invariants(sched)
    assert not sched.has_unfinished_requests()
    assert sched.kv.num_free_blocks == sched.kv.num_blocks
    return order


def test_waiting_queue_is_ordered_by_priority_then_arrival():
    sched = make_scheduler(max_num_seqs=1)
    for rid, prio in (("late-low", 5), ("b0", 0), ("c0", 0), ("urgent", -1)):
        sched.add_request(make_request(rid, [1, 2, 3], max_tokens=1, priority=prio))
    assert [r.request_id for r in sched.waiting] == ["urgent", "b0", "c0", "late-low"]
    assert drain(sched) == ["urgent", "b0", "c0", "late-low"]


def test_urgent_request_takes_a_seat_from_the_newest_less_urgent_one():
    sched = make_scheduler(max_num_seqs=2)
    sched.add_request(make_request("bulk-old", [1, 2, 3], max_tokens=20, priority=1))
    sched.add_request(make_request("bulk-new", [4, 5, 6], max_tokens=20, priority=1))
    step(sched)
    step(sched)
    sched.add_request(make_request("job", [7, 8, 9], max_tokens=3, priority=0))
    out, _ = step(sched)
    assert ids(out) == {"bulk-old", "job"} and out.num_preempted == 1
    new = sched.requests["bulk-new"]
    assert new.status == RequestStatus.PREEMPTED and new.num_computed_tokens == 0
    assert new.metrics.num_preemptions == 1
    check_invariants(sched)
    order = drain(sched)
    assert order.index("job") < order.index("bulk-new")
    # bulk-new recomputes its prompt and the tokens it had produced, then finishes in full.
    assert len(new.output_token_ids) == 20


def test_urgent_request_takes_blocks_when_the_kv_cache_is_full():
    sched = make_scheduler(num_blocks=6, watermark=0.0)
    sched.add_request(make_request("bulk-a", list(range(1, 12)), max_tokens=30, priority=1))
    sched.add_request(make_request("bulk-b", list(range(20, 31)), max_tokens=30, priority=1))
    step(sched)  # 3 blocks each: the cache is full
    assert sched.kv.num_free_blocks == 0
    sched.add_request(make_request("job", [40, 41, 42], max_tokens=2, priority=0))
    out, _ = step(sched)
    assert "job" in ids(out) and sched.requests["bulk-b"].status == RequestStatus.PREEMPTED
    assert sched.requests["bulk-a"].status == RequestStatus.RUNNING
    assert drain(sched)[0] == "job"


def test_urgent_request_takes_budget_without_preempting():
    sched = make_scheduler(max_num_batched_tokens=8)
    sched.add_request(make_request("bulk", list(range(1, 40)), max_tokens=2, priority=1))
    out, _ = step(sched)
    assert ids(out) == {"bulk"} and out.num_batched_tokens == 8
    sched.add_request(make_request("job", [50, 51, 52], max_tokens=2, priority=0))
    out, _ = step(sched)
    # bulk's next chunk skips the step (it keeps its blocks); job's prompt runs.
    assert [(s.request_id, s.num_new_tokens) for s in out.scheduled] == [("job", 3)]
    assert out.num_preempted == 0 and sched.requests["bulk"].num_computed_tokens == 8
    check_invariants(sched)
    out, _ = step(sched)
    assert [(s.request_id, s.num_new_tokens) for s in out.scheduled] == [("job", 1), ("bulk", 7)]
    drain(sched)


def test_equal_priority_never_preempts():
    sched = make_scheduler(max_num_seqs=2)
    for rid in ("a", "b", "c"):
        sched.add_request(make_request(rid, [1, 2, 3], max_tokens=5))
    for _ in range(3):
        out, _ = step(sched)
        assert ids(out) == {"a", "b"} and out.num_preempted == 0
    drain(sched)
    assert sched.num_preemptions == 0


def test_victims_are_least_urgent_first_then_newest():
    sched = make_scheduler(max_num_seqs=3)
    sched.add_request(make_request("p2-old", [1, 2, 3], max_tokens=30, priority=2))
    sched.add_request(make_request("p1", [4, 5, 6], max_tokens=30, priority=1))
    sched.add_request(make_request("p2-new", [7, 8, 9], max_tokens=30, priority=2))
    step(sched)
    assert [r.request_id for r in sched.running] == ["p1", "p2-old", "p2-new"]
    sched.add_request(make_request("j1", [10, 11], max_tokens=5, priority=0))
    sched.add_request(make_request("j2", [12, 13], max_tokens=5, priority=0))
    out, _ = step(sched)
    assert ids(out) == {"p1", "j1", "j2"}
    assert [r.request_id for r in sched.waiting] == ["p2-old", "p2-new"]
    # A request no more urgent than every running one displaces nobody.
    sched.add_request(make_request("p1-late", [14, 15], max_tokens=5, priority=1))
    out, _ = step(sched)
    assert out.num_preempted == 0
    drain(sched)


def test_preempted_request_is_not_readmitted_in_the_same_step():
    sched = make_scheduler(max_num_seqs=1)
    sched.add_request(make_request("bulk", [1, 2, 3], max_tokens=10, priority=1))
    step(sched)
    sched.add_request(make_request("job", [4, 5], max_tokens=2, priority=0))
    out, _ = step(sched)
    assert ids(out) == {"job"}
    assert sched.requests["bulk"].status == RequestStatus.PREEMPTED
    drain(sched)


def bulk_tokens(out) -> dict[str, int]:
    return {s.request_id: s.num_new_tokens for s in out.scheduled if s.request_id != "job"}


def test_urgent_bulk_tokens_caps_every_less_urgent_token_oldest_first():
    sched = make_scheduler(max_num_seqs=8, urgent_bulk_tokens=4)
    for i in range(6):
        sched.add_request(make_request(f"bulk{i}", [1, 2, 3, i + 10], max_tokens=40, priority=1))
    out, _ = step(sched)
    assert out.num_batched_tokens == 24  # one priority: nothing is capped
    step(sched)
    sched.add_request(make_request("job", list(range(50, 60)), max_tokens=6, priority=0))
    sched.add_request(make_request("bulk6", [30] * 18, max_tokens=40, priority=1))
    before = {r.request_id: r.num_computed_tokens for r in sched.running}
    out, _ = step(sched)
    check_invariants(sched)
    # The job's whole prompt and the four oldest bulk decodes; the two newest bulk requests skip
    # the step (still running, their blocks kept) and bulk6 is not admitted.
    assert bulk_tokens(out) == {"bulk0": 1, "bulk1": 1, "bulk2": 1, "bulk3": 1}
    assert {s.request_id: s.num_new_tokens for s in out.scheduled}["job"] == 10
    for rid in ("bulk4", "bulk5"):
        request = sched.requests[rid]
        assert request.status == RequestStatus.RUNNING
        assert request.num_computed_tokens == before[rid] and request.block_ids
    assert sched.requests["bulk6"].status == RequestStatus.WAITING
    num_capped_steps = 0
    while "job" in sched.requests:
        out, _ = step(sched)
        check_invariants(sched)
        assert "job" in ids(out)
        assert bulk_tokens(out) == {"bulk0": 1, "bulk1": 1, "bulk2": 1, "bulk3": 1}
        num_capped_steps += 1
    assert num_capped_steps == 5
    # The job is done: every bulk decode and bulk6's whole prompt run in one step.
    out, _ = step(sched)
    assert bulk_tokens(out) == {**{f"bulk{i}": 1 for i in range(6)}, "bulk6": 18}
    drain(sched)


def test_urgent_bulk_cap_counts_admissions_and_none_turns_it_off():
    # The job and a less urgent prompt are admitted in one step; a less urgent request held on
    # the job's prefix blocks stays held. With the cap the other prompt gets 3 tokens, without
    # it its whole prompt.
    for cap, expected in ((3, 3), (None, 16)):
        sched = make_scheduler(max_num_seqs=8, urgent_bulk_tokens=cap)
        sched.add_request(make_request("bulk0", [7] * 8, max_tokens=10, priority=1))
        sched.add_request(make_request("job", [7] * 8 + [1], max_tokens=2, priority=0))
        sched.add_request(make_request("bulk1", [9] * 16, max_tokens=10, priority=1))
        out, _ = step(sched)  # the job runs first: bulk0 is held on the job's prefix blocks
        assert {s.request_id: s.num_new_tokens for s in out.scheduled} == {
            "job": 9, "bulk1": expected}
        drain(sched)


def test_urgent_bulk_cap_without_chunking_defers_long_prompts():
    sched = make_scheduler(max_num_seqs=8, urgent_bulk_tokens=4, enable_chunked_prefill=False)
    sched.add_request(make_request("job", [1, 2, 3, 4, 5], max_tokens=3, priority=0))
    sched.add_request(make_request("short", [6, 7, 8], max_tokens=3, priority=1))
    sched.add_request(make_request("long", [9] * 10, max_tokens=3, priority=1))
    out, _ = step(sched)
    assert ids(out) == {"job", "short"}  # 10 prompt tokens cannot be chunked under a cap of 4
    while "job" in sched.requests:
        out, _ = step(sched)
        assert "long" not in ids(out)
    out, _ = step(sched)
    assert "long" in ids(out)
    drain(sched)


def test_urgent_bulk_tokens_is_validated():
    for bad in (0, -3):
        with pytest.raises(ValueError, match="urgent_bulk_tokens"):
            make_scheduler(urgent_bulk_tokens=bad)


def test_equal_priorities_schedule_exactly_as_without_the_cap():
    def trace(cap: int | None, priority: int) -> list[list[tuple[str, int, int]]]:
        sched = make_scheduler(num_blocks=12, max_num_seqs=4, max_num_batched_tokens=16,
                               urgent_bulk_tokens=cap)
        for i in range(10):
            sched.add_request(make_request(f"r{i}", [i % 3 + 1] * (5 + 3 * i), max_tokens=6,
                                           priority=priority))
        steps = []
        while sched.has_unfinished_requests():
            out, _ = step(sched)
            check_invariants(sched)
            steps.append([(s.request_id, s.num_computed_tokens, s.num_new_tokens)
                          for s in out.scheduled])
        return steps

    uncapped = trace(None, 0)
    assert sched_preempts(uncapped)  # a workload that chunks prompts and preempts
    assert trace(1, 0) == uncapped == trace(1, 3)


def sched_preempts(steps: list[list[tuple[str, int, int]]]) -> bool:
    """Whether some request restarts from 0 computed tokens after having run (a recompute)."""
    started: set[str] = set()
    for scheduled in steps:
        for rid, computed, _ in scheduled:
            if rid in started and computed == 0:
                return True
            started.add(rid)
    return False


def ranked(rid: str, rank: int, max_tokens: int = 6, priority: int = 0):
    first = 1 + sum(map(ord, rid)) % 200  # distinct prompts: no prefix to wait for
    request = make_request(rid, [first, 2, 3, 4, 5], max_tokens=max_tokens, priority=priority)
    request.rank = rank
    return request


def test_rank_orders_the_waiting_queue_without_preempting_or_capping():
    sched = make_scheduler(max_num_seqs=2, urgent_bulk_tokens=1)
    for rid in ("late-a", "late-b", "late-c", "late-d"):
        sched.add_request(ranked(rid, rank=50))
    step(sched)
    assert [r.request_id for r in sched.running] == ["late-a", "late-b"]
    # A lower rank arrives: it goes ahead of the waiting ones, not of the running ones.
    sched.add_request(ranked("soon", rank=10, max_tokens=2))
    assert [r.request_id for r in sched.waiting] == ["soon", "late-c", "late-d"]
    out, _ = step(sched)
    assert ids(out) == {"late-a", "late-b"} and out.num_preempted == 0
    # One priority: the cap on less urgent requests' tokens does not apply to ranks.
    assert sched._bulk_cap() == (None, None)
    order = drain(sched)
    assert sched.num_preemptions == 0
    assert order.index("soon") < order.index("late-c") < order.index("late-d")
    assert sched.requests == {}


def test_priority_still_displaces_across_ranks():
    sched = make_scheduler(max_num_seqs=2)
    sched.add_request(ranked("bulk-a", rank=0, max_tokens=20))
    sched.add_request(ranked("bulk-b", rank=0, max_tokens=20))
    step(sched)
    # More urgent by priority (a deadline at risk), however high its rank: it preempts.
    sched.add_request(ranked("at-risk", rank=99, max_tokens=2, priority=-1))
    out, _ = step(sched)
    assert "at-risk" in ids(out) and out.num_preempted == 1
    order = drain(sched)
    assert order[0] == "at-risk"
