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
18 for Gemma 3 270M) and every form is timed over whole decode steps, layer after layer then the
head, so each weight comes from memory as in a real step, behind all the others (a single
576x3072 fp32 weight, 7 MB, would sit in the cache between calls; 30 Q4_1 o_proj, 6 MB, too).
The weights are random valid blocks of each format (``ggml_quants.random_rows``); only the shapes
are the models'. A linear's figure is the mean over its layers of each call's best of
``--calls`` steps: on a shared machine, a call that another process interrupted is dropped
without dropping the whole step's figure.
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
class Weights:
    """A model's linears in each form timed: per linear name, a copy per layer (the head: one)."""

    shapes: list[Shape]
    quant: dict[str, list[QuantWeight]]
    fp32: dict[str, list[Linear]]
    bf16: dict[str, list[Linear]]  # empty where oneDNN does not pack bf16
    ggml_bytes: dict[str, int]


def _dense(weight: torch.Tensor, gemm: str | None) -> Linear:
    linear = nn.utils.skip_init(Linear, weight.shape[1], weight.shape[0], bias=False)
    linear.weight = nn.Parameter(weight, requires_grad=False)
    if gemm is not None:
        linear.pack(gemm=gemm)
    return linear


def _weights(shapes: list[Shape], head: Shape, layers: int,
             generator: torch.Generator) -> Weights:
    gemm = fp32_gemm()
    bf16 = bf16_packing_available()
    weights = Weights(shapes, {}, {}, {}, {})
    for shape in shapes:
        for _ in range(1 if shape is head else layers):
            data = random_rows(shape.fmt, shape.out_features, shape.in_features, generator)
            dense = dequantize(shape.fmt, data, shape.in_features)
            weights.ggml_bytes[shape.name] = data.nbytes
            weights.quant.setdefault(shape.name, []).append(
                pack(shape.fmt, data, shape.in_features))
            weights.fp32.setdefault(shape.name, []).append(_dense(dense, gemm))
            if bf16:
                weights.bf16.setdefault(shape.name, []).append(_dense(dense.bfloat16(), "onednn"))
    return weights


def _step_ms(calls: int, step: list[tuple[str, Callable[[], object]]]) -> dict[str, float]:
    """Run ``step`` (a decode step's linears in order, layer after layer) ``calls`` times after
    one pass to warm up; per linear name, the mean over its layers of each call's best time."""
    best = [float("inf")] * len(step)
    for done in range(calls + 1):
        for i, (_, fn) in enumerate(step):
            start = time.perf_counter()
            fn()
            elapsed = time.perf_counter() - start
            if done:
                best[i] = min(best[i], elapsed)
    per_name: dict[str, list[float]] = {}
    for (name, _), seconds in zip(step, best, strict=True):
        per_name.setdefault(name, []).append(seconds)
    return {name: 1e3 * sum(times) / len(times) for name, times in per_name.items()}


def _step(forms: dict[str, list], shapes: list[Shape], layers: int,
          x: dict[int, torch.Tensor]) -> list[tuple[str, Callable[[], object]]]:
    """The calls of a step: each layer's linears in order, then the head (the last shape)."""
    order = [(layer, shape) for layer in range(layers) for shape in shapes[:-1]]
    order += [(0, shapes[-1])]
    return [(shape.name, partial(forms[shape.name][layer], x[shape.in_features]))
            for layer, shape in order if shape.name in forms]


def _ratio(dense: float | None, quant: float | None) -> str:
    return f"{dense / quant:9.2f}x" if dense is not None and quant else f"{'-':>10}"


def _ms(value: float | None) -> str:
    return f"{value:9.3f}" if value is not None else f"{'-':>9}"


def _line(name: str, fmt: str, fan_in: str, fan_out: str, rows: int,
          times: tuple[float, float, float | None, float | None]) -> str:
    quant, fp32, quant_bf16, bf16 = times
    return (f"{name:>13} {fmt:>5} {fan_in:>5} {fan_out:>6} {rows:4d} {_ms(quant)} {_ms(fp32)} "
            f"{_ratio(fp32, quant)} {_ms(quant_bf16):>10} {_ms(bf16)} "
            f"{_ratio(bf16, quant_bf16)}")


def run_model(name: str, rows: list[int], calls: int, layers: int | None,
              only: set[str] | None) -> None:
    depth, layer_shapes, head = MODELS[name]
    layers = depth if layers is None else layers
    shapes = [s for s in (*layer_shapes, head) if only is None or s.name in only]
    weights = _weights(shapes, head, layers, torch.Generator().manual_seed(0))
    linear = {n: [w.linear for w in ws] for n, ws in weights.quant.items()}
    print(f"\n{name}: a decode step's linears, {layers} layers of weights of their own, then "
          f"the head; ms a call, each call's best of {calls}")
    print(f"{'linear':>13} {'fmt':>5} {'in':>5} {'out':>6} {'rows':>4} {'quant':>9} "
          f"{'fp32':>9} {'fp32/q':>10} {'quant bf16':>10} {'bf16':>9} {'bf16/q':>10}")
    all_shapes = [*layer_shapes, head]
    for m in rows:
        x = {fan_in: torch.randn(m, fan_in) for fan_in in {s.in_features for s in shapes}}
        xb = {fan_in: t.bfloat16() for fan_in, t in x.items()}
        quant = _step_ms(calls, _step(linear, all_shapes, layers, x))
        fp32 = _step_ms(calls, _step(weights.fp32, all_shapes, layers, x))
        quant_bf16 = _step_ms(calls, _step(linear, all_shapes, layers, xb)) if weights.bf16 else {}
        bf16 = _step_ms(calls, _step(weights.bf16, all_shapes, layers, xb))
        totals: list[float | None] = [0.0, 0.0, 0.0 if bf16 else None, 0.0 if bf16 else None]
        for shape in shapes:
            times = (quant[shape.name], fp32[shape.name], quant_bf16.get(shape.name),
                     bf16.get(shape.name))
            print(_line(shape.name, shape.fmt, str(shape.in_features), str(shape.out_features),
                        m, times), flush=True)
            count = 1 if shape is head else depth  # how often a step runs it
            totals = [None if t is None or v is None else t + count * v
                      for t, v in zip(totals, times, strict=True)]
        print(_line("step", "", "", "", m, (totals[0] or 0.0, totals[1] or 0.0, totals[2],
                                             totals[3])))
    what = "the linears above" if only is not None else "every linear"
    print(f"step: the sum over {what}, {depth} layers' and the head's")
    for shape in shapes:
        kept = sum(w.nbytes for w in weights.quant[shape.name]) // len(weights.quant[shape.name])
        ggml = weights.ggml_bytes[shape.name]
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
