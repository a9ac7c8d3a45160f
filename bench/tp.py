"""Tensor parallel: a step's time at TP=1 and at TP=N, and the all-reduces' share of it.

``python -m bench.tp [--model FOLDER | --families llama,gemma2,qwen3_moe,...] [--tp 2]
[--expert-parallel] [--batch 16] [--prompt-len 128] [--steps 24]``

Without ``--model`` it writes a random-weight model of each of ``--families`` (default llama;
``bench.random_model``, ~100M parameters, the default model's tokenizer) to a temporary folder.
``--expert-parallel`` adds a TP=N run with the experts spread whole over the ranks for the
mixtures of experts (one all-reduce a block either way; docs/moe.md). Each run adds ``--batch``
requests of ``--prompt-len`` random tokens, prefills them in one step, then decodes ``--steps``
steps; it prints the prefill step's time, the median decode step's, and the share of the
driver's step spent inside the all-reduces (with the waits for the slower rank: on a CPU the
ranks share the cores, so that share is mostly waiting). Each rank runs ``--threads`` threads
(default 1), so TP=N uses N times TP=1's cores: on a machine with fewer free cores than that the
figures say nothing about a GPU. Both runs are eager (TP > 1 captures no CUDA graphs), so the
comparison is like for like. Not a target, a measurement; ``bench/gpu_check.py`` has the GPU
case.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path


@dataclass
class StepFigures:
    tp: int
    expert_parallel: bool
    prefill_ms: float
    decode_ms: float  # median decode step
    reduce_share: float  # of the decode steps' time, on the driver
    num_reduces_per_step: float
    token_ids: list[list[int]]


def measure(folder: Path, tp: int, *, batch: int, prompt_len: int, steps: int,
            threads: int | None, device: str = "cpu", dtype: str = "float32",
            expert_parallel: bool = False) -> StepFigures:
    import torch

    from engine import LLMEngine, SamplingParams
    from engine.config import EngineConfig
    from engine.distributed.runner import TPModelRunner

    config = EngineConfig(
        model=str(folder), tensor_parallel_size=tp, device=device, dtype=dtype,
        num_threads=threads, max_num_seqs=batch, enforce_eager=True,
        expert_parallel=expert_parallel,
        max_num_batched_tokens=max(2048, batch * prompt_len),
        max_kv_blocks=batch * (-(-(prompt_len + steps + 2) // 16)) + 2)
    engine = LLMEngine(config)
    runner = engine.model_runner
    g = torch.Generator().manual_seed(0)
    for i in range(batch):
        prompt = torch.randint(3, engine.vocab_size, (prompt_len,), generator=g).tolist()
        engine.add_request(f"r{i}", prompt,
                           SamplingParams(temperature=0, max_tokens=steps + 1, ignore_eos=True))
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    try:
        start = time.perf_counter()
        engine.step()  # every prompt in one step
        sync()
        prefill = time.perf_counter() - start
        group = runner.group if isinstance(runner, TPModelRunner) else None
        if group is not None:
            group.timed = True  # the decode steps' all-reduces (on CUDA: synchronized)
        reduce_before = group.reduce_seconds if group else 0.0
        count_before = group.num_reduces if group else 0
        times = []
        outputs = []
        for _ in range(steps + 1):
            start = time.perf_counter()
            outputs += engine.step()
            sync()
            times.append(time.perf_counter() - start)
        reduce = (group.reduce_seconds - reduce_before) if group else 0.0
        count = (group.num_reduces - count_before) if group else 0
    finally:
        if isinstance(runner, TPModelRunner):
            runner.close()
    outputs.sort(key=lambda o: int(o.request_id[1:]))
    return StepFigures(tp, expert_parallel, prefill * 1e3, statistics.median(times) * 1e3,
                       reduce / sum(times), count / len(times),
                       [o.outputs[0].token_ids for o in outputs])


MOE_FAMILIES = ("qwen3_moe", "mixtral", "gpt_oss")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--families", default="llama",
                        help="comma-separated bench.random_model families (without --model)")
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--expert-parallel", action="store_true",
                        help="also expert parallel, for the mixtures of experts")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--threads", type=int, default=1, help="threads per rank")
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args(argv)
    print(f"batch {args.batch}, prompt {args.prompt_len} tokens, {args.steps} decode steps, "
          f"{args.threads} thread(s) per rank, {args.dtype}")
    print(f"{'model':<14} {'tp':>3} {'ep':>3} {'prefill ms':>11} {'decode ms':>10} "
          f"{'all-reduce share':>17} {'reduces/step':>13} {'tokens = TP=1':>14}")
    with tempfile.TemporaryDirectory() as tmp:
        if args.model is not None:
            folders = [(args.model.name, args.model)]
        else:
            from bench.random_model import write_random_model

            folders = [(family, write_random_model(Path(tmp) / family, family))
                       for family in args.families.split(",")]
        for name, folder in folders:
            runs = [(1, False), (args.tp, False)]
            if args.expert_parallel and name in MOE_FAMILIES:
                runs.append((args.tp, True))
            figures = [measure(folder, tp, batch=args.batch, prompt_len=args.prompt_len,
                               steps=args.steps, threads=args.threads, dtype=args.dtype,
                               expert_parallel=ep) for tp, ep in runs]
            for f in figures:
                same = f.token_ids == figures[0].token_ids
                print(f"{name:<14} {f.tp:>3} {'yes' if f.expert_parallel else '-':>3} "
                      f"{f.prefill_ms:>11.1f} {f.decode_ms:>10.1f} {f.reduce_share:>16.1%} "
                      f"{f.num_reduces_per_step:>13.0f} {str(same):>14}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
