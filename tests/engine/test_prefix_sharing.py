"""Shared prefixes in flight: a waiting request is held while a running one computes its prefix.

Driven with fake model outputs (no model): the blocks a held request later hits, the requests
behind it that are admitted anyway, and the reference counts after everything ends.
"""

from __future__ import annotations

import random

from engine.core.request import RequestStatus
from tests.engine.test_priority import make_request
from tests.engine.test_scheduler import check_invariants, make_scheduler, step

SHARED = list(range(100, 112))  # three full blocks of 4


def scheduled(out) -> dict[str, tuple[int, int]]:
    return {s.request_id: (s.num_computed_tokens, s.num_new_tokens) for s in out.scheduled}


def run_to_end(sched, max_steps: int = 500) -> None:
    for _ in range(max_steps):
        if not sched.has_unfinished_requests():
            break
        step(sched)
        check_invariants(sched)
    assert not sched.has_unfinished_requests()
    assert sched.kv.num_free_blocks == sched.kv.num_blocks
    assert all(b.ref_cnt == 0 for b in sched.kv.pool.blocks)
    assert sched.kv.in_flight == {}


def test_same_step_sharer_is_held_then_hits_and_others_pass_it():
    sched = make_scheduler()
    sched.add_request(make_request("a", SHARED + [1, 2]))
    sched.add_request(make_request("b", SHARED + [3]))  # shares a's three blocks
    sched.add_request(make_request("c", [7, 8, 9, 10, 11]))  # shares nothing
    out, _ = step(sched)
    assert scheduled(out) == {"a": (0, 14), "c": (0, 5)}  # b held, c not blocked behind it
    assert sched.requests["b"].status == RequestStatus.WAITING
    assert sched.num_prefix_holds == 1
    out, _ = step(sched)
    assert scheduled(out)["b"] == (12, 1)  # the whole shared prefix from the cache
    a, b = sched.requests["a"], sched.requests["b"]
    assert a.block_ids[:3] == b.block_ids[:3]
    assert all(sched.kv.pool.blocks[i].ref_cnt == 2 for i in a.block_ids[:3])
    assert b.num_cached_tokens == b.metrics.num_cached_tokens == 12
    assert (sched.kv.num_queries, sched.kv.num_hits) == (14 + 5 + 13, 12)
    check_invariants(sched)
    run_to_end(sched)


def test_held_until_a_chunked_prefix_is_fully_computed():
    sched = make_scheduler(max_num_batched_tokens=5)
    sched.add_request(make_request("a", SHARED + [1]))
    sched.add_request(make_request("b", SHARED + [2]))
    sizes = []
    while "b" not in scheduled(out := step(sched)[0]):
        sizes.append(scheduled(out)["a"])
    # a's prompt in chunks of 5; b waits for every shared block, not just the first ones.
    assert sizes == [(0, 5), (5, 5), (10, 3)]
    assert scheduled(out)["b"] == (12, 1)
    run_to_end(sched)


def test_siblings_with_identical_prompts_compute_the_prompt_once():
    sched = make_scheduler()
    for i in range(4):
        sched.add_request(make_request(f"s{i}", SHARED + [5, 6]))
    out, _ = step(sched)
    assert scheduled(out) == {"s0": (0, 14)}
    out, _ = step(sched)
    assert {rid: v for rid, v in scheduled(out).items() if rid != "s0"} == {
        "s1": (12, 2), "s2": (12, 2), "s3": (12, 2)
    }
    run_to_end(sched)


def test_owner_aborted_or_preempted_releases_the_held_request():
    sched = make_scheduler(max_num_batched_tokens=4)
    sched.add_request(make_request("a", SHARED + [1]))
    sched.add_request(make_request("b", SHARED + [2]))
    step(sched)  # a computes its first block; b held
    assert set(sched.kv.in_flight.values()) == {sched.requests["a"]}
    sched.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    assert sched.kv.in_flight == {}
    out, _ = step(sched)
    # b hits a's one published block and computes the rest itself.
    assert scheduled(out) == {"b": (4, 4)}
    run_to_end(sched)


def test_no_hold_without_prefix_caching():
    sched = make_scheduler(enable_prefix_caching=False)
    sched.add_request(make_request("a", SHARED + [1]))
    sched.add_request(make_request("b", SHARED + [2]))
    out, _ = step(sched)
    assert scheduled(out) == {"a": (0, 13), "b": (0, 13)}
    assert sched.num_prefix_holds == 0
    run_to_end(sched)


def test_partial_sharer_hits_only_the_common_blocks():
    sched = make_scheduler()
    sched.add_request(make_request("a", SHARED + [1]))
    sched.add_request(make_request("b", SHARED[:8] + [9, 9, 9, 9, 9]))  # two blocks in common
    step(sched)
    out, _ = step(sched)
    assert scheduled(out)["b"] == (8, 5)
    assert sched.requests["b"].num_cached_tokens == 8
    run_to_end(sched)


def test_random_shared_prefix_workload_with_priorities_and_aborts():
    rng = random.Random(3)
    sched = make_scheduler(num_blocks=14, max_num_batched_tokens=12, max_num_seqs=5)
    prefixes = [[rng.randrange(1, 50) for _ in range(rng.choice((4, 8, 13)))] for _ in range(3)]
    pending = [
        make_request(str(i), rng.choice(prefixes) + [rng.randrange(1, 50)
                                                     for _ in range(rng.randrange(1, 6))],
                     max_tokens=rng.randrange(1, 20), priority=rng.choice((0, 1, 1, 2)))
        for i in range(60)
    ]
    finished = set()
    for _ in range(3000):
        if pending and rng.random() < 0.5:
            sched.add_request(pending.pop())
        if rng.random() < 0.03 and (sched.waiting or sched.running):
            victim = rng.choice(sched.waiting + sched.running).request_id
            sched.finish_requests([victim], RequestStatus.FINISHED_ABORTED)
            finished.add(victim)
        out, done = step(sched, token=rng.randrange(1, 50))
        assert out.num_batched_tokens <= 12 and len(sched.running) <= 5
        assert all(owner in sched.running for owner in sched.kv.in_flight.values())
        finished |= {r.request_id for r in done}
        check_invariants(sched)
        if not pending and not sched.has_unfinished_requests():
            break
    assert len(finished) == 60
    assert sched.num_prefix_holds > 0 and sched.num_preemptions > 0
    run_to_end(sched)
