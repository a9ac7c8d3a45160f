"""The CPU LoRA segment kernel (``csrc/lora_segments.cpp``) on one decode step's shapes: the
default model's four projections, 64 rows, 8 adapters of ranks 8-64 with 8 rows each (the
shapes of ``bench.lora``'s mixed decode step), against the base projection's own matmul.

``python -m bench.lora_kernel [--threads 1] [--variant native|portable] [--repeats 30]``

Prints, per projection and dtype, the kernel's time for every adapter's delta and the base
projection's ``F.linear`` time, then a layer's totals: the kernel's share and the bandwidth at
which it read the adapters' weights.
"""

from __future__ import annotations

import argparse
import time

# (in_features, the output slices) of the default model's projections
SHAPES = {"qkv_proj": (576, (576, 192, 192)), "o_proj": (576, (576,)),
          "gate_up_proj": (576, (1536, 1536)), "down_proj": (1536, (576,))}
RANKS = (8, 16, 24, 32, 40, 48, 56, 64)
ROWS_PER_ADAPTER = 8


def _timed(repeats: int, fn, *args) -> float:
    for _ in range(3):
        fn(*args)
    start = time.perf_counter()
    for _ in range(repeats):
        fn(*args)
    return (time.perf_counter() - start) / repeats


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.lora_kernel", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--variant", default=None, help="native or portable (default: native)")
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args(argv)

    import torch
    import torch.nn.functional as F

    from engine.kernels import cpu_decode_attention
    from engine.layers.lora import LoRAPiece, ModuleLoRA

    torch.set_num_threads(args.threads)
    kernel = cpu_decode_attention.load(args.variant)
    if kernel is None:
        print("the CPU kernels cannot be built here")
        return 1
    g = torch.Generator().manual_seed(0)
    rows = ROWS_PER_ADAPTER * len(RANKS)
    print(f"{rows} rows, adapters of ranks {list(RANKS)} x {ROWS_PER_ADAPTER} rows, "
          f"{args.threads} thread(s), variant {args.variant or 'native'}")
    for dtype in (torch.float32, torch.bfloat16):
        lora_s = base_s = 0.0
        weight_bytes = 0
        for name, (in_features, slices) in SHAPES.items():
            out_features = sum(slices)
            weight = torch.randn(out_features, in_features, generator=g).to(dtype)
            x = torch.randn(rows, in_features, generator=g).to(dtype)
            out = torch.zeros(rows, out_features, dtype=dtype)
            segments = []
            for i, rank in enumerate(RANKS):
                pieces, col = [], 0
                for s, size in enumerate(slices):
                    b = (torch.randn(size, rank, generator=g) * 0.02).to(dtype)
                    pieces.append(LoRAPiece(col, size, s * rank, rank, 2.0, b, (s,)))
                    col += size
                a = (torch.randn(rank * len(slices), in_features, generator=g) / 30).to(dtype)
                module = ModuleLoRA(a, pieces)
                numel = a.numel() + sum(p.lora_b.numel() for p in pieces)
                weight_bytes += numel * a.element_size()
                start = i * ROWS_PER_ADAPTER
                segments.append((start, start + ROWS_PER_ADAPTER,
                                 *module.kernel_args(kernel)))
            k = _timed(args.repeats, kernel.lora_segments, x, out, segments)
            b = _timed(args.repeats, F.linear, x, weight)
            lora_s, base_s = lora_s + k, base_s + b
            print(f"  {str(dtype):15s} {name:13s} kernel {1e3 * k:7.3f} ms   base F.linear "
                  f"{1e3 * b:7.3f} ms")
        print(f"{str(dtype):15s} a layer: kernel {1e3 * lora_s:.3f} ms, base {1e3 * base_s:.3f} "
              f"ms ({lora_s / base_s:.2f}x); adapters {weight_bytes / 1e6:.1f} MB read at "
              f"{weight_bytes / lora_s / 1e9:.1f} GB/s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
