"""Quantized weights kept quantized: memory, decode throughput and quality on real GGUF files.

    python -m bench.quantized [--models default,gemma-3-270m] [--threads 2] [--llamacpp]

For each model (the default SmolLM2-135M Q4_1 GGUF and Gemma 3 270M Q4_K_M, both pulled with
``boxcar model pull``), each configuration runs in a child process of its own, so its peak RSS
(``VmHWM``) is its own:

- ``keep``: ``--quantization keep`` in the default dtype (the weights stay in their GGUF blocks,
  multiplied by the C++ kernels of ``engine/kernels/quant_gemm.py``);
- ``dequantize``: today's path, every tensor dequantized at load to the default dtype (bf16 where
  the CPU has bf16 units, fp32 elsewhere: ``engine/runner/device.py``), packed for oneDNN/MKL;
- with ``--unscreened``: ``keep`` with the runner's greedy screen off (every greedy row takes
  the full output product: the kept Q8_0 head's ``Int8GreedyScreen`` against what it replaces);
- with ``--llamacpp``: llama.cpp on the same GGUF, 16 requests in flight (``bench/llamacpp.py``).

The workload is decode-heavy (the issue's): 64 requests, prompts of 16-96 tokens, 64-256 greedy
output tokens, EOS ignored so every system does the same work. Printed per model: resident
weight bytes (the model's tensors and kept blocks, each storage counted once) against the GGUF's
tensor bytes (target <= 1.15x), peak RSS, output tok/s and the ratios keep / dequantize (target
>= 1) and keep / llama.cpp (target >= 2.5); then the quality gate: the dequantized fp32 engine's
greedy outputs on 16 of the requests teacher-forced through the keep engine
(``engine/runner/quality.py``), top-1 agreement (target >= 99%).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

MODELS = {"default": "SmolLM2-135M-Instruct", "gemma-3-270m": "gemma-3-270m"}
TARGETS = {"bytes": 1.15, "keep/dequantize": 1.0, "keep/llama.cpp": 2.5, "agreement": 0.99}


def workload(tokenizer: Any, num_requests: int, seed: int, max_output: int = 256
             ) -> tuple[list[list[int]], list[int]]:
    """Seeded prompts of 16-96 tokens (the chat template where the model has one: the base
    Gemma has none) and their output lengths."""
    from bench.workload import make_workload

    output_range = (min(64, max_output), max_output)
    if getattr(tokenizer, "chat_template", None):
        made = make_workload(tokenizer, num_requests=num_requests, prompt_range=(16, 96),
                             output_range=output_range, seed=seed)
        return made.prompts, made.max_tokens
    import random

    from bench.workload import WORDS

    rng = random.Random(seed)
    prompts, max_tokens = [], []
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    for _ in range(num_requests):
        text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(16, 96)))
        prompts.append(bos + tokenizer(text, add_special_tokens=False).input_ids[:96])
        max_tokens.append(rng.randint(*output_range))
    return prompts, max_tokens


def resident_weight_bytes(model: torch.nn.Module) -> int:
    """The bytes the model's weights keep: every parameter and every tensor a module holds
    beside them (prepacked copies) by storage, once, plus every kept quantized weight
    (``nbytes``), once. Registered buffers (rotary tables) are not weights."""
    storages: dict[int, int] = {}
    packed: dict[int, int] = {}

    def visit(value: Any) -> None:
        if isinstance(value, torch.Tensor):
            if value.device.type == "meta" or not value.numel():
                return
            try:
                storage = value.untyped_storage()
            except NotImplementedError:  # a oneDNN/MKL-packed weight: opaque, its own memory
                storages[id(value)] = value.numel() * value.element_size()
                return
            storages[storage.data_ptr()] = storage.nbytes()
        elif hasattr(value, "nbytes") and hasattr(value, "dequantize"):
            packed[id(value)] = int(value.nbytes)
        elif isinstance(value, (list, tuple)):
            for item in value:
                visit(item)

    for module in model.modules():
        # registered buffers (the rotary tables) are not weights
        for value in (*module._parameters.values(), *vars(module).values()):
            visit(value)
    return sum(storages.values()) + sum(packed.values())


def gguf_tensor_bytes(path: Path) -> int:
    from gguf import GGUFReader

    return sum(int(t.n_bytes) for t in GGUFReader(str(path), "r").tensors)


def peak_rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def child(spec: dict[str, Any]) -> dict[str, Any]:
    """One configuration in this process: load, measure, generate (and score, for quality)."""
    from engine import LLM, SamplingParams
    from engine.runner.quality import teacher_forced_agreement

    torch.set_num_threads(spec["threads"])
    common = dict(device="cpu", num_threads=spec["threads"])
    start = time.perf_counter()
    llm = LLM(spec["model"], quantization=spec["quantization"], dtype=spec["dtype"], **common)
    load_s = time.perf_counter() - start
    runner = llm.engine.model_runner
    if not spec.get("greedy_screen", True):
        runner.greedy_screen = None
    prompts, max_tokens = workload(llm.tokenizer, spec["num_requests"], spec["seed"],
                                   spec["max_output"])
    result: dict[str, Any] = {
        "load_s": load_s, "dtype": str(runner.dtype).removeprefix("torch."),
        "weight_bytes": resident_weight_bytes(runner.model), "rss_after_load_mib": peak_rss_mib(),
    }
    if spec["task"] == "quality":
        reference = LLM(spec["model"], quantization="dequantize", dtype="float32", **common)
        prompts, max_tokens = prompts[:spec["quality_requests"]], max_tokens[:spec[
            "quality_requests"]]
        params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True)
                  for m in max_tokens]
        outputs = reference.generate(prompts, params)
        sequences = [(p, list(o.token_ids)) for p, o in zip(prompts, outputs, strict=True)]
        report = teacher_forced_agreement(reference.engine.model_runner, runner, sequences)
        result.update(positions=report.num_positions, agreement=report.agreement,
                      mean_abs_delta_logprob=report.mean_abs_delta_logprob)
        return result
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in max_tokens]
    llm.generate([prompts[0]], SamplingParams(temperature=0.0, max_tokens=2))  # warm up
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    seconds = time.perf_counter() - start
    result.update(seconds=seconds, output_tokens=sum(len(o.token_ids) for o in outputs),
                  peak_rss_mib=peak_rss_mib(),
                  outputs=[list(o.token_ids) for o in outputs])
    return result


def run_child(spec: dict[str, Any]) -> dict[str, Any]:
    command = [sys.executable, "-m", "bench.quantized", "--child", json.dumps(spec)]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{spec['quantization']} on {spec['model']} failed:\n"
                           f"{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def run_llamacpp(args: argparse.Namespace, model_path: Path, spec: dict[str, Any]
                 ) -> dict[str, Any] | str:
    from bench import llamacpp
    from engine.checkpoint.tokenizer import load_tokenizer

    venv = Path(args.llamacpp_venv).expanduser()
    skipped = llamacpp.ensure_venv(venv, allow_build=not args.llamacpp_no_build)
    if skipped is not None:
        return skipped.reason
    gguf = llamacpp.gguf_file(model_path)
    if gguf is None:
        return f"{model_path} has no GGUF file"
    prompts, max_tokens = workload(load_tokenizer(gguf), spec["num_requests"], spec["seed"],
                                   spec["max_output"])
    run = llamacpp.run(venv, model=gguf, prompts=prompts, max_tokens=max_tokens,
                       parallel=args.llamacpp_parallel, threads=args.threads)
    if isinstance(run, llamacpp.Skipped):
        return run.reason
    return {"seconds": run.seconds, "output_tokens": sum(len(o) for o in run.outputs)}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.quantized",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="default,gemma-3-270m",
                        help=f"comma-separated, of {sorted(MODELS)} or any model reference")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--quality-requests", type=int, default=16)
    parser.add_argument("--max-output", type=int, default=256,
                        help="output tokens a request at most (drawn from 64..this)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", default="auto", help="the activations' dtype (both paths)")
    parser.add_argument("--skip-quality", action="store_true")
    parser.add_argument("--unscreened", action="store_true",
                        help="also run keep with the greedy screen off (the full head product)")
    parser.add_argument("--llamacpp", action="store_true",
                        help="also run llama.cpp (builds llama-cpp-python once: many minutes)")
    parser.add_argument("--llamacpp-venv", default=None)
    parser.add_argument("--llamacpp-no-build", action="store_true")
    parser.add_argument("--llamacpp-parallel", type=int, default=16)
    parser.add_argument("--json", default=None, help="write the figures here")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.llamacpp_venv is None:
        from bench import llamacpp

        args.llamacpp_venv = str(llamacpp.DEFAULT_VENV)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child is not None:
        result = child(json.loads(args.child))
        print(json.dumps(result))
        return 0
    from engine.checkpoint.loader import load_checkpoint
    from engine.checkpoint.model_cache import pull

    figures: dict[str, Any] = {}
    failed = False
    for name in args.models.split(","):
        reference = MODELS.get(name, name)
        path = pull(reference) if reference in MODELS.values() else Path(reference)
        source = load_checkpoint(str(path)).source or path
        ggml_bytes = gguf_tensor_bytes(source)
        spec = {"model": str(path), "threads": args.threads, "num_requests": args.num_requests,
                "seed": args.seed, "dtype": args.dtype, "task": "throughput",
                "max_output": args.max_output,
                "quality_requests": args.quality_requests}
        runs = {mode: run_child({**spec, "quantization": mode})
                for mode in ("keep", "dequantize")}
        if args.unscreened:
            runs["keep, no screen"] = run_child({**spec, "quantization": "keep",
                                                 "greedy_screen": False})
        keep, dense = runs["keep"], runs["dequantize"]
        tok_s = {mode: r["output_tokens"] / r["seconds"] for mode, r in runs.items()}
        same = sum(a == b for a, b in zip(keep["outputs"], dense["outputs"], strict=True))
        model: dict[str, Any] = {
            "gguf_tensor_bytes": ggml_bytes,
            "runs": {m: {k: v for k, v in r.items() if k != "outputs"} for m, r in runs.items()},
            "tok_s": tok_s, "bytes_ratio": keep["weight_bytes"] / ggml_bytes,
            "keep/dequantize": tok_s["keep"] / tok_s["dequantize"],
            "identical_outputs": same,
        }
        print(f"\n== {reference} ({source.name}; {ggml_bytes / 2**20:.1f} MiB of tensors), "
              f"{args.threads} threads, {args.num_requests} requests, activations "
              f"{keep['dtype']}")
        for mode, r in runs.items():
            print(f"  {mode:15} weights {r['weight_bytes'] / 2**20:8.1f} MiB "
                  f"({r['weight_bytes'] / ggml_bytes:.2f}x the GGUF's), peak RSS "
                  f"{r['peak_rss_mib']:7.1f} MiB, load {r['load_s']:5.1f} s, "
                  f"{tok_s[mode]:7.1f} out tok/s")
        print(f"  keep / dequantize: {model['keep/dequantize']:.2f}x (target >= "
              f"{TARGETS['keep/dequantize']}); weight bytes {model['bytes_ratio']:.2f}x the "
              f"GGUF's (target <= {TARGETS['bytes']}); {same}/{len(keep['outputs'])} requests' "
              "greedy tokens identical")
        failed |= model["bytes_ratio"] > TARGETS["bytes"]
        failed |= model["keep/dequantize"] < TARGETS["keep/dequantize"]
        if args.llamacpp:
            ran = run_llamacpp(args, path, spec)
            if isinstance(ran, str):
                print(f"  llama.cpp: skipped ({ran})")
            else:
                llama_tok_s = ran["output_tokens"] / ran["seconds"]
                model["llama.cpp_tok_s"] = llama_tok_s
                model["keep/llama.cpp"] = tok_s["keep"] / llama_tok_s
                print(f"  llama.cpp {args.llamacpp_parallel} in flight: {llama_tok_s:.1f} out "
                      f"tok/s; keep / llama.cpp {model['keep/llama.cpp']:.2f}x (target >= "
                      f"{TARGETS['keep/llama.cpp']})")
                failed |= model["keep/llama.cpp"] < TARGETS["keep/llama.cpp"]
        if not args.skip_quality:
            quality = run_child({**spec, "task": "quality", "quantization": "keep"})
            model["quality"] = quality
            print(f"  quality: keep ({quality['dtype']}) top-1 agreement with the dequantized "
                  f"fp32 engine {quality['agreement']:.2%} over {quality['positions']} "
                  f"teacher-forced positions (target >= {TARGETS['agreement']:.0%}); mean "
                  f"|delta logprob| {quality['mean_abs_delta_logprob']:.4f}")
            failed |= quality["agreement"] < TARGETS["agreement"]
            if quality["dtype"] != "float32":
                # the activations' dtype alone: the dense path's own agreement in that dtype
                dense_quality = run_child({**spec, "task": "quality",
                                           "quantization": "dequantize"})
                model["quality_dequantized"] = dense_quality
                print(f"  for the dtype: dequantize ({dense_quality['dtype']}) "
                      f"{dense_quality['agreement']:.2%} on the same positions")
        figures[reference] = model
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2) + "\n")
    print(f"\nCPU: {os.cpu_count()} cores; targets {'met' if not failed else 'NOT all met'}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
