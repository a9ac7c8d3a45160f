"""The quantized GEMM (``engine/kernels/quant_gemm.py``) against the dense paths it replaces, on
the linear shapes of the two GGUF models of issue 48.

    python -m bench.quant_gemm [--threads 2] [--rows 1,8,64,256] [--calls 10]
                               [--models default,gemma-3-270m] [--layers N] [--shapes a,b]

Per model, per linear (as the engine runs them: q/k/v and gate/up fused, adjacent pieces of one
format joined; the head tied to the Q8_0 embedding) and per row count: the kernel's ms a call
(fp32 x, the default dtype on a CPU without bf16 units), the dense fp32 path's ms on the
dequantized weight (``Linear.pack``: oneDNN or MKL, ``cpu_gemm``'s pick) and their ratio; the
dense bf16 path too where oneDNN packs bf16 (a CPU with bf16 units), against the kernel with
bf16 x. Then a decode step's linears (every layer's and the head) summed, and the bytes each
weight keeps resident against ggml's.

Each layer gets weights of its own (``--layers``, default the model's depth: 30 for SmolLM2-135M,
18 for Gemma 3 270M) and a call's time is a pass over all of them divided by their number, so
the weights come from memory as in a real decode step, not from a cache that holds one layer's
(a 576x3072 fp32 weight is 7 MB). The weights are random valid blocks of each format
(``ggml_quants.random_rows``); only the shapes are the models'. Times are the best of
``--calls`` passes: on a shared machine the least disturbed one.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
from torch import nn

from engine.kernels.ggml_quants import dequantize, random_rows
from engine.kernels.quant_gemm import QuantWeight, kernel_formats, kernel_isa, pack
from engine.layers.linear import Linear, bf16_packing_available, fp32_gemm


@dataclass(frozen=True)
class Shape:
    name: str
    fmt: str
    in_features: int
    out_features: int


# SmolLM2-135M-Instruct Q4_1 (every linear Q4_1, the tied head Q8_0) and Gemma 3 270M Q4_K_M
# (Q5_0 q/k/gate/up, Q8_0 v and the tied 262144-row head, Q4_K o_proj, Q6_K down): one layer's
# linears, then the head; with the model's depth.
MODELS: dict[str, tuple[int, tuple[Shape, ...], Shape]] = {
    "default": (30, (Shape("qkv_proj", "Q4_1", 576, 960), Shape("o_proj", "Q4_1", 576, 576),
                     Shape("gate_up_proj", "Q4_1", 576, 3072),
                     Shape("down_proj", "Q4_1", 1536, 576)),
                Shape("lm_head", "Q8_0", 576, 49152)),
    "gemma-3-270m": (18, (Shape("qk_proj", "Q5_0", 640, 1280), Shape("v_proj", "Q8_0", 640, 256),
                          Shape("o_proj", "Q4_K", 1024, 640),
                          Shape("gate_up_proj", "Q5_0", 640, 4096),
                          Shape("down_proj", "Q6_K", 2048, 640)),
                     Shape("lm_head", "Q8_0", 640, 262144)),
}


@dataclass
class Copies:
    """One shape's weights, a copy per layer, in each form timed."""

    quant: list[QuantWeight]
    fp32: list[Linear]
    bf16: list[Linear]
    ggml_bytes: int


def _dense(weight: torch.Tensor, gemm: str | None) -> Linear:
    linear = nn.utils.skip_init(Linear, weight.shape[1], weight.shape[0], bias=False)
    linear.weight = nn.Parameter(weight, requires_grad=False)
    if gemm is not None:
        linear.pack(gemm=gemm)
    return linear


def _copies(shape: Shape, count: int, generator: torch.Generator) -> Copies:
    gemm = fp32_gemm()
    bf16 = bf16_packing_available()
    copies = Copies([], [], [], 0)
    for _ in range(count):
        data = random_rows(shape.fmt, shape.out_features, shape.in_features, generator)
        dense = dequantize(shape.fmt, data, shape.in_features)
        copies.ggml_bytes = data.nbytes
        copies.quant.append(pack(shape.fmt, data, shape.in_features))
        if bf16:
            copies.bf16.append(_dense(dense.bfloat16(), "onednn"))
        copies.fp32.append(_dense(dense, gemm))
    return copies


def _best_ms(calls: int, fns: list[Callable[[], object]]) -> float:
    """Best of ``calls`` passes over ``fns`` (one per layer), in ms per fn."""
    for fn in fns[:2]:
        fn()
    best = float("inf")
    for _ in range(calls):
        start = time.perf_counter()
        for fn in fns:
            fn()
        best = min(best, time.perf_counter() - start)
    return 1e3 * best / len(fns)


