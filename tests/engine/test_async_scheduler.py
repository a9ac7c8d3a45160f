"""Async scheduling's bookkeeping, driven with a fake device: no model, no tensors.

The fake device computes each sampled token from the row's input token and position, so a
decode that read a placeholder instead of the token sampled before it would change everything
after it; it keeps the last token it sampled for each request, as the real runner gathers it
from the previous step's tokens.
"""

from __future__ import annotations

import random

import pytest

from engine.core.block_pool import hash_block_tokens
from engine.core.request import PLACEHOLDER_TOKEN_ID, Request, RequestStatus
from engine.core.scheduler import OverlappedOutput, Scheduler
from engine.outputs import ModelRunnerOutput, RequestMetrics, SchedulerOutput
from engine.sampling_params import SamplingParams
from tests.engine.test_scheduler import check_invariants, make_request, make_scheduler

STOP = 7


class FakeDevice:
    def __init__(self) -> None:
        self.last_sampled: dict[str, int] = {}

    def run(self, sched: Scheduler, out: SchedulerOutput) -> ModelRunnerOutput:
        sampled = {}
        requests = (out.requests if isinstance(out, OverlappedOutput)
                    else [sched.requests[s.request_id] for s in out.scheduled])
        for s, request in zip(out.scheduled, requests, strict=True):
            last = s.num_computed_tokens + s.num_new_tokens - 1
            if s.prev_token:
                assert s.num_new_tokens == 1
                assert request.token_ids[last] == PLACEHOLDER_TOKEN_ID
                token = self.last_sampled[s.request_id]
            else:
                token = request.token_ids[last]
                assert token != PLACEHOLDER_TOKEN_ID
            if s.sample:
                sampled[s.request_id] = (token * 31 + last * 17) % 40 + 1  # 7 stops, sometimes
                self.last_sampled[s.request_id] = sampled[s.request_id]
        return ModelRunnerOutput(sampled)


def drive(sched: Scheduler, overlap: bool, arrivals: dict[int, list[Request]],
          aborts: dict[int, list[str]] | None = None) -> dict[str, tuple[list[int], str | None]]:
    """Step until every request is done; (output ids, finish reason) by request id."""
    device = FakeDevice()
    requests: dict[str, Request] = {}
    in_flight: tuple[SchedulerOutput, ModelRunnerOutput] | None = None
    arrivals = {k: list(v) for k, v in arrivals.items()}
    aborts = dict(aborts or {})
    for step in range(500):
        for request in arrivals.pop(step, []):
            requests[request.request_id] = request
            sched.add_request(request)
        sched.finish_requests(aborts.pop(step, []), RequestStatus.FINISHED_ABORTED)
        out = sched.schedule(overlap=overlap)
        launched = None if out.is_empty else (out, device.run(sched, out))
        if overlap:
            if in_flight is not None:
                sched.update_from_output(*in_flight)
            in_flight = launched
        elif launched is not None:
            sched.update_from_output(*launched)
        check_invariants(sched)
        for block in sched.kv.pool.blocks:
            assert block.token_ids is None or PLACEHOLDER_TOKEN_ID not in block.token_ids
        if not (sched.has_unfinished_requests() or arrivals or in_flight):
            break
    else:
        raise AssertionError("did not finish")
    assert sched.kv.num_free_blocks == sched.kv.num_blocks
    assert sched.kv.in_flight == {}
    for request in requests.values():
        assert request.block_hashes == chained_hashes(request.token_ids, 4)[
            :len(request.block_hashes)]
    return {rid: (r.output_token_ids, r.status.finish_reason) for rid, r in requests.items()}


