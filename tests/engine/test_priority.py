"""Priority in the scheduler: lower values first; an urgent request displaces less urgent ones.

Driven with fake model outputs (no model).
"""

from __future__ import annotations

from engine.outputs import RequestMetrics
from engine.request import Request, RequestStatus
from engine.sampling_params import SamplingParams
from tests.engine.test_scheduler import check_invariants, make_scheduler, step


def make_request(rid: str, prompt: list[int], max_tokens: int = 4, priority: int = 0) -> Request:
    return Request(
        request_id=rid,
        prompt_token_ids=prompt,
        sampling_params=SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
        max_tokens=max_tokens,
        eos_token_ids=(),
        metrics=RequestMetrics(0.0, num_prompt_tokens=len(prompt)),
        priority=priority,
    )


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


def test_urgent_step_tokens_caps_steps_while_priorities_differ():
    sched = make_scheduler(max_num_seqs=8, urgent_step_tokens=4)
    for i in range(6):
        sched.add_request(make_request(f"bulk{i}", [1, 2, 3, i + 10], max_tokens=30, priority=1))
    out, _ = step(sched)
    assert out.num_batched_tokens == 24  # one priority: the full budget
    sched.add_request(make_request("job", [50, 51, 52], max_tokens=3, priority=0))
    out, _ = step(sched)
    # The job's prompt takes the budget back from the newest bulk decodes; the cap holds.
    assert {s.request_id for s in out.scheduled} == {"job", "bulk0"}
    assert out.num_batched_tokens == 4
    while "job" in sched.requests:
        out, _ = step(sched)
        assert out.num_batched_tokens <= 4 and out.scheduled[0].request_id == "job"
    out, _ = step(sched)
    assert out.num_batched_tokens == 6  # the job is done: every bulk request decodes again
    drain(sched)