def _ratio(dense: float | None, quant: float | None) -> str:
    return f"{dense / quant:9.2f}x" if dense is not None and quant else f"{'-':>10}"


def _ms(value: float | None) -> str:
    return f"{value:9.3f}" if value is not None else f"{'-':>9}"


def run_model(name: str, rows: list[int], calls: int, layers: int | None,
              only: set[str] | None) -> None:
    depth, shapes, head = MODELS[name]
    layers = depth if layers is None else layers
    generator = torch.Generator().manual_seed(0)
    print(f"\n{name}: {layers} layers of their own weights; ms a call, best of {calls}")
    print(f"{'linear':>13} {'fmt':>5} {'in':>5} {'out':>6} {'rows':>4} {'quant':>9} "
          f"{'fp32':>9} {'fp32/q':>10} {'quant bf16':>10} {'bf16':>9} {'bf16/q':>10}")
    totals: dict[int, list[float | None]] = {m: [0.0, 0.0, 0.0, 0.0] for m in rows}
    resident = []
    for shape in (*shapes, head):
        if only is not None and shape.name not in only:
            continue
        count = 1 if shape is head else layers
        times = depth if shape is not head else 1  # how often a step runs it
        copies = _copies(shape, count, generator)
        resident.append((shape, sum(w.nbytes for w in copies.quant) // count,
                         copies.ggml_bytes))
        for m in rows:
            x = torch.randn(m, shape.in_features, generator=generator)
            xb = x.bfloat16()
            quant = _best_ms(calls, [partial(w.linear, x) for w in copies.quant])
            fp32 = _best_ms(calls, [partial(d, x) for d in copies.fp32])
            quant_bf16: float | None = None
            bf16: float | None = None
            if copies.bf16:
                quant_bf16 = _best_ms(calls, [partial(w.linear, xb) for w in copies.quant])
                bf16 = _best_ms(calls, [partial(d, xb) for d in copies.bf16])
            print(f"{shape.name:>13} {shape.fmt:>5} {shape.in_features:5d} "
                  f"{shape.out_features:6d} {m:4d} {_ms(quant)} {_ms(fp32)} "
                  f"{_ratio(fp32, quant)} {_ms(quant_bf16):>10} {_ms(bf16)} "
                  f"{_ratio(bf16, quant_bf16)}", flush=True)
            for i, value in enumerate((quant, fp32, quant_bf16, bf16)):
                total = totals[m][i]
                totals[m][i] = None if value is None or total is None else total + times * value
        del copies
    what = "the linears above" if only is not None else "every linear"
    print(f"a step ({what}: {depth} layers' and the head's), the sum of their ms:")
    for m, (q, dense, q_bf16, dense_bf16) in totals.items():
        print(f"{'step':>13} {'':>5} {'':>5} {'':>6} {m:4d} {_ms(q)} {_ms(dense)} "
              f"{_ratio(dense, q)} {_ms(q_bf16):>10} {_ms(dense_bf16)} "
              f"{_ratio(dense_bf16, q_bf16)}")
    for shape, kept, ggml in resident:
        print(f"resident {shape.name} ({shape.fmt}): {kept} bytes, ggml {ggml} bytes "
              f"({kept / ggml:.3f}x), dense fp32 {4 * shape.in_features * shape.out_features}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rows", default="1,8,64,256")
    parser.add_argument("--calls", type=int, default=10)
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--layers", type=int, default=None,
                        help="layers of weights of their own (default: the model's depth)")
    parser.add_argument("--shapes", default=None, help="only these linears (names)")
    args = parser.parse_args(argv)
    models = args.models.split(",")
    unknown = set(models) - set(MODELS)
    if unknown:
        parser.error(f"unknown models {sorted(unknown)}; known: {', '.join(MODELS)}")
    if not kernel_formats():
        parser.error("the CPU kernel library is not available here (no C++ compiler?)")
    torch.set_num_threads(args.threads)
    print(f"quantized kernel: {kernel_isa()}; dense fp32: {fp32_gemm()}; dense bf16: "
          f"{'oneDNN' if bf16_packing_available() else 'not packed on this CPU (skipped)'}; "
          f"{args.threads} thread(s)")
    only = set(args.shapes.split(",")) if args.shapes else None
    with torch.inference_mode():
        for name in models:
            run_model(name, [int(r) for r in args.rows.split(",")], args.calls, args.layers,
                      only)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
