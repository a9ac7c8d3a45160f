"""PersistentBatch gives, every step, exactly the batch build_input_batch rebuilds from the
requests: driven by the real scheduler over random arrivals, finishes, aborts, reused ids,
preemptions, prefix-cache hits, skipped steps and windowed layers, synchronous and async."""

from __future__ import annotations

import random
from dataclasses import fields

import numpy as np
import pytest
import torch

from engine import SamplingParams
from engine.config import EngineConfig
from engine.core.request import Request, RequestStatus
from engine.core.scheduler import Scheduler
from engine.core.window_kv import WindowBlocks
from engine.layers.attention_metadata import AttentionMetadata
from engine.outputs import ModelRunnerOutput, ScheduledRequest, SchedulerOutput
from engine.runner.input_batch import InputBatch, StepRow, build_input_batch
from engine.runner.persistent_batch import PersistentBatch
from engine.runner.sampling_columns import SamplingColumns
from tests.engine.test_scheduler import check_invariants, make_request

BS, WINDOW = 4, 6
CPU = torch.device("cpu")


Prepared = tuple[InputBatch, list[Request], SamplingColumns]


def reference(scheduled: list[ScheduledRequest], requests: dict[str, Request],
              with_window: bool) -> Prepared:
    """The batch rebuilt from the requests' lists (the runner's way before the persistent
    batch), and the sampled rows' columns built from their requests."""
    rows = [StepRow(requests[s.request_id].token_ids, requests[s.request_id].block_ids,
                    requests[s.request_id].window_block_ids, s.num_computed_tokens,
                    s.num_new_tokens, s.sample) for s in scheduled]
    batch = build_input_batch(rows, BS, CPU, with_window=with_window)
    sampled = [requests[scheduled[i].request_id] for i in batch.sample_rows]
    return batch, sampled, SamplingColumns.of(sampled)


def assert_same_metadata(got: AttentionMetadata | None, want: AttentionMetadata | None) -> None:
    assert (got is None) == (want is None)
    if got is None or want is None:
        return
    for f in fields(AttentionMetadata):
        a, b = getattr(got, f.name), getattr(want, f.name)
        if isinstance(b, torch.Tensor):
            assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), f.name
        elif f.name == "window":
            assert_same_metadata(a, b)
        else:
            assert a == b, f.name


def assert_same(got: Prepared, want: Prepared) -> None:
    (batch, sample_requests, columns), (expected, expected_requests, expected_columns) = (
        got, want)
    assert np.array_equal(columns.values, expected_columns.values)
    for name in ("input_ids", "positions"):
        a, b = getattr(batch, name), getattr(expected, name)
        assert a.dtype == b.dtype and torch.equal(a, b), name
    assert batch.sample_indices == expected.sample_indices
    assert batch.sample_rows == expected.sample_rows
    assert all(a is b for a, b in zip(sample_requests, expected_requests, strict=True))
    assert_same_metadata(batch.metadata, expected.metadata)


def make_scheduler(rng: random.Random, window: bool) -> Scheduler:
    config = EngineConfig(model="unused", block_size=BS, max_num_seqs=rng.choice([4, 8]),
                          max_num_batched_tokens=rng.choice([8, 16, 32]),
                          enable_chunked_prefill=True, urgent_bulk_tokens=rng.choice([4, 64]))
    num_blocks = rng.choice([24, 40])
    kv_window = (WindowBlocks(num_blocks, BS, WINDOW, config.enable_prefix_caching)
                 if window else None)
    return Scheduler(config, num_blocks, num_blocks * BS, kv_window)


