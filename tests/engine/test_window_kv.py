"""The windowed layers' KV pool, as pure bookkeeping: blocks behind the window are freed, admission
asks both pools, prefix hits need the window's blocks, and the budget is split by need."""

from __future__ import annotations

import torch

from engine.config import EngineConfig
from engine.core.scheduler import Scheduler
from engine.core.window_kv import NULL_BLOCK, WindowBlocks
from engine.runner.kv_cache import plan_kv_cache, window_blocks_per_request
from tests.engine.test_scheduler import make_request, step

BS, WINDOW = 4, 6


def make(num_blocks=64, num_window_blocks=64, **kw) -> Scheduler:
    config = EngineConfig(model="unused", block_size=BS, **kw)
    window = WindowBlocks(num_window_blocks, BS, WINDOW, config.enable_prefix_caching)
    return Scheduler(config, num_blocks, num_blocks * BS, window)


def held(request) -> list[int]:
    return [b for b in request.window_block_ids if b != NULL_BLOCK]


def test_blocks_behind_the_window_are_freed_as_the_request_moves():
    sched = make(max_num_batched_tokens=8)
    request = make_request("a", list(range(1, 30)), max_tokens=20)
    sched.add_request(request)
    window = sched.kv.window
    assert window is not None
    while sched.has_unfinished_requests():
        step(sched)
        if request.block_ids:
            # the next query at num_computed reads num_computed - WINDOW + 1 .. on
            first = max(0, request.num_computed_tokens - WINDOW + 1) // BS
            assert all(b == NULL_BLOCK for b in request.window_block_ids[:first])
            assert len(held(request)) <= window_blocks_per_request(
                WINDOW, sched.config) and len(request.window_block_ids) == len(request.block_ids)
    assert window.num_free_blocks == window.num_blocks
    assert sched.kv.num_free_blocks == sched.kv.num_blocks


def test_admission_waits_for_the_window_pool_too():
    # Plenty of full blocks, windowed blocks for one request's prompt chunk only.
    sched = make(num_window_blocks=1 + 3, max_num_batched_tokens=12)
    sched.add_request(make_request("a", list(range(1, 13)), max_tokens=8))
    sched.add_request(make_request("b", list(range(50, 62)), max_tokens=8))
    out, _ = step(sched)
    assert [s.request_id for s in out.scheduled] == ["a"]  # b's 3 windowed blocks do not fit
    while sched.has_unfinished_requests():
        step(sched)
    assert sched.kv.window is not None
    assert sched.kv.window.num_free_blocks == sched.kv.window.num_blocks


def test_prefix_hit_needs_the_windows_blocks_cached():
    sched = make(max_num_batched_tokens=64)
    prompt = list(range(1, 26))  # 6 full blocks + 1 token
    sched.add_request(make_request("a", prompt, max_tokens=1))
    while sched.has_unfinished_requests():
        step(sched)
    # Blocks 4 and 5 (the window of a hit at 24 tokens) are still cached in both pools: a hit.
    again = make_request("b", list(prompt), max_tokens=3)
    sched.add_request(again)
    step(sched)
    assert again.num_cached_tokens == 24
    assert held(again) and again.window_block_ids[0] == NULL_BLOCK  # block 0 never needed
    while sched.has_unfinished_requests():
        step(sched)
    # Evict the windowed copies of blocks 4-5: the full pool alone no longer makes a hit there.
    window = sched.kv.window
    assert window is not None
    window.pool.reset_prefix_cache()
    third = make_request("c", list(prompt), max_tokens=3)
    sched.add_request(third)
    step(sched)
    assert third.num_cached_tokens == 0


def test_budget_split_by_what_a_sequence_needs():
    config = EngineConfig(model="unused", block_size=16, kv_cache_memory=64 << 20,
                          max_num_batched_tokens=512)
    windows: list[int | None] = [512] * 5 + [None]
    layout = plan_kv_cache(config, windows, 8192, 1, 256, torch.bfloat16)
    assert layout.window_layers == [0, 1, 2, 3, 4] and layout.full_layers == [5]
    per_layer = 2 * 16 * 256 * 2
    assert layout.bytes_per_block == per_layer and layout.window_bytes_per_block == 5 * per_layer
    assert layout.total_bytes <= config.kv_cache_memory + layout.window_bytes_per_block
    window_per_seq = window_blocks_per_request(512, config)
    # the same number of sequences' worth in each group
    seqs = layout.num_blocks / (8192 // 16)
    assert abs((layout.num_window_blocks - 1) / window_per_seq - seqs) < 1
    # one group when nothing is windowed, or the window covers the context
    assert plan_kv_cache(config, [None] * 6, 8192, 1, 256, torch.bfloat16).window is None
    # every layer windowed (Mistral, Phi-3): the full group is zero-byte bookkeeping, the
    # budget all goes to the windowed blocks
    every = plan_kv_cache(config, [512] * 6, 8192, 1, 256, torch.bfloat16)
    assert every.full_layers == [] and every.bytes_per_block == 0
    assert every.num_blocks == config.max_num_seqs * (8192 // 16)
    assert (every.num_window_blocks - 1) * every.window_bytes_per_block <= config.kv_cache_memory
    assert every.num_window_blocks - 1 == config.kv_cache_memory // (6 * per_layer)
    assert plan_kv_cache(config, [9000] * 5 + [None], 8192, 1, 256,
                         torch.bfloat16).window is None
