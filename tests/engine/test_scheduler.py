"""Scheduler invariants, driven with fake model outputs: no model, no tensors."""

from __future__ import annotations

import random

from engine.config import EngineConfig
from engine.core.request import Request, RequestStatus
from engine.core.scheduler import Scheduler
from engine.outputs import ModelRunnerOutput, RequestMetrics
from engine.sampling_params import SamplingParams


def make_scheduler(num_blocks=64, **kw) -> Scheduler:
    config = EngineConfig(model="unused", block_size=4, **kw)
    return Scheduler(config, num_blocks, max_model_len=num_blocks * 4)


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


def step(sched: Scheduler, token: int = 1):
    out = sched.schedule()
    sampled = {s.request_id: token for s in out.scheduled if s.sample}
    _, finished = sched.update_from_output(out, ModelRunnerOutput(sampled))
    return out, finished


def check_invariants(sched: Scheduler) -> None:
    kv = sched.kv
    refs = [0] * kv.num_blocks
    for request in sched.running:
        assert len(request.block_ids) == len(set(request.block_ids))
        for b in request.block_ids:
            refs[b] += 1
        assert len(request.block_ids) * 4 >= request.num_computed_tokens
    for request in sched.waiting:
        assert request.block_ids == []
    for block in kv.pool.blocks:
        assert block.ref_cnt == refs[block.block_id]
    assert kv.num_free_blocks == sum(1 for r in refs if r == 0)


def test_running_first_then_waiting_and_budget_respected():
    sched = make_scheduler(max_num_batched_tokens=10)
    sched.add_request(make_request("a", list(range(1, 8)), max_tokens=3))
    out, _ = step(sched)
    assert [(s.request_id, s.num_new_tokens) for s in out.scheduled] == [("a", 7)]
    sched.add_request(make_request("b", list(range(20, 40))))
    out, _ = step(sched)
    # a decodes first (1 token), b's prompt takes the remaining 9 as a chunk.
    assert [(s.request_id, s.num_new_tokens, s.sample) for s in out.scheduled] == [
        ("a", 1, True), ("b", 9, False)
    ]
    assert out.num_batched_tokens == 10
    out, _ = step(sched)
    assert [(s.request_id, s.num_new_tokens) for s in out.scheduled] == [("a", 1), ("b", 9)]
    check_invariants(sched)


def test_no_chunking_runs_long_prompt_alone_when_step_is_empty():
    sched = make_scheduler(max_num_batched_tokens=8, enable_chunked_prefill=False)
    sched.add_request(make_request("long", list(range(1, 21))))
    sched.add_request(make_request("short", [1, 2, 3]))
    out, _ = step(sched)
    assert [(s.request_id, s.num_new_tokens) for s in out.scheduled] == [("long", 20)]
    out, _ = step(sched)
    assert [(s.request_id, s.num_new_tokens) for s in out.scheduled] == [("long", 1), ("short", 3)]


def test_max_num_seqs_caps_running():
    sched = make_scheduler(max_num_seqs=2)
    for i in range(4):
        sched.add_request(make_request(str(i), [1, 2, 3]))
    out, _ = step(sched)
    assert len(out.scheduled) == 2 and len(sched.waiting) == 2


def test_preemption_by_recompute_newest_first_and_no_leaks():
    sched = make_scheduler(num_blocks=6, max_num_batched_tokens=64, watermark=0.0)
    sched.add_request(make_request("old", list(range(1, 8)), max_tokens=10))
    sched.add_request(make_request("new", list(range(11, 18)), max_tokens=10))
    step(sched)  # both admitted: 2 blocks each
    preempted_ids = set()
    finished = []
    for _ in range(60):
        if not sched.has_unfinished_requests():
            break
        before = {r.request_id for r in sched.running}
        out, done = step(sched)
        finished += [r.request_id for r in done]
        if out.num_preempted:
            preempted_ids |= before - {r.request_id for r in sched.running}
        check_invariants(sched)
    assert sched.num_preemptions > 0
    assert "new" in preempted_ids and "old" not in preempted_ids
    assert sorted(finished) == ["new", "old"]
    assert sched.kv.num_free_blocks == 6


def test_prefix_cache_hit_shares_blocks_and_stops_before_last_token():
    sched = make_scheduler()
    prompt = list(range(1, 13))  # exactly 3 full blocks of 4
    sched.add_request(make_request("a", prompt, max_tokens=5))
    step(sched)
    sched.add_request(make_request("b", prompt, max_tokens=2))
    out, _ = step(sched)
    b = next(s for s in out.scheduled if s.request_id == "b")
    # 2 of 3 blocks hit: the last token is always recomputed so there are logits to sample.
    assert b.num_computed_tokens == 8 and b.num_new_tokens == 4
    ra, rb = sched.requests["a"], sched.requests["b"]
    assert ra.block_ids[:2] == rb.block_ids[:2]
    assert sched.kv.pool.blocks[ra.block_ids[0]].ref_cnt == 2
    assert rb.num_cached_tokens == 8
    assert (sched.kv.num_queries, sched.kv.num_hits) == (24, 8)
    check_invariants(sched)


def test_refused_admissions_are_not_counted_as_prefix_queries():
    sched = make_scheduler(num_blocks=4, watermark=0.0)
    sched.add_request(make_request("big", list(range(1, 13)), max_tokens=4))
    sched.add_request(make_request("wait", list(range(1, 9)), max_tokens=4))
    for _ in range(3):
        step(sched)  # "wait" cannot fit while "big" runs
    assert sched.requests["wait"].status == RequestStatus.WAITING
    assert sched.kv.num_queries == 12


def test_abort_frees_everything_wherever_the_request_is():
    sched = make_scheduler(max_num_seqs=1)
    sched.add_request(make_request("run", list(range(1, 10)), max_tokens=50))
    sched.add_request(make_request("wait", list(range(1, 10)), max_tokens=50))
    step(sched)
    assert sched.requests["wait"].status == RequestStatus.WAITING
    done = sched.finish_requests(["run", "wait", "unknown"], RequestStatus.FINISHED_ABORTED)
    assert {r.request_id for r in done} == {"run", "wait"}
    assert not sched.has_unfinished_requests()
    assert sched.kv.num_free_blocks == sched.kv.num_blocks


def test_random_workload_keeps_invariants_and_frees_all_blocks():
    rng = random.Random(0)
    sched = make_scheduler(num_blocks=24, max_num_batched_tokens=16, max_num_seqs=6)
    pending = [
        make_request(str(i), [rng.randrange(1, 5) for _ in range(rng.randrange(1, 30))],
                     max_tokens=rng.randrange(1, 20))
        for i in range(40)
    ]
    finished = set()
    for _ in range(2000):
        if pending and rng.random() < 0.3:
            sched.add_request(pending.pop())
        if rng.random() < 0.02 and sched.running:
            victim = rng.choice(sched.running).request_id
            sched.finish_requests([victim], RequestStatus.FINISHED_ABORTED)
            finished.add(victim)
        out, done = step(sched, token=rng.randrange(1, 5))
        assert out.num_batched_tokens <= 16
        assert len(sched.running) <= 6
        finished |= {r.request_id for r in done}
        check_invariants(sched)
        if not pending and not sched.has_unfinished_requests():
            break
    assert len(finished) == 40
    assert sched.kv.num_free_blocks == 24
    assert sched.kv.num_hits > 0  # prompts over a 4-letter alphabet share prefixes