def drive(seed: int, *, window: bool, overlap: bool, num_steps: int = 200) -> Scheduler:
    """Random traffic through the scheduler; each step's batch from both paths compared (and
    the step before compared again, after this step's diff: its arrays are its own)."""
    rng = random.Random(seed)
    sched = make_scheduler(rng, window)
    persistent = PersistentBatch(BS, window, num_slots=1, max_num_blocks=1)  # grows
    prefixes = [[rng.randrange(1, 50) for _ in range(rng.choice([4, 8, 9]))] for _ in range(3)]
    finished_ids: list[str] = []
    next_id = 0
    in_flight: SchedulerOutput | None = None
    previous = None
    for _ in range(num_steps):
        for _ in range(rng.choice([0, 0, 1, 2])):
            if finished_ids and rng.random() < 0.3:
                rid = finished_ids.pop(rng.randrange(len(finished_ids)))  # an id reused
            else:
                rid, next_id = f"r{next_id}", next_id + 1
            prompt = rng.choice(prefixes) + [rng.randrange(1, 50)
                                             for _ in range(rng.randrange(1, 12))]
            request = make_request(rid, prompt, max_tokens=rng.randrange(1, 14),
                                   priority=rng.choice([0, 0, 1]))
            # each its own sampling parameters: the columns its slot keeps
            request.sampling_params = SamplingParams(
                temperature=rng.choice([0.0, 0.7]), top_k=rng.choice([None, 5]),
                top_p=rng.choice([1.0, 0.9]), logprobs=rng.choice([None, 2]),
                frequency_penalty=rng.choice([0.0, 0.5]), max_tokens=request.max_tokens,
                ignore_eos=True, seed=rng.choice([None, 3]))
            request.seed = request.sampling_params.seed
            sched.add_request(request)
        if sched.requests and rng.random() < 0.05:
            rid = rng.choice(list(sched.requests))
            sched.finish_requests([rid], RequestStatus.FINISHED_ABORTED)
            finished_ids.append(rid)
        out = sched.schedule(overlap=overlap)
        if out.scheduled:
            scheduled = list(out.scheduled)
            if rng.random() < 0.5:
                rng.shuffle(scheduled)  # the runner's order (by adapter with LoRA on)
            want = reference(scheduled, sched.requests, window)
            got = persistent.prepare(scheduled, sched.requests, CPU)
            assert_same(got, want)
            # a slot for every running request (one skipping this step too) and no other
            assert persistent.num_requests == len(sched.running)
            if previous is not None:
                assert_same(*previous)
            previous = got, want
        done = in_flight if overlap else out
        in_flight = out if overlap else None
        if done is not None and done.scheduled:
            sampled = {s.request_id: rng.randrange(1, 50) for s in done.scheduled if s.sample}
            _, finished = sched.update_from_output(done, ModelRunnerOutput(sampled))
            finished_ids += [r.request_id for r in finished]
        if not overlap:
            check_invariants(sched)
    return sched


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("window", [False, True], ids=["full", "windowed"])
def test_the_persistent_batch_is_the_rebuilt_batch_every_step(window: bool, overlap: bool):
    num_preemptions = num_hits = 0
    for seed in range(12):
        sched = drive(seed, window=window, overlap=overlap)
        num_preemptions += sched.num_preemptions
        num_hits += sched.kv.num_hits
    assert num_preemptions > 0 and num_hits > 0  # the traffic reached both


def test_a_preempted_request_comes_back_with_its_new_blocks():
    sched = Scheduler(EngineConfig(model="unused", block_size=BS), 16, 64)
    persistent = PersistentBatch(BS, False)
    request = make_request("a", list(range(1, 10)), max_tokens=4)
    sched.add_request(request)
    out = sched.schedule()
    persistent.prepare(out.scheduled, sched.requests, CPU)
    first_blocks = list(request.block_ids)
    sched.kv.free(request)  # as a preemption does: the blocks go, the request later returns
    request.num_computed_tokens = 0
    assert sched.kv.allocate_slots(request, 9)
    assert request.block_ids != first_blocks  # (the free queue hands out its oldest first)
    batch, _, _ = persistent.prepare(out.scheduled, sched.requests, CPU)
    assert batch.metadata.prefill_block_tables.tolist() == [request.block_ids]
