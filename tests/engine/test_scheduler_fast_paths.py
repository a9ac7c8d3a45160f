"""The scheduler's shortcuts for the steady decode state give what its general path gives.

``Scheduler._schedule_decodes`` takes the leading running decodes without the general loop;
``update_from_output`` skips ``_check_token_stop`` for a token that can end nothing. Each is
compared with the general path on workloads that mix prompts, chunks, stops, priorities,
preemption, prefix hits and async scheduling.
"""

from __future__ import annotations

import random
from typing import Any

import pytest

from engine.core.request import Request
from engine.core.scheduler import Scheduler
from engine.outputs import RequestMetrics
from engine.sampling_params import SamplingParams
from tests.engine.test_async_scheduler import MODES, drive, stopping_request
from tests.engine.test_scheduler import make_scheduler


def prioritized_workload(seed: int) -> dict[int, list[Request]]:
    """Requests arriving over the first steps, some sharing a prefix; of two priorities but
    for seed 0 (while priorities differ, the bulk cap, if on, is the general loop's)."""
    rng = random.Random(seed)
    shared = [rng.randint(1, 40) for _ in range(10)]
    arrivals: dict[int, list[Request]] = {}
    for i in range(16):
        prompt = (shared if i % 2 else []) + [rng.randint(1, 40) for _ in range(rng.randint(1, 9))]
        request = stopping_request(f"r{i}", prompt, rng.randint(1, 16))
        request.priority = rng.choice((0, 0, 1)) if seed else 0
        arrivals.setdefault(rng.randint(0, 12), []).append(request)
    return arrivals


def recorded_run(kw: dict[str, Any], overlap: bool, seed: int, fast: bool
                 ) -> tuple[list[Any], dict[str, Any], int]:
    """Every step's scheduler output, the requests' results, and the requests the fast path
    scheduled (``fast=False``: it takes none)."""
    sched = make_scheduler(**kw)
    steps: list[Any] = []
    num_fast = 0
    schedule, schedule_decodes = sched.schedule, sched._schedule_decodes

    def recording(overlap: bool = False):
        out = schedule(overlap)
        steps.append(([(s.request_id, s.num_computed_tokens, s.num_new_tokens, s.sample,
                        s.prev_token) for s in out.scheduled],
                      out.num_batched_tokens, out.num_preempted))
        return out

    def counted(step) -> int:
        nonlocal num_fast
        num = schedule_decodes(step) if fast else 0
        num_fast += num
        return num

    sched.schedule = recording  # type: ignore[method-assign]
    sched._schedule_decodes = counted  # type: ignore[method-assign]
    results = drive(sched, overlap, prioritized_workload(seed))
    return steps, results, num_fast


@pytest.mark.parametrize("mode", [*MODES, "no-bulk-cap"])
@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_scheduling_decodes_without_the_loop_changes_no_step(mode, overlap, seed):
    kw = dict(MODES.get(mode, {"urgent_bulk_tokens": None}))
    general = recorded_run(kw, overlap, seed, fast=False)
    steps, results, num_fast = recorded_run(kw, overlap, seed, fast=True)
    assert (steps, results) == general[:2]
    if seed == 0 or kw.get("urgent_bulk_tokens", 64) is None:
        assert num_fast > 0


def test_a_token_passed_over_by_the_stop_filter_ends_nothing():
    """Where ``update_from_output`` skips ``_check_token_stop`` (the token is not in the
    request's stop set and no limit is reached), the check would have returned None."""
    rng = random.Random(0)
    sched: Scheduler = make_scheduler(num_blocks=64)  # max_model_len 256
    for i in range(3000):
        prompt = [1] * rng.randint(1, 40)
        params = SamplingParams(
            temperature=0, max_tokens=rng.randint(3, 300), ignore_eos=rng.random() < 0.5,
            stop_token_ids=rng.sample(range(8), rng.randint(0, 2)),
            min_tokens=rng.choice((0, 0, 3)))
        request = Request(f"r{i}", prompt, params, params.max_tokens or 1,
                          tuple(rng.sample(range(8), rng.randint(0, 2))),
                          RequestMetrics(0.0, num_prompt_tokens=len(prompt)))
        token_id = rng.randrange(8)
        num_computed = rng.randrange(len(prompt) - 1, 260)
        num_out = num_computed + 1 - len(prompt)
        skipped = (token_id not in request.stop_token_set and num_out < request.max_tokens
                   and num_computed + 1 < sched.max_model_len)
        if skipped:
            assert sched._check_token_stop(request, token_id, num_out) is None


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("mode", ["default", "preempt-tiny-kv"])
def test_token_metrics_are_those_of_every_token(mode, overlap):
    """``update_from_output`` leaves the metrics alone after the first token: a finished or
    aborted request (steps in flight included) counts exactly its output tokens, and has a
    first-token time iff it has one."""
    arrivals = prioritized_workload(3)
    requests = [r for batch in arrivals.values() for r in batch]
    aborts = {5: ["r1", "r4"], 9: ["r7"], 14: ["r10", "r12"]}
    drive(make_scheduler(**MODES[mode]), overlap, arrivals, aborts)
    assert {r.status.finish_reason for r in requests} == {"stop", "length", "abort"}
    for request in requests:
        assert request.metrics.num_generated_tokens == len(request.output_token_ids)
        assert (request.metrics.first_token_time is not None) == bool(request.output_token_ids)
