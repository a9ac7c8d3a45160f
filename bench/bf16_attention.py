"""The CPU decode-attention kernel on a bf16 KV cache against fp32: time per call, KV read rate.

A decode step of the default model's shape (9 query heads over 3 KV heads of 64, 16-token
blocks scattered through the pool), ``--num-seqs`` sequences of ``--context`` tokens, both cache
dtypes timed alternately for ``--rounds`` rounds; wall and CPU time (user + sys) per call, the
KV bytes read per second and the bf16/fp32 ratios.

    python -m bench.bf16_attention [--num-seqs 64] [--context 512] [--threads 2]
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import time

import torch

from engine.kernels import cpu_decode_attention as kernel


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.bf16_attention",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-seqs", type=int, default=64)
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=20, help="calls per round and dtype")
    parser.add_argument("--variant", default=None, choices=sorted(kernel.VARIANTS))
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    if kernel.load(args.variant) is None:
        print("the CPU kernel cannot be built here")
        return 1
    num_heads, num_kv_heads, head_dim, block_size = 9, 3, 64, 16
    blocks_per_seq = -(-args.context // block_size)
    num_blocks = args.num_seqs * blocks_per_seq
    g = torch.Generator().manual_seed(0)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k32, v32 = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
    caches = {"float32": (k32, v32), "bfloat16": (k32.bfloat16(), v32.bfloat16())}
    tables = torch.randperm(num_blocks, generator=g).to(torch.int32).view(args.num_seqs, -1)
    lens = torch.full((args.num_seqs,), args.context, dtype=torch.int32)
    q = torch.randn(args.num_seqs, num_heads, head_dim, generator=g)
    wall: dict[str, list[float]] = {name: [] for name in caches}
    cpu: dict[str, list[float]] = {name: [] for name in caches}
    for k, v in caches.values():  # warm up
        kernel.paged_decode_attention(q, k, v, tables, lens, 0.125, variant=args.variant)
    for _ in range(args.rounds):
        for name, (k, v) in caches.items():
            start, start_cpu = time.perf_counter(), _cpu_seconds()
            for _ in range(args.calls):
                kernel.paged_decode_attention(q, k, v, tables, lens, 0.125, variant=args.variant)
            wall[name].append((time.perf_counter() - start) / args.calls)
            cpu[name].append((_cpu_seconds() - start_cpu) / args.calls)
    print(f"kernel {kernel.kernel_isa(args.variant)}, {args.num_seqs} sequences x "
          f"{args.context} tokens, {args.threads} threads, medians of {args.rounds} rounds")
    medians = {}
    for name, (k, _) in caches.items():
        kv_bytes = 2 * args.num_seqs * args.context * num_kv_heads * head_dim * k.element_size()
        w, c = statistics.median(wall[name]), statistics.median(cpu[name])
        medians[name] = (w, c)
        print(f"  {name:9s} {w * 1e3:8.2f} ms wall {c * 1e3:8.2f} ms cpu  "
              f"{kv_bytes / w / 1e9:6.1f} GB/s of KV")
    (w32, c32), (w16, c16) = medians["float32"], medians["bfloat16"]
    print(f"  bf16 speed-up: {w32 / w16:.2f}x wall, {c32 / c16:.2f}x cpu")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
