"""KV bytes one request holds at 8k context: a Gemma-3-like layer pattern (five sliding-window
layers to one global) with the windowed layers' blocks freed, against the same model with full
attention everywhere.

``python -m bench.kv_window [--context 8192] [--window 512] [--layers 26] [--pattern 6]``

No model runs: the scheduler and the KV cache manager are pure bookkeeping, so the request is
stepped through them (chunked prefill at the engine's default budget, then decodes) with
made-up sampled tokens, and the blocks it holds in each pool are counted at every step. Bytes
are those blocks times each group's bytes per block (Gemma 3 1B's shapes by default: 1 KV head
of 256 dims, bf16).
"""

from __future__ import annotations

import argparse

import torch

from engine.config import EngineConfig
from engine.core.request import Request
from engine.core.scheduler import Scheduler
from engine.core.window_kv import NULL_BLOCK, WindowBlocks
from engine.outputs import ModelRunnerOutput, RequestMetrics
from engine.runner.kv_cache import plan_kv_cache
from engine.sampling_params import SamplingParams


def peak_bytes(windows: list[int | None], context: int, *, prompt: int, num_kv_heads: int,
               head_dim: int, block_size: int, budget: int) -> tuple[int, int, int, int]:
    """(peak KV bytes the request held, its full-group blocks then, its windowed-group blocks
    then, the bytes it held at its last step: the whole context, decoding)."""
    config = EngineConfig(model="-", block_size=block_size, max_num_batched_tokens=budget,
                          num_kv_blocks=-(-context // block_size) + 8, max_num_seqs=1)
    layout = plan_kv_cache(config, windows, context, num_kv_heads, head_dim,
                           dtype=torch.bfloat16)
    window = None
    if layout.window is not None:
        window = WindowBlocks(layout.num_window_blocks, block_size, layout.window, True)
    scheduler = Scheduler(config, layout.num_blocks, context, window)
    params = SamplingParams(temperature=0, max_tokens=context - prompt, ignore_eos=True)
    request = Request("r", list(range(prompt)), params, context - prompt, (), RequestMetrics(0.0))
    scheduler.add_request(request)
    peak = peak_full = peak_window = last = 0
    while scheduler.has_unfinished_requests():
        out = scheduler.schedule()
        full = len(request.block_ids)
        windowed = sum(1 for b in request.window_block_ids if b != NULL_BLOCK)
        held = full * layout.bytes_per_block + windowed * layout.window_bytes_per_block
        last = held
        if held > peak:
            peak, peak_full, peak_window = held, full, windowed
        sampled = {s.request_id: 1 for s in out.scheduled if s.sample}
        scheduler.update_from_output(out, ModelRunnerOutput(sampled))
    return peak, peak_full, peak_window, last


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=8192)
    parser.add_argument("--prompt", type=int, default=None, help="default: context - 512")
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--layers", type=int, default=26)
    parser.add_argument("--pattern", type=int, default=6, help="every Nth layer is global")
    parser.add_argument("--num-kv-heads", type=int, default=1)
    parser.add_argument("--head-dim", type=int, default=256)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    args = parser.parse_args(argv)
    prompt = args.prompt if args.prompt is not None else args.context - 512
    pattern: list[int | None] = [None if (i + 1) % args.pattern == 0 else args.window
                                 for i in range(args.layers)]
    shape = dict(prompt=prompt, num_kv_heads=args.num_kv_heads, head_dim=args.head_dim,
                 block_size=args.block_size, budget=args.max_num_batched_tokens)
    windowed, full_blocks, window_blocks, windowed_last = peak_bytes(pattern, args.context,
                                                                     **shape)
    dense, dense_blocks, _, dense_last = peak_bytes([None] * args.layers, args.context, **shape)
    num_global = sum(w is None for w in pattern)
    print(f"one request, {prompt} prompt + {args.context - prompt} generated tokens = "
          f"{args.context} context; {args.layers} layers ({num_global} global, "
          f"{args.layers - num_global} with window {args.window}), {args.num_kv_heads} KV "
          f"head(s) x {args.head_dim} dims, bf16, block {args.block_size}, chunk "
          f"{args.max_num_batched_tokens}")
    print(f"full attention everywhere: {dense / 2**20:8.1f} MiB peak ({dense_blocks} blocks "
          f"of every layer)")
    print(f"windowed layers freed:     {windowed / 2**20:8.1f} MiB peak ({full_blocks} blocks "
          f"of the global layers, {window_blocks} of the windowed ones)")
    print(f"at {args.context} tokens (the last decode step): {dense_last / 2**20:.1f} MiB "
          f"full against {windowed_last / 2**20:.1f} MiB windowed: "
          f"{dense_last / windowed_last:.2f}x less")
    print(f"peak ratio (a {args.max_num_batched_tokens}-token prefill chunk held in the "
          f"window too): {dense / windowed:.2f}x less KV per request")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
