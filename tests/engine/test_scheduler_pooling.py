"""The scheduler with pooling (embedding) requests, driven with fake pooled vectors: no model.

Each input is scheduled whole in one step (never chunked), with no KV blocks, beside others up
to the token budget; one that does not fit what is left waits while smaller ones behind it fill
the step; one longer than the whole budget runs alone; each finishes in the step that computed
it, with its vector."""

from __future__ import annotations

import random

import torch

from engine.config import EngineConfig
from engine.core.request import Request, RequestStatus
from engine.core.scheduler import Scheduler
from engine.outputs import ModelRunnerOutput, RequestMetrics
from engine.pooling_params import PoolingParams
from engine.sampling_params import SamplingParams


def make_scheduler(**kw) -> Scheduler:
    return Scheduler(EngineConfig(model="unused", **kw), 0, max_model_len=512)


def pooling_request(rid: str, num_tokens: int, priority: int = 0) -> Request:
    return Request(request_id=rid, prompt_token_ids=list(range(1, num_tokens + 1)),
                   sampling_params=SamplingParams(max_tokens=1), max_tokens=0,
                   eos_token_ids=(), metrics=RequestMetrics(0.0, num_prompt_tokens=num_tokens),
                   priority=priority, pooling_params=PoolingParams())


def step(sched: Scheduler):
    out = sched.schedule()
    pooled = {s.request_id: torch.full((4,), float(s.num_new_tokens)) for s in out.scheduled}
    _, finished = sched.update_from_output(out, ModelRunnerOutput({}, pooled=pooled))
    return out, finished


def test_whole_inputs_fill_the_budget_and_finish_in_their_step():
    sched = make_scheduler(max_num_batched_tokens=100)
    for rid, n in (("a", 60), ("b", 50), ("c", 30), ("d", 10), ("e", 45)):
        sched.add_request(pooling_request(rid, n))
    out, finished = step(sched)
    # a (60) fits; b (50) does not fit the 40 left and waits; c and d fill the step to 100.
    assert [(s.request_id, s.num_computed_tokens, s.num_new_tokens, s.sample)
            for s in out.scheduled] == [("a", 0, 60, False), ("c", 0, 30, False),
                                        ("d", 0, 10, False)]
    assert out.num_batched_tokens == 100
    assert [r.request_id for r in finished] == ["a", "c", "d"]
    assert all(r.status is RequestStatus.FINISHED_STOPPED and r.embedding is not None
               for r in finished)
    assert float(finished[0].embedding[0]) == 60.0
    assert not sched.running and sched.kv.num_blocks == 0 and sched.kv.usage == 0.0
    out, finished = step(sched)  # the one that waited goes first now
    assert [s.request_id for s in out.scheduled] == ["b", "e"]
    assert not sched.has_unfinished_requests()


def test_an_input_longer_than_the_budget_runs_alone():
    sched = make_scheduler(max_num_batched_tokens=32)
    sched.add_request(pooling_request("small", 8))
    sched.add_request(pooling_request("long", 200))
    out, _ = step(sched)
    assert [s.request_id for s in out.scheduled] == ["small"]
    out, _ = step(sched)
    assert [(s.request_id, s.num_new_tokens) for s in out.scheduled] == [("long", 200)]


def test_max_num_seqs_and_priority():
    sched = make_scheduler(max_num_batched_tokens=1000, max_num_seqs=2)
    for i in range(3):
        sched.add_request(pooling_request(f"bulk{i}", 5, priority=1))
    sched.add_request(pooling_request("urgent", 5, priority=0))
    out, _ = step(sched)
    assert [s.request_id for s in out.scheduled] == ["urgent", "bulk0"]


def test_random_workload_every_input_once_never_over_budget():
    rng = random.Random(0)
    sched = make_scheduler(max_num_batched_tokens=128, max_num_seqs=16)
    sizes = {f"r{i}": rng.choice([1, 3, 7, 20, 64, 127, 128, 300]) for i in range(200)}
    for rid, n in sizes.items():
        sched.add_request(pooling_request(rid, n, priority=rng.choice([0, 1])))
    seen: list[str] = []
    while sched.has_unfinished_requests():
        out, finished = step(sched)
        assert out.num_batched_tokens <= 128 or len(out.scheduled) == 1
        assert all(s.num_new_tokens == sizes[s.request_id] for s in out.scheduled)
        seen += [r.request_id for r in finished]
    assert sorted(seen) == sorted(sizes)