def chained_hashes(token_ids: list[int], block_size: int) -> list[bytes]:
    hashes: list[bytes] = []
    for i in range(len(token_ids) // block_size):
        hashes.append(hash_block_tokens(hashes[-1] if hashes else None,
                                        token_ids[i * block_size:(i + 1) * block_size]))
    return hashes


def stopping_request(rid: str, prompt: list[int], max_tokens: int) -> Request:
    return Request(
        request_id=rid, prompt_token_ids=prompt,
        sampling_params=SamplingParams(temperature=0, max_tokens=max_tokens,
                                       stop_token_ids=[STOP]),
        max_tokens=max_tokens, eos_token_ids=(),
        metrics=RequestMetrics(0.0, num_prompt_tokens=len(prompt)))


def workload(seed: int) -> dict[int, list[Request]]:
    rng = random.Random(seed)
    shared = [rng.randint(1, 40) for _ in range(10)]
    arrivals: dict[int, list[Request]] = {}
    for i in range(14):
        prompt = (shared if i % 2 else []) + [rng.randint(1, 40) for _ in range(rng.randint(1, 9))]
        arrivals.setdefault(rng.randint(0, 12), []).append(
            stopping_request(f"r{i}", prompt, rng.randint(1, 12)))
    return arrivals


MODES = {
    "default": {},
    "chunked-tiny-budget": {"max_num_batched_tokens": 5},
    "preempt-tiny-kv": {"num_blocks": 12, "watermark": 0.0},
    "one-seq": {"max_num_seqs": 1},
    "no-prefix-cache": {"enable_prefix_caching": False},
}


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_overlapped_steps_give_the_synchronous_tokens(mode, seed):
    kw = dict(MODES[mode])
    sync = drive(make_scheduler(**kw), False, workload(seed))
    overlapped_sched = make_scheduler(**kw)
    overlapped = drive(overlapped_sched, True, workload(seed))
    assert overlapped == sync
    reasons = {reason for _, reason in sync.values()}
    assert reasons == {"stop", "length"}  # both kinds of finish, at different steps
    if mode == "preempt-tiny-kv":
        assert overlapped_sched.num_preemptions > 0


def test_a_placeholder_is_counted_at_schedule_time_and_replaced_by_position():
    sched = make_scheduler()
    sched.add_request(make_request("a", [1, 2, 3], max_tokens=3))
    first = sched.schedule(overlap=True)
    a = sched.requests["a"]
    assert a.token_ids == [1, 2, 3, PLACEHOLDER_TOKEN_ID] and a.num_computed_tokens == 3
    second = sched.schedule(overlap=True)  # before the first step's output
    assert [(s.num_computed_tokens, s.num_new_tokens, s.prev_token)
            for s in second.scheduled] == [(3, 1, True)]
    assert a.token_ids == [1, 2, 3, PLACEHOLDER_TOKEN_ID, PLACEHOLDER_TOKEN_ID]
    sched.update_from_output(first, ModelRunnerOutput({"a": 20}))
    assert a.token_ids == [1, 2, 3, 20, PLACEHOLDER_TOKEN_ID] and a.num_placeholders == 1
    # max_tokens=3: the second step's token is its last but one; the third step samples the
    # last, and a fourth is not scheduled while the third is in flight
    third = sched.schedule(overlap=True)
    assert sched.schedule(overlap=True).is_empty
    sched.update_from_output(second, ModelRunnerOutput({"a": 21}))
    _, finished = sched.update_from_output(third, ModelRunnerOutput({"a": 22}))
    assert finished == [a] and a.output_token_ids == [20, 21, 22]
    assert a.status == RequestStatus.FINISHED_LENGTH


def test_a_request_that_stops_drops_the_token_of_the_step_in_flight():
    sched = make_scheduler()
    request = stopping_request("a", [1, 2, 3, 4, 5, 6, 7, 8], max_tokens=10)
    sched.add_request(request)
    first = sched.schedule(overlap=True)
    second = sched.schedule(overlap=True)  # computes a token after the one the first samples
    _, finished = sched.update_from_output(first, ModelRunnerOutput({"a": STOP}))
    assert finished == [request] and request.output_token_ids == [STOP]
    assert sched.kv.num_free_blocks == sched.kv.num_blocks  # freed now; later steps run after
    updated, finished = sched.update_from_output(second, ModelRunnerOutput({"a": 9}))
    assert updated == finished == [] and request.output_token_ids == [STOP]
    assert request.stop_reason == STOP


def test_an_aborted_request_leaks_no_placeholder_and_its_id_can_come_back():
    sched = make_scheduler()
    sched.add_request(make_request("a", [1, 2, 3], max_tokens=10))
    first = sched.schedule(overlap=True)
    aborted = sched.requests["a"]
    sched.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    assert aborted.token_ids == [1, 2, 3] and aborted.num_placeholders == 0
    again = make_request("a", [4, 5], max_tokens=2)
    sched.add_request(again)  # the same id, while the first one's step is in flight
    second = sched.schedule(overlap=True)
    updated, _ = sched.update_from_output(first, ModelRunnerOutput({"a": 30}))
    assert updated == [] and aborted.token_ids == [1, 2, 3]
    assert again.token_ids == [4, 5, PLACEHOLDER_TOKEN_ID]
    sched.update_from_output(second, ModelRunnerOutput({"a": 31}))
    assert again.output_token_ids == [31]


def test_blocks_are_published_only_with_sampled_tokens():
    """A block whose last token is a placeholder is hashed and published only once the token is
    back, under the hash of its real tokens."""
    sched = make_scheduler()  # blocks of 4
    sched.add_request(make_request("a", [1, 2, 3], max_tokens=4))
    first = sched.schedule(overlap=True)  # the prompt; samples position 3, the block's last
    second = sched.schedule(overlap=True)  # decodes position 3 (the first's token)
    a = sched.requests["a"]
    sched.update_from_output(first, ModelRunnerOutput({"a": 9}))
    assert a.block_hashes == [] and a.num_published_blocks == 0
    sched.update_from_output(second, ModelRunnerOutput({"a": 10}))
    assert a.block_hashes == [hash_block_tokens(None, [1, 2, 3, 9])]
    assert a.num_published_blocks == 1
    assert sched.kv.pool.blocks[a.block_ids[0]].token_ids == (1, 2, 3, 9)


def test_a_prompt_chunk_ending_a_block_on_its_sampled_token_hashes_the_real_token():
    sched = make_scheduler()  # blocks of 4
    sched.add_request(make_request("a", [1, 2, 3, 4, 5, 6, 7], max_tokens=4))
    first = sched.schedule(overlap=True)  # samples position 7, the second block's last
    second = sched.schedule(overlap=True)  # samples position 8: the block after is started
    a = sched.requests["a"]
    sched.update_from_output(first, ModelRunnerOutput({"a": 9}))
    sched.update_from_output(second, ModelRunnerOutput({"a": 10}))
    assert a.block_hashes == chained_hashes([1, 2, 3, 4, 5, 6, 7, 9], 4)
    assert [sched.kv.pool.blocks[b].token_ids for b in a.block_ids[:2]] == [(1, 2, 3, 4),
                                                                              (5, 6, 7, 9)]


def test_a_request_preempted_with_its_token_in_flight_takes_it_and_recomputes():
    sched = make_scheduler(num_blocks=4, watermark=0.0)  # blocks of 4
    sched.add_request(make_request("old", [1, 2, 3, 4, 5, 6, 7, 8], max_tokens=6))
    sched.add_request(make_request("new", [11, 12, 13, 14, 15, 16, 17, 18], max_tokens=6))
    first = sched.schedule(overlap=True)  # both prompts: 2 blocks each, the pool is full
    new = sched.requests["new"]
    second = sched.schedule(overlap=True)  # position 8 needs a third block each: new goes
    assert [s.request_id for s in second.scheduled] == ["old"] and second.num_preempted == 1
    assert new.status == RequestStatus.PREEMPTED and new.num_computed_tokens == 0
    assert new.token_ids[-1] == PLACEHOLDER_TOKEN_ID
    sched.update_from_output(first, ModelRunnerOutput({"old": 20, "new": 21}))
    assert new.token_ids == [11, 12, 13, 14, 15, 16, 17, 18, 21] and new.num_placeholders == 0
    assert new.block_ids == []
