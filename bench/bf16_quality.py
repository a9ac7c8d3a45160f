"""The bf16 quality gate on a real model: top-1 agreement with fp32 under teacher forcing.

The fp32 engine generates the benchmark workload greedily (``bench.offline``'s seeded chat
requests, EOS ignored); its outputs are then teacher-forced through both engines
(``engine.runner.quality.teacher_forced_agreement``). Prints the share of output positions where the
bf16 engine's top-1 token is the fp32 engine's, and the mean |delta logprob| of those tokens.
The gate holds at >= 98% agreement.

    python -m bench.bf16_quality [--num-requests 64] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

from bench.offline import make_workload
from engine import LLM, SamplingParams
from engine.checkpoint.model_cache import DEFAULT_MODEL
from engine.runner.quality import teacher_forced_agreement

GATE = 0.98


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.bf16_quality",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--max-output", type=int, default=256,
                        help="output tokens per request at most (the workload draws 16..this)")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16"),
                        help="the candidate engine's dtype")
    parser.add_argument("--json", default=None, help="write the figures here")
    args = parser.parse_args(argv)
    if args.max_output < 16:
        parser.error("--max-output must be >= 16")

    torch.set_num_threads(args.threads)
    common = dict(device="cpu", num_threads=args.threads)
    reference = LLM(args.model, dtype="float32", **common)
    candidate = LLM(args.model, dtype=args.dtype, **common)
    workload = make_workload(reference.tokenizer, num_requests=args.num_requests,
                             prompt_range=(30, 400), output_range=(16, args.max_output),
                             seed=args.seed)
    start = time.perf_counter()
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True)
              for m in workload.max_tokens]
    outputs = reference.generate(workload.prompts, params)
    sequences = [(p, list(o.token_ids)) for p, o in zip(workload.prompts, outputs, strict=True)]
    report = teacher_forced_agreement(reference.engine.model_runner,
                                      candidate.engine.model_runner, sequences)
    seconds = time.perf_counter() - start
    verdict = "holds" if report.agreement >= GATE else "FAILS"
    print(f"workload: {args.num_requests} requests, {report.num_positions} fp32 greedy output "
          f"tokens teacher-forced through {args.dtype} ({seconds:.0f} s, {args.threads} threads)")
    print(f"top-1 agreement: {report.agreement:.2%} ({report.num_agreeing}/"
          f"{report.num_positions}); the gate (>= {GATE:.0%}) {verdict}")
    print(f"mean |delta logprob| of the fp32 tokens: {report.mean_abs_delta_logprob:.4f} "
          f"(max {report.max_abs_delta_logprob:.3f})")
    print(f"kernel: {candidate.engine.model_runner.attn.name}, "
          f"linears packed: {candidate.engine.model_runner.packed_weights}")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "dtype": args.dtype, "num_positions": report.num_positions,
            "agreement": report.agreement,
            "mean_abs_delta_logprob": report.mean_abs_delta_logprob,
            "max_abs_delta_logprob": report.max_abs_delta_logprob, "gate": GATE,
        }, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
