"""Offline throughput: boxcar in fp32 and bf16 against transformers and llama.cpp, one workload.

``python -m bench.offline [--quick] [--num-requests 64] [--dtypes float32,bfloat16] [--llamacpp]
[--json PATH]``

The workload is seeded and fixed: chat prompts of ~30-400 tokens (the model's chat template over
synthetic text), 16-256 greedy output tokens each, EOS ignored so every system does the same work.
It runs through (a) boxcar's ``LLM.generate`` in each of ``--dtypes``, (b) transformers one
request at a time, (c) transformers in static left-padded batches of 16 sorted by prompt length
(the fair static baseline: sorting keeps the padding small), (d) transformers' continuous
batching (the manager behind ``generate_batch``, fed request by request because
``generate_batch`` takes one ``max_new_tokens`` for all), and with ``--llamacpp`` (e) llama.cpp
on the same GGUF file, 16 requests in flight (``bench/llamacpp.py``). Every output is compared
token for token with boxcar fp32's (the exact mode); the ratios of one run are printed with their
targets. Each boxcar run is set against a floor measured in the same run
(``bench/roofline.py``): the model's own GEMM shapes at each step's row count, timed here in that
dtype, plus weight and KV bytes at the measured copy bandwidth.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from bench import llamacpp
from bench.roofline import (
    DTYPES,
    SCREEN_DTYPE,
    Floor,
    GemmTable,
    ModelShapes,
    Step,
    floor,
    measure_copy_bandwidth,
    measure_gemms,
    record_steps,
)
from bench.workload import Result, Workload, compare, make_workload
from engine.checkpoint.model_cache import DEFAULT_MODEL

# Targets from the engine's issue; printed beside the ratios they apply to.
TARGETS = {("boxcar bfloat16", "boxcar float32"): 1.8, ("boxcar float32", "HF static"): 3.0}
ROOFLINE_GOAL = 0.70


def run_boxcar(llm: Any, workload: Workload, name: str
               ) -> tuple[Result, dict[str, Any], list[Step]]:
    from engine import SamplingParams

    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True)
              for m in workload.max_tokens]
    llm.generate([workload.prompts[0]], SamplingParams(temperature=0.0, max_tokens=2))  # warm up
    before = llm.engine.get_stats()
    with record_steps(llm.engine.scheduler) as steps:
        start, cpu_start = time.perf_counter(), time.process_time()
        outputs = llm.generate(workload.prompts, params)
        seconds = time.perf_counter() - start
        cpu_seconds = time.process_time() - cpu_start
    after = llm.engine.get_stats()
    result = Result(name, len(workload.prompts), workload.num_prompt_tokens,
                    sum(len(o.token_ids) for o in outputs), seconds,
                    {i: list(o.token_ids) for i, o in enumerate(outputs)})
    work = {
        "processed_tokens": sum(s.num_tokens for s in steps),
        "sampled_tokens": after.num_generated_tokens - before.num_generated_tokens,
        "cached_tokens": [o.metrics.num_cached_tokens for o in outputs],
        "num_preemptions": after.num_preemptions - before.num_preemptions,
        "prefix_cache_hit_rate": after.prefix_cache_hit_rate,
        # all threads of the process: on a shared machine, the figure that sharing moves least
        # (OpenMP threads spin while they wait for a descheduled peer, so it still grows)
        "cpu_seconds": cpu_seconds,
    }
    return result, work, steps


def model_flops(config: Any, work: dict[str, Any], workload: Workload) -> float:
    """2*non-embedding params*processed tokens + 2*vocab*hidden*sampled tokens + attention."""
    hidden, layers = config.hidden_size, config.num_hidden_layers
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    per_layer = (hidden * heads * head_dim * 2 + hidden * kv_heads * head_dim * 2
                 + 3 * hidden * config.intermediate_size + 2 * hidden)
    params = layers * per_layer + hidden
    # Attention: QK^T and AV, 2 * context * hidden each, for every token computed (a cached
    # prefix is not recomputed; preemption recompute is left out).
    contexts = 0
    for prompt, m, cached in zip(workload.prompts, workload.max_tokens, work["cached_tokens"],
                                 strict=True):
        last = len(prompt) + m - 1  # the final sampled token is never fed back
        contexts += (last * (last + 1) - cached * (cached + 1)) // 2
    return (2 * params * work["processed_tokens"]
            + 2 * config.vocab_size * hidden * work["sampled_tokens"]
            + 4 * hidden * layers * contexts)


def measure_tables(shapes: ModelShapes, dtypes: list[str], *, max_tokens: int,
                   max_sampled: int, **timing: Any) -> dict[str, GemmTable]:
    """The layers' GEMMs in each run dtype, and the output layer in each run dtype and in the
    screen's dtype (the floor takes the cheaper)."""
    tables = {d: measure_gemms(shapes.layer_gemms, d, max_tokens, **timing) for d in dtypes}
    for d in {*dtypes, SCREEN_DTYPE}:
        head = measure_gemms((shapes.lm_head,), d, max_sampled, **timing)
        tables.setdefault(d, GemmTable(d)).seconds.update(head.seconds)
    return tables


