"""The int8 greedy screen of a head kept in Q8_0 (``Int8GreedyScreen``) against the products it
replaces, on a real model's head and hidden rows.

    python -m bench.int8_screen [--model gemma-3-270m] [--threads 1] [--rows 64] [--calls 7]

Loads the model kept quantized (``boxcar model pull`` first), decodes ``bench.quantized``'s
workload for a few tokens to capture real final hidden rows, then times, for ``--rows`` of them
(best of ``--calls``, ``--threads`` threads): the screen's whole argmax and its int8 kernel alone;
the kept head's product (bf16 x: the bf16 panel; fp32 x: the fp32 panel), which a kept head
without the screen runs; and oneDNN's dense bf16 product of the dequantized head (the
dequantize mode's, where oneDNN packs bf16). Then the mean number of candidates a row over every
captured row, and whether the screen's tokens equal the exact argmax (float64 of the exact
weight's fp32 logits, by the fp32 panel) on them.
"""

from __future__ import annotations

import argparse

import torch

from bench.roofline import best_seconds
from engine.kernels import cpu_fused_ops
from engine.kernels.quant_gemm import q8_0_screen, quant_linear
from engine.runner.greedy_screen import GreedyScreen, Int8GreedyScreen, quantize_rows

_CHUNK_ROWS = 16384  # rows of the head dequantized at a time (the whole fp32 head: 671 MB)


def capture_hidden(model: str, num_requests: int, max_tokens: int) -> tuple[Int8GreedyScreen,
                                                                              torch.Tensor]:
    """The kept engine's screen and the hidden rows its greedy steps passed it."""
    from bench.quantized import workload
    from engine import LLM, SamplingParams

    llm = LLM(model, quantization="keep")
    screen = llm.engine.model_runner.greedy_screen
    if not isinstance(screen, Int8GreedyScreen):
        raise SystemExit(f"{model}'s head is not screened in int8 here ({screen!r})")
    rows: list[torch.Tensor] = []
    argmax = screen.argmax

    def spy(hidden: torch.Tensor) -> torch.Tensor:
        rows.append(hidden.clone())
        return argmax(hidden)

    screen.argmax = spy  # type: ignore[method-assign]
    prompts, _ = workload(llm.tokenizer, num_requests, seed=0)
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    screen.argmax = argmax  # type: ignore[method-assign]
    return screen, torch.cat(rows)


def candidates_a_row(screen: Int8GreedyScreen, hidden: torch.Tensor) -> float:
    approx, row_bounds = screen._screen(hidden.float())
    row_ids, _ = cpu_fused_ops.screen_candidates(approx, row_bounds, screen.row_norms,
                                                 screen.output_rounding)
    return len(row_ids) / len(hidden)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gemma-3-270m")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--calls", type=int, default=7)
    parser.add_argument("--max-tokens", type=int, default=8)
    args = parser.parse_args(argv)

    screen, hidden = capture_hidden(args.model, args.rows, args.max_tokens)
    weight = screen.weight
    torch.set_num_threads(args.threads)
    x = hidden[-args.rows:].float()  # the last step's rows (every request decoding)
    x_bf16 = x.bfloat16()
    dense = torch.cat([weight.rows(torch.arange(s, min(s + _CHUNK_ROWS, screen.vocab_size)),
                                   torch.bfloat16)
                       for s in range(0, screen.vocab_size, _CHUNK_ROWS)])
    dense_screen = GreedyScreen(dense)  # its _screen_bf16 is oneDNN's packed bf16 product
    xq, scales, _ = quantize_rows(x)
    print(f"{args.model}: head Q8_0 {weight.out_features} x {weight.in_features}, "
          f"{len(x)} rows, {args.threads} thread(s), best of {args.calls} (ms)")
    forms = {
        "int8 screen argmax (whole)": lambda: screen.argmax(x),
        "int8 screen kernel alone": lambda: q8_0_screen(weight, xq, scales),
        "kept product, bf16 x": lambda: quant_linear(x_bf16, weight, out_dtype=torch.float32),
        "kept product, fp32 x": lambda: quant_linear(x, weight),
        "dense bf16 (oneDNN)": lambda: dense_screen._screen_bf16(x_bf16),
    }
    for name, fn in forms.items():
        ms = 1e3 * best_seconds(fn, min_seconds=0.0, repeats=args.calls)
        print(f"  {name:30s} {ms:8.1f}")
    print(f"candidates a row: {candidates_a_row(screen, hidden):.2f} (over {len(hidden)} rows)")
    same = all(torch.equal(screen.argmax(hidden[i:i + 64]), _exact_argmax(screen, hidden[i:i + 64]))
               for i in range(0, len(hidden), 64))
    print(f"screen tokens equal the exact argmax on every captured row: {same}")
    return 0


def _exact_argmax(screen: Int8GreedyScreen, hidden: torch.Tensor) -> torch.Tensor:
    """The argmax of the fp32 logits of the exact weight (the fp32 panel, no screen)."""
    return screen.logits(hidden).argmax(dim=1)


if __name__ == "__main__":
    raise SystemExit(main())
