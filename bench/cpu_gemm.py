"""fp32 GEMM on this CPU: MKL's packed sgemm against oneDNN's packed weights, the choice behind
``cpu_gemm`` (``engine/layers/linear.py``: MKL on Intel, oneDNN elsewhere).

    python -m bench.cpu_gemm [--threads 1] [--rows 4,16,64,256,2048]

For the default model's and MiniLM's projection shapes and each row count it prints both
libraries' milliseconds a call (the median of ``--calls``), their GFLOP/s and the ratio, and
which library ``cpu_gemm`` picks here.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from engine.layers.linear import cpu_vendor, fp32_gemm, onednn_linear

SHAPES = ((576, 1536), (1536, 576), (576, 576), (384, 1536), (1536, 384))  # (in, out)


def _ms(fn, calls: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rows", default="4,16,64,256,2048")
    parser.add_argument("--calls", type=int, default=30)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(f"CPU vendor {cpu_vendor() or 'unknown'}; cpu_gemm picks {fp32_gemm()}; "
          f"{args.threads} thread(s)")
    print(f"{'in':>5} {'out':>5} {'rows':>5} {'mkl ms':>8} {'onednn ms':>10} {'mkl GF/s':>9} "
          f"{'onednn GF/s':>12} {'onednn/mkl':>11}")
    for fan_in, fan_out in SHAPES:
        weight = torch.randn(fan_out, fan_in)
        mkl = torch.ops.mkl._mkl_reorder_linear_weight(weight, 64)
        dnn = torch.ops.mkldnn._reorder_linear_weight(weight)
        for rows in (int(r) for r in args.rows.split(",")):
            x = torch.randn(rows, fan_in)
            a = _ms(lambda x=x, w=weight, p=mkl, n=rows: torch.ops.mkl._mkl_linear(
                x, p, w, None, n), args.calls)
            b = _ms(lambda x=x, p=dnn: onednn_linear(x, p, None), args.calls)
            flops = 2 * rows * fan_in * fan_out
            print(f"{fan_in:5d} {fan_out:5d} {rows:5d} {a:8.3f} {b:10.3f} {flops / a / 1e6:9.1f} "
                  f"{flops / b / 1e6:12.1f} {a / b:10.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