def run_llamacpp(args: argparse.Namespace, checkpoint_path: Path, workload: Workload
                 ) -> Result | llamacpp.Skipped:
    gguf = llamacpp.gguf_file(checkpoint_path)
    if gguf is None:
        return llamacpp.Skipped(f"the model {args.model} has no GGUF file for llama.cpp")
    venv = Path(args.llamacpp_venv).expanduser()
    skipped = llamacpp.ensure_venv(venv, allow_build=not args.llamacpp_no_build)
    if skipped is not None:
        return skipped
    run = llamacpp.run(venv, model=gguf, prompts=workload.prompts,
                       max_tokens=workload.max_tokens, parallel=args.llamacpp_parallel,
                       threads=args.threads)
    if isinstance(run, llamacpp.Skipped):
        return run
    return Result(f"llama.cpp {args.llamacpp_parallel} in flight", len(workload.prompts),
                  workload.num_prompt_tokens, sum(len(o) for o in run.outputs), run.seconds,
                  dict(enumerate(run.outputs)),
                  f"llama-cpp-python {run.version}, {gguf.name}, batched llama_decode, argmax"
                  + ("" if run.extra_buffer_types else
                     "; without ggml's extra CPU weight layouts (it crashed with them)"))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.offline", description=__doc__.split(
        "\n\n")[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--quick", action="store_true", help="8 short requests (a smoke test)")
    parser.add_argument("--num-requests", type=int, default=None)
    parser.add_argument("--dtypes", default="float32,bfloat16",
                        help="comma-separated boxcar dtypes to run, in order (float32, bfloat16)")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--single-subset", type=int, default=None,
                        help="run the one-at-a-time baseline on the first N requests only")
    parser.add_argument("--static-batch-size", type=int, default=16)
    parser.add_argument("--max-num-seqs", type=int, default=128)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    for name in ("hf-single", "hf-static", "hf-continuous"):
        parser.add_argument(f"--skip-{name}", action="store_true")
    parser.add_argument("--llamacpp", action="store_true",
                        help="run llama.cpp on the same GGUF too (builds its venv when absent)")
    parser.add_argument("--llamacpp-venv", default=str(llamacpp.DEFAULT_VENV))
    parser.add_argument("--llamacpp-no-build", action="store_true",
                        help="skip llama.cpp instead of building its venv when it is absent")
    parser.add_argument("--llamacpp-parallel", type=int, default=16,
                        help="requests llama.cpp keeps in flight")
    parser.add_argument("--no-roofline", action="store_true",
                        help="skip the GEMM and bandwidth measurements")
    parser.add_argument("--json", default=None, help="write the figures here")
    args = parser.parse_args(argv)
    args.dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    unknown = [d for d in args.dtypes if d not in DTYPES]
    if unknown or not args.dtypes or len(set(args.dtypes)) != len(args.dtypes):
        parser.error(f"--dtypes: give distinct values from {sorted(DTYPES)}, got {args.dtypes}")
    for name in ("threads", "static_batch_size", "llamacpp_parallel", "max_num_seqs",
                 "max_num_batched_tokens"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from engine import LLM
    from engine.checkpoint.loader import load_checkpoint

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    num_requests = args.num_requests or (8 if args.quick else 64)
    prompt_range, output_range = ((30, 100), (8, 32)) if args.quick else ((30, 400), (16, 256))
    checkpoint = load_checkpoint(args.model)
    shapes = ModelShapes.from_config(checkpoint.config)

    # --quick is a smoke test: shorter timing loops and a smaller copy, a rougher floor.
    timing = {"min_seconds": 0.005, "repeats": 3} if args.quick else {}
    copy_bytes = (64 if args.quick else 256) << 20

    def measure() -> tuple[dict[str, GemmTable], float]:
        print("roofline: timing the model's GEMMs and a copy", flush=True)
        return (measure_tables(shapes, args.dtypes, max_tokens=args.max_num_batched_tokens,
                               max_sampled=args.max_num_seqs, **timing),
                measure_copy_bandwidth(copy_bytes))

    # The floor's inputs are measured before the runs and again at the end, and the faster of
    # each is used: this machine's speed drifts over minutes, and the faster is the harder bar.
    measured_before = None if args.no_roofline else measure()
    boxcars: list[tuple[Result, dict[str, Any], list[Step]]] = []
    workload: Workload | None = None
    pad_id = 0
    for dtype in args.dtypes:
        llm = LLM(args.model, dtype=dtype, device="cpu", num_threads=args.threads,
                  max_num_seqs=args.max_num_seqs,
                  max_num_batched_tokens=args.max_num_batched_tokens)
        if workload is None:
            workload = make_workload(llm.tokenizer, num_requests=num_requests,
                                     prompt_range=prompt_range, output_range=output_range,
                                     seed=args.seed)
            print(f"workload: {num_requests} requests, {workload.num_prompt_tokens} prompt "
                  f"tokens, {workload.num_output_tokens} output tokens, {args.threads} threads",
                  flush=True)
            pad_id = llm.tokenizer.pad_token_id
            pad_id = llm.tokenizer.eos_token_id if pad_id is None else pad_id
        boxcars.append(run_boxcar(llm, workload, f"boxcar {dtype}"))
        print(f"boxcar {dtype} done in {boxcars[-1][0].seconds:.1f}s", flush=True)
        del llm
        gc.collect()
    assert workload is not None  # parse_args guarantees one dtype at least
    results = [r for r, _, _ in boxcars]

    wanted = [not args.skip_hf_single, not args.skip_hf_static, not args.skip_hf_continuous]
    how = "-"
    if any(wanted):
        from bench.transformers_baselines import (
            load_hf_model,
            run_hf_continuous,
            run_hf_single,
            run_hf_static,
        )

        model, how = load_hf_model(checkpoint)
        runs = [
            lambda: run_hf_single(model, workload, pad_id, args.single_subset),
            lambda: run_hf_static(model, workload, pad_id, args.static_batch_size),
            lambda: run_hf_continuous(model, workload, pad_id,
                                      max_batch_tokens=args.max_num_batched_tokens,
                                      max_requests=args.max_num_seqs),
        ]
        for run, want in zip(runs, wanted, strict=True):
            if want:
                results.append(run())
                print(f"{results[-1].name} done in {results[-1].seconds:.1f}s", flush=True)
        del model
        gc.collect()

    skipped: dict[str, str] = {}
    if args.llamacpp:
        # A GGUF model runs from its converted folder; llama.cpp reads the .gguf it came from.
        done = run_llamacpp(args, checkpoint.source or checkpoint.path, workload)
        if isinstance(done, llamacpp.Skipped):
            skipped["llama.cpp"] = done.reason
            print(f"llama.cpp skipped: {done.reason}", flush=True)
        else:
            results.append(done)
            print(f"{done.name} done in {done.seconds:.1f}s", flush=True)

    roofline: dict[str, Any] = {}
    if measured_before is not None:
        tables_before, bandwidth_before = measured_before
        tables_after, bandwidth_after = measure()
        tables = {d: t.merge_best(tables_after[d]) for d, t in tables_before.items()}
        bandwidth = max(bandwidth_before, bandwidth_after)
        roofline = {"copy_bandwidth": bandwidth, "floors": {
            result.name: floor(steps, shapes, dtype, tables, bandwidth)
            for dtype, (result, _, steps) in zip(args.dtypes, boxcars, strict=True)
        }, "best_gemm_flops": {d: tables[d].best_flops(shapes.layer_gemms)
                               for d in args.dtypes}}
    flops = {r.name: model_flops(checkpoint.config, work, workload) / r.seconds
             for r, work, _ in boxcars}
    report = _report(results, roofline, flops, {r.name: w for r, w, _ in boxcars}, how, skipped,
                     args.threads)
    print(report["text"])
    if args.json:
        Path(args.json).write_text(json.dumps(report["figures"], indent=2) + "\n")
    return 0


def _ratio(a: Result, b: Result) -> float:
    return a.output_tokens_per_s / b.output_tokens_per_s if b.output_tokens_per_s else math.nan


def _target(a: str, b: str) -> float | None:
    return next((t for (x, y), t in TARGETS.items() if a == x and b.startswith(y)), None)


def _report(results: list[Result], roofline: dict[str, Any], model_flops_per_s: dict[str, float],
            works: dict[str, dict[str, Any]], hf_loader: str,
            skipped: dict[str, str], threads: int = 1) -> dict[str, Any]:
    boxcars = [r for r in results if r.name in works]
    others = [r for r in results if r.name not in works]
    # Tokens are checked against the exact mode when it ran, else the first boxcar run.
    reference = next((r for r in boxcars if r.name == "boxcar float32"), boxcars[0])
    lines = [f"{'system':<34}{'requests':>9}{'out tok':>9}{'seconds':>9}{'out tok/s':>11}"
             f"{'total tok/s':>13}"]
    figures: dict[str, Any] = {"systems": {}, "ratios": {}, "targets": {}, "correctness": {},
                               "skipped": skipped, "hf_loader": hf_loader}
    for r in results:
        lines.append(f"{r.name:<34}{r.num_requests:>9}{r.num_output_tokens:>9}{r.seconds:>9.1f}"
                     f"{r.output_tokens_per_s:>11.1f}{r.total_tokens_per_s:>13.1f}"
                     + (f"  ({r.note})" if r.note else ""))
        figures["systems"][r.name] = {k: v for k, v in asdict(r).items() if k != "outputs"} | {
            "output_tokens_per_s": r.output_tokens_per_s,
            "total_tokens_per_s": r.total_tokens_per_s,
        }
    for name, reason in skipped.items():
        lines.append(f"{name:<34}skipped: {reason}")
    lines.append("")
    pairs = [(a, b) for i, a in enumerate(boxcars) for b in boxcars[:i]]  # bf16 / fp32
    pairs += [(a, b) for a in boxcars for b in others]
    for a, b in pairs:
        key = f"{a.name} / {b.name}"
        ratio = _ratio(a, b)
        figures["ratios"][key] = ratio
        target = _target(a.name, b.name)
        goal = ""
        if target is not None:
            figures["targets"][key] = target
            goal = f"(target >= {target:g}x: {'met' if ratio >= target else 'NOT met'})"
        tokens = ""
        if a is reference and b is not reference or b is reference and a is not reference:
            other = b if a is reference else a
            check = compare(reference, other)
            figures["correctness"][other.name] = check
            detail = ", ".join(f"request {i} at token {pos}"
                               for i, pos in list(check["first_diff_position"].items())[:6])
            tokens = (f"tokens vs {reference.name}: {check['mismatching']} of "
                      f"{check['compared']} requests differ" + (f" ({detail})" if detail else ""))
        lines.append(f"{key:<58}{ratio:7.2f}x  {goal:<30} {tokens}".rstrip())
    lines.append("")
    lines.extend(_cpu_lines(boxcars, works, threads))
    figures["cpu_seconds"] = {r.name: works[r.name]["cpu_seconds"] for r in boxcars}
    if roofline:
        lines.extend(_roofline_lines(roofline, boxcars, model_flops_per_s, works, figures))
    lines.append(f"transformers model: {hf_loader}")
    return {"text": "\n".join(lines), "figures": figures}


def _cpu_lines(boxcars: list[Result], works: dict[str, dict[str, Any]], threads: int
               ) -> list[str]:
    """CPU time of each boxcar run and the ratios of output tokens per CPU second: on a shared
    machine these move less than wall time. ``busy`` is CPU time over wall time x threads: near
    100% when the threads compute or spin (OpenMP threads spin at a barrier while a peer is
    descheduled), low when the run waits on something else."""
    lines = []
    for r in boxcars:
        cpu = works[r.name]["cpu_seconds"]
        busy = cpu / (r.seconds * threads) if r.seconds else 0.0
        per_cpu = r.num_output_tokens / cpu if cpu else 0.0
        lines.append(f"{r.name}: {cpu:.1f} CPU s ({busy:.0%} of {threads} threads' wall time), "
                     f"{per_cpu:.1f} out tok per CPU s")
    for i, a in enumerate(boxcars):
        for b in boxcars[:i]:
            ca, cb = works[a.name]["cpu_seconds"], works[b.name]["cpu_seconds"]
            if ca and cb:
                lines.append(f"{a.name} / {b.name} in out tok per CPU s: "
                             f"{(a.num_output_tokens / ca) / (b.num_output_tokens / cb):.2f}x")
    return [*lines, ""] if lines else []


def _roofline_lines(roofline: dict[str, Any], boxcars: list[Result],
                    model_flops_per_s: dict[str, float], works: dict[str, dict[str, Any]],
                    figures: dict[str, Any]) -> list[str]:
    bandwidth = roofline["copy_bandwidth"]
    best = ", ".join(f"{d} {f / 1e9:.0f}" for d, f in roofline["best_gemm_flops"].items())
    lines = [f"roofline: a floor from this run's measurements: the model's GEMMs at each step's "
             f"rows (best GFLOP/s at its shapes: {best}), copy bandwidth {bandwidth / 1e9:.1f} "
             f"GB/s (read + written) for weight and KV bytes"]
    figures["roofline"] = {"copy_bandwidth": bandwidth,
                           "best_gemm_flops": roofline["best_gemm_flops"], "runs": {}}
    for r in boxcars:
        f: Floor = roofline["floors"][r.name]
        reached = f.seconds / r.seconds if r.seconds else 0.0
        work = works[r.name]
        lines.append(
            f"  {r.name}: floor {f.seconds:.2f}s (linears {f.linears:.2f}, output layer "
            f"{f.lm_head:.2f}, attention {f.attention:.2f}) / run {r.seconds:.2f}s = "
            f"{reached:.1%} (goal >= {ROOFLINE_GOAL:.0%}: "
            f"{'met' if reached >= ROOFLINE_GOAL else 'NOT met'}); model work "
            f"{model_flops_per_s[r.name] / 1e9:.1f} GFLOP/s; {f.num_steps} steps, "
            f"{work['processed_tokens']} tokens processed, {work['num_preemptions']} preemptions")
        figures["roofline"]["runs"][r.name] = asdict(f) | {
            "floor_seconds": f.seconds, "run_seconds": r.seconds, "fraction_of_floor": reached,
            "model_flops_per_s": model_flops_per_s[r.name],
            **{k: v for k, v in work.items() if k != "cached_tokens"},
        }
    return lines


if __name__ == "__main__":
    raise SystemExit(main())
