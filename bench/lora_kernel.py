"""The CPU LoRA segment kernel (``csrc/lora_segments.cpp``) on ``bench.lora``'s shapes: the
default model's four projections, 8 adapters of ranks 8-64 with ``--rows-per-adapter`` rows
each (8: a mixed decode step; 256: a prompt chunk), against the base projection's own matmul
and, for segments as long as a prompt's, the libraries' path the kernel replaces (oneDNN's
packed A and B, as ``LoRALinear`` runs a long segment without the kernel).

``python -m bench.lora_kernel [--threads 1] [--variant native|portable] [--repeats 30]
[--rows-per-adapter 8] [--layers 1]``

Prints, per projection and dtype, the kernel's time for every adapter's delta and the base
projection's ``F.linear`` time, then a layer's totals: the kernel's share and the bandwidth at
which it read the adapters' weights. With one layer the adapters stay in the cache between
repeats; ``--layers 30`` gives each layer adapters of its own (the default model's 30 layers:
176 MB in bf16) and times a whole step over them, the weights coming from memory as in a real
decode step.
"""

from __future__ import annotations

import argparse
import time

# (in_features, the output slices) of the default model's projections
SHAPES = {"qkv_proj": (576, (576, 192, 192)), "o_proj": (576, (576,)),
          "gate_up_proj": (576, (1536, 1536)), "down_proj": (1536, (576,))}
RANKS = (8, 16, 24, 32, 40, 48, 56, 64)
# From this many rows a segment is as long as a prompt chunk's: the libraries' path is timed too.
LONG_ROWS = 32


def _timed(repeats: int, fn, *args) -> float:
    for _ in range(3):
        fn(*args)
    start = time.perf_counter()
    for _ in range(repeats):
        fn(*args)
    return (time.perf_counter() - start) / repeats


def _library_delta(x, out, modules) -> None:
    """What ``LoRALinear`` runs on a long segment without the kernel (``onednn_delta``)."""
    from engine.lora.layers import onednn_delta

    for start, end, module in modules:
        onednn_delta(x, out, slice(start, end), module)


def _linear_inputs(g, dtype, in_features, slices, per, kernel):
    """x, out, the kernel's segments and (start, end, ModuleLoRA) for one linear, and the
    adapters' bytes."""
    import torch

    from engine.lora.layers import LoRAPiece, ModuleLoRA

    rows = per * len(RANKS)
    x = torch.randn(rows, in_features, generator=g).to(dtype)
    out = torch.zeros(rows, sum(slices), dtype=dtype)
    segments, modules, nbytes = [], [], 0
    for i, rank in enumerate(RANKS):
        pieces, col = [], 0
        for s, size in enumerate(slices):
            b = (torch.randn(size, rank, generator=g) * 0.02).to(dtype)
            pieces.append(LoRAPiece(col, size, s * rank, rank, 2.0, b, (s,)))
            col += size
        a = (torch.randn(rank * len(slices), in_features, generator=g) / 30).to(dtype)
        module = ModuleLoRA(a, pieces)
        nbytes += (a.numel() + sum(p.lora_b.numel() for p in pieces)) * a.element_size()
        segments.append((i * per, (i + 1) * per, *module.kernel_args(kernel)))
        modules.append((i * per, (i + 1) * per, module))
    return x, out, segments, modules, nbytes


def _one_layer(args, kernel, g, dtype) -> None:
    import torch
    import torch.nn.functional as F

    lora_s = base_s = library_s = 0.0
    weight_bytes = 0
    # oneDNN packs bf16 only where the CPU has bf16 units (AVX2-only CPUs: fp32 alone)
    from engine.layers.linear import onednn_packing_available

    long = args.rows_per_adapter >= LONG_ROWS and onednn_packing_available(dtype)
    for name, (in_features, slices) in SHAPES.items():
        x, out, segments, modules, nbytes = _linear_inputs(g, dtype, in_features, slices,
                                                           args.rows_per_adapter, kernel)
        weight = torch.randn(sum(slices), in_features, generator=g).to(dtype)
        weight_bytes += nbytes
        k = _timed(args.repeats, kernel.lora_segments, x, out, segments)
        b = _timed(args.repeats, F.linear, x, weight)
        lib = _timed(args.repeats, _library_delta, x, out, modules) if long else 0.0
        lora_s, base_s, library_s = lora_s + k, base_s + b, library_s + lib
        libraries = f"   oneDNN's LoRA {1e3 * lib:7.3f} ms" if long else ""
        print(f"  {str(dtype):15s} {name:13s} kernel {1e3 * k:7.3f} ms   base F.linear "
              f"{1e3 * b:7.3f} ms{libraries}")
    libraries = (f"; oneDNN's LoRA {1e3 * library_s:.3f} ms, the kernel "
                 f"{library_s / lora_s:.2f}x faster" if long else "")
    print(f"{str(dtype):15s} a layer: kernel {1e3 * lora_s:.3f} ms, base {1e3 * base_s:.3f} "
          f"ms ({lora_s / base_s:.2f}x); adapters {weight_bytes / 1e6:.1f} MB read at "
          f"{weight_bytes / lora_s / 1e9:.1f} GB/s{libraries}")


def _whole_step(args, kernel, g, dtype) -> None:
    """Every layer's four linears once, each layer with adapters of its own; a buffer larger
    than the caches is written between steps, as the base weights would evict the adapters."""
    import torch

    calls, weight_bytes = [], 0
    for _ in range(args.layers):
        for in_features, slices in SHAPES.values():
            x, out, segments, _, nbytes = _linear_inputs(g, dtype, in_features, slices,
                                                         args.rows_per_adapter, kernel)
            calls.append((x, out, segments))
            weight_bytes += nbytes
    flush = torch.zeros(64 * 2**20 // 4)
    times = []
    for _ in range(args.repeats):
        flush.add_(1.0)
        start = time.perf_counter()
        for x, out, segments in calls:
            kernel.lora_segments(x, out, segments)
        times.append(time.perf_counter() - start)
    times.sort()
    median = times[len(times) // 2]
    print(f"{str(dtype):15s} a step over {args.layers} layers: kernel median "
          f"{1e3 * median:.2f} ms (best {1e3 * times[0]:.2f}); adapters "
          f"{weight_bytes / 1e6:.0f} MB read at {weight_bytes / median / 1e9:.1f} GB/s")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.lora_kernel", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--variant", default=None, help="native or portable (default: native)")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--rows-per-adapter", type=int, default=8,
                        help="rows of each adapter's segment (8: a decode step; 256: a prompt)")
    parser.add_argument("--layers", type=int, default=1,
                        help="layers of distinct adapters (more than one: a whole step, timed "
                        "with the weights from memory)")
    args = parser.parse_args(argv)

    import torch

    from engine.kernels import cpu_decode_attention

    torch.set_num_threads(args.threads)
    kernel = cpu_decode_attention.load(args.variant)
    if kernel is None:
        print("the CPU kernels cannot be built here")
        return 1
    g = torch.Generator().manual_seed(0)
    print(f"{args.rows_per_adapter * len(RANKS)} rows, adapters of ranks {list(RANKS)} x "
          f"{args.rows_per_adapter} rows, {args.threads} thread(s), variant "
          f"{args.variant or 'native'}, bf16 pairs {bool(kernel.lora_bf16_pairs)}, AMX "
          f"{bool(kernel.lora_amx)}")
    for dtype in (torch.float32, torch.bfloat16):
        if args.layers > 1:
            _whole_step(args, kernel, g, dtype)
        else:
            _one_layer(args, kernel, g, dtype)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
