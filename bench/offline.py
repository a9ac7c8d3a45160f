"""Offline throughput: boxcar against three transformers baselines on one fixed workload.

``python -m bench.offline [--quick] [--num-requests 64] [--json PATH]``

The workload is seeded and fixed: chat prompts of ~30-400 tokens (the model's chat template over
synthetic text), 16-256 greedy output tokens each, EOS ignored so every system does the same work.
It runs through (a) boxcar's ``LLM.generate``, (b) transformers one request at a time, (c)
transformers in static left-padded batches of 16 sorted by length, (d) transformers' continuous
batching (the manager behind ``generate_batch``, fed request by request because ``generate_batch``
takes one ``max_new_tokens`` for all). Every boxcar output is compared token for token with each
baseline. A roofline line relates boxcar's model FLOP/s to this machine's fp32 matmul peak,
measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from engine.model_cache import DEFAULT_MODEL

WORDS = (
    "the of and to in is was for on that with as by at from it this be are or an have not but "
    "which one all were when there can more has been if would will so what about into than them "
    "time people year way day man thing woman life child world school state family student group "
    "country problem hand part place case week company system program question work government "
    "number night point home water room mother area money story fact month lot right study book "
    "eye job word business issue side kind head house service friend father power hour game line "
    "batch token cache block engine request prompt river mountain window garden music science"
).split()


@dataclass
class Workload:
    prompts: list[list[int]]  # chat-templated token ids
    max_tokens: list[int]

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def num_output_tokens(self) -> int:
        return sum(self.max_tokens)


@dataclass
class Result:
    name: str
    num_requests: int
    num_prompt_tokens: int
    num_output_tokens: int
    seconds: float
    outputs: dict[int, list[int]] = field(default_factory=dict, repr=False)  # request -> ids
    note: str = ""

    @property
    def output_tokens_per_s(self) -> float:
        return self.num_output_tokens / self.seconds if self.seconds else 0.0

    @property
    def total_tokens_per_s(self) -> float:
        total = self.num_prompt_tokens + self.num_output_tokens
        return total / self.seconds if self.seconds else 0.0


def make_workload(tokenizer: Any, *, num_requests: int, prompt_range: tuple[int, int],
                  output_range: tuple[int, int], seed: int = 0) -> Workload:
    """Seeded chat prompts of about ``prompt_range`` tokens, outputs of ``output_range`` tokens."""
    rng = random.Random(seed)
    overhead = len(_template(tokenizer, ""))
    prompts, max_tokens = [], []
    for _ in range(num_requests):
        target = rng.randint(*prompt_range)
        text = " ".join(rng.choice(WORDS) for _ in range(target))
        content_ids = tokenizer(text, add_special_tokens=False).input_ids
        text = tokenizer.decode(content_ids[: max(target - overhead, 1)])
        prompts.append(_template(tokenizer, text))
        max_tokens.append(rng.randint(*output_range))
    return Workload(prompts, max_tokens)


def _template(tokenizer: Any, text: str) -> list[int]:
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True,
        return_dict=False,
    )
    return list(ids["input_ids"] if isinstance(ids, dict) else ids)


# --- the systems --------------------------------------------------------------------------------


def run_boxcar(llm: Any, workload: Workload) -> tuple[Result, dict[str, Any]]:
    from engine import SamplingParams

    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True)
              for m in workload.max_tokens]
    llm.generate([workload.prompts[0]], SamplingParams(temperature=0.0, max_tokens=2))  # warm up
    before = llm.engine.get_stats()
    start = time.perf_counter()
    outputs = llm.generate(workload.prompts, params)
    seconds = time.perf_counter() - start
    after = llm.engine.get_stats()
    result = Result("boxcar LLM.generate", len(workload.prompts), workload.num_prompt_tokens,
                    sum(len(o.token_ids) for o in outputs), seconds,
                    {i: list(o.token_ids) for i, o in enumerate(outputs)})
    batched = sum(k * v for k, v in after.scheduled_tokens_hist.items()) - sum(
        k * v for k, v in before.scheduled_tokens_hist.items()
    )
    work = {
        "processed_tokens": batched,
        "sampled_tokens": after.num_generated_tokens - before.num_generated_tokens,
        "cached_tokens": [o.metrics.num_cached_tokens for o in outputs],
        "num_preemptions": after.num_preemptions - before.num_preemptions,
        "prefix_cache_hit_rate": after.prefix_cache_hit_rate,
    }
    return result, work


def _greedy_config(max_new_tokens: int, pad_token_id: int) -> Any:
    from transformers import GenerationConfig

    # No EOS at all, like boxcar's ignore_eos (EOS may be generated, it just does not stop).
    # min_new_tokens would instead forbid EOS and change the greedy choice.
    return GenerationConfig(do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=None,
                            pad_token_id=pad_token_id)


def run_hf_single(model: Any, workload: Workload, pad_id: int, subset: int | None) -> Result:
    indices = list(range(len(workload.prompts)))[: subset or None]
    _hf_generate(model, [workload.prompts[0]], 2, pad_id)  # warm up
    outputs = {}
    start = time.perf_counter()
    for i in indices:
        outputs[i] = _hf_generate(model, [workload.prompts[i]], workload.max_tokens[i], pad_id)[0]
    seconds = time.perf_counter() - start
    note = ""
    if len(indices) < len(workload.prompts):
        note = f"measured on {len(indices)} of {len(workload.prompts)} requests; rate extrapolated"
    return Result("HF one at a time", len(indices), sum(len(workload.prompts[i]) for i in indices),
                  sum(workload.max_tokens[i] for i in indices), seconds, outputs, note)


def run_hf_static(model: Any, workload: Workload, pad_id: int, batch_size: int) -> Result:
    order = sorted(range(len(workload.prompts)), key=lambda i: len(workload.prompts[i]))
    _hf_generate(model, [workload.prompts[0]], 2, pad_id)
    outputs = {}
    start = time.perf_counter()
    for at in range(0, len(order), batch_size):
        batch = order[at: at + batch_size]
        longest = max(workload.max_tokens[i] for i in batch)
        generated = _hf_generate(model, [workload.prompts[i] for i in batch], longest, pad_id)
        for i, ids in zip(batch, generated, strict=True):
            outputs[i] = ids[: workload.max_tokens[i]]  # what ran past a request's end is waste
    seconds = time.perf_counter() - start
    return Result(f"HF static batches of {batch_size}", len(order), workload.num_prompt_tokens,
                  workload.num_output_tokens, seconds, outputs, "padded, sorted by length")


@torch.inference_mode()
def _hf_generate(model: Any, prompts: list[list[int]], max_new_tokens: int,
                 pad_id: int) -> list[list[int]]:
    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):  # left padding
        input_ids[row, width - len(prompt):] = torch.tensor(prompt)
        attention_mask[row, width - len(prompt):] = 1
    out = model.generate(input_ids=input_ids, attention_mask=attention_mask,
                         generation_config=_greedy_config(max_new_tokens, pad_id))
    return [row[width:].tolist() for row in out]


def run_hf_continuous(model: Any, workload: Workload, pad_id: int, *, max_batch_tokens: int,
                      max_requests: int) -> Result:
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    page = 32
    blocks = sum(math.ceil((len(p) + m) / page) + 1
                 for p, m in zip(workload.prompts, workload.max_tokens, strict=True))
    config = ContinuousBatchingConfig(page_size=page, num_blocks=blocks,
                                      max_batch_tokens=max_batch_tokens,
                                      max_requests_per_batch=max_requests)
    outputs: dict[int, list[int]] = {}
    errors = 0
    with model.continuous_batching_context_manager(
        generation_config=_greedy_config(max(workload.max_tokens), pad_id),
        continuous_batching_config=config, warmup=False,
    ) as manager:
        _collect(manager, {manager.add_request(workload.prompts[0], max_new_tokens=2,
                                               eos_token_id=-1): 0})  # warm up
        start = time.perf_counter()
        ids = {
            manager.add_request(p, max_new_tokens=m, eos_token_id=-1): i
            for i, (p, m) in enumerate(zip(workload.prompts, workload.max_tokens, strict=True))
        }
        outputs, errors = _collect(manager, ids)
        seconds = time.perf_counter() - start
    note = "the generate_batch manager, per-request max_new_tokens"
    if errors:
        note += f"; {errors} requests failed"
    return Result("HF continuous batching", len(workload.prompts), workload.num_prompt_tokens,
                  sum(len(o) for o in outputs.values()), seconds, outputs, note)


def _collect(manager: Any, ids: dict[str, int]) -> tuple[dict[int, list[int]], int]:
    outputs, errors = {}, 0
    while len(outputs) + errors < len(ids):
        result = manager.get_result(timeout=1)
        if result is None:
            if not manager.is_running():
                break
            continue
        if result.is_finished() and result.request_id in ids:
            if result.error is not None:
                errors += 1
            else:
                outputs[ids[result.request_id]] = list(result.generated_tokens)
    return outputs, errors


# --- models, FLOPs and the peak ----------------------------------------------------------------


def load_hf_model(checkpoint: Any) -> tuple[Any, str]:
    """transformers' own loader (needs accelerate for GGUF), else the engine's weights."""
    from transformers import AutoModelForCausalLM

    path = checkpoint.path
    try:
        if checkpoint.is_gguf:
            model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                         dtype=torch.float32)
        else:
            model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
        how = "transformers from_pretrained"
    except (ImportError, ValueError) as exc:
        model = AutoModelForCausalLM.from_config(checkpoint.config, dtype=torch.float32)
        missing, unexpected = model.load_state_dict(
            dict(checkpoint.iter_weights(torch.float32)), strict=False
        )
        if unexpected or set(missing) - {"lm_head.weight"}:
            raise RuntimeError(f"weights do not fit: {missing=} {unexpected=}") from exc
        model.tie_weights()
        how = f"engine weights in a transformers model ({str(exc).splitlines()[0][:60]})"
    # generate() fills unset fields of the config it is given from the model's own, EOS included:
    # clear it there so no baseline stops early (boxcar runs with ignore_eos).
    model.generation_config.eos_token_id = None
    return model.eval(), how


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


def matmul_peak(size: int, repeats: int = 3) -> float:
    """Best fp32 FLOP/s of a few ``size`` x ``size`` matmuls."""
    a, b = torch.randn(size, size), torch.randn(size, size)
    torch.mm(a, b)
    best = 0.0
    for _ in range(repeats):
        start = time.perf_counter()
        torch.mm(a, b)
        best = max(best, 2 * size**3 / (time.perf_counter() - start))
    return best


def compare(engine: Result, baseline: Result) -> dict[str, Any]:
    """Requests whose tokens differ, with the first differing position of each."""
    diffs = {}
    for i, ids in baseline.outputs.items():
        mine = engine.outputs.get(i, [])
        if mine != ids:
            pairs = enumerate(zip(mine, ids, strict=False))
            diffs[i] = next((k for k, (x, y) in pairs if x != y), min(len(mine), len(ids)))
    return {"compared": len(baseline.outputs), "mismatching": len(diffs),
            "first_diff_position": diffs}


# --- main ---------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.offline", description=__doc__.split(
        "\n\n")[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--quick", action="store_true", help="8 short requests (a smoke test)")
    parser.add_argument("--num-requests", type=int, default=None)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--single-subset", type=int, default=None,
                        help="run the one-at-a-time baseline on the first N requests only")
    parser.add_argument("--static-batch-size", type=int, default=16)
    parser.add_argument("--max-num-seqs", type=int, default=128)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--matmul-size", type=int, default=None)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "auto"),
                        help="boxcar's dtype (the transformers baselines stay float32)")
    for name in ("hf-single", "hf-static", "hf-continuous"):
        parser.add_argument(f"--skip-{name}", action="store_true")
    parser.add_argument("--json", default=None, help="write the figures here")
    args = parser.parse_args(argv)

    from engine import LLM
    from engine.models.loader import load_checkpoint

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    num_requests = args.num_requests or (8 if args.quick else 64)
    prompt_range, output_range = ((30, 100), (8, 32)) if args.quick else ((30, 400), (16, 256))
    llm = LLM(args.model, dtype=args.dtype, device="cpu", num_threads=args.threads,
              max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens)
    workload = make_workload(llm.tokenizer, num_requests=num_requests, prompt_range=prompt_range,
                             output_range=output_range, seed=args.seed)
    print(f"workload: {num_requests} requests, {workload.num_prompt_tokens} prompt tokens, "
          f"{workload.num_output_tokens} output tokens, {args.threads} threads", flush=True)

    # The peak is taken right before boxcar's run and again at the end, and the higher one is
    # used: this machine's speed drifts over minutes, and the higher peak is the harder bar.
    peak_size = args.matmul_size or (1024 if args.quick else 2048)
    peak_before = matmul_peak(peak_size)
    boxcar, work = run_boxcar(llm, workload)
    print(f"boxcar done in {boxcar.seconds:.1f}s", flush=True)
    checkpoint = load_checkpoint(args.model)
    results = [boxcar]
    wanted = [not args.skip_hf_single, not args.skip_hf_static, not args.skip_hf_continuous]
    how = "-"
    if any(wanted):
        model, how = load_hf_model(checkpoint)
        pad_id = llm.tokenizer.pad_token_id
        pad_id = llm.tokenizer.eos_token_id if pad_id is None else pad_id
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

    peak = max(peak_before, matmul_peak(peak_size))
    flops = model_flops(checkpoint.config, work, workload)
    report = _report(results, peak, flops / boxcar.seconds, work, how)
    print(report["text"])
    if args.json:
        Path(args.json).write_text(json.dumps(report["figures"], indent=2) + "\n")
    return 0


def _report(results: list[Result], peak: float, achieved: float, work: dict[str, Any],
            hf_loader: str) -> dict[str, Any]:
    boxcar = results[0]
    lines = [f"{'system':<32}{'requests':>9}{'out tok':>9}{'seconds':>9}{'out tok/s':>11}"
             f"{'total tok/s':>13}"]
    figures: dict[str, Any] = {"systems": {}, "ratios": {}, "correctness": {}}
    for r in results:
        lines.append(f"{r.name:<32}{r.num_requests:>9}{r.num_output_tokens:>9}{r.seconds:>9.1f}"
                     f"{r.output_tokens_per_s:>11.1f}{r.total_tokens_per_s:>13.1f}"
                     + (f"  ({r.note})" if r.note else ""))
        figures["systems"][r.name] = {k: v for k, v in asdict(r).items() if k != "outputs"} | {
            "output_tokens_per_s": r.output_tokens_per_s,
            "total_tokens_per_s": r.total_tokens_per_s,
        }
    lines.append("")
    for r in results[1:]:
        ratio = boxcar.output_tokens_per_s / r.output_tokens_per_s if r.seconds else math.nan
        figures["ratios"][f"boxcar/{r.name}"] = ratio
        check = compare(boxcar, r)
        figures["correctness"][r.name] = check
        detail = ", ".join(f"request {i} at token {pos}"
                           for i, pos in list(check["first_diff_position"].items())[:8])
        lines.append(f"boxcar / {r.name:<28} {ratio:6.2f}x   tokens: {check['mismatching']} of "
                     f"{check['compared']} requests differ" + (f" ({detail})" if detail else ""))
    fraction = achieved / peak if peak else 0.0
    figures["roofline"] = {"fp32_matmul_peak_flops": peak, "boxcar_model_flops": achieved,
                           "fraction_of_peak": fraction, **{k: v for k, v in work.items()
                                                           if k != "cached_tokens"}}
    figures["hf_loader"] = hf_loader
    lines.append(
        f"roofline: fp32 matmul peak {peak / 1e9:.1f} GFLOP/s; boxcar {achieved / 1e9:.1f} "
        f"GFLOP/s of model work = {fraction:.1%} of peak ({work['processed_tokens']} tokens "
        f"processed, {work['num_preemptions']} preemptions, prefix cache hit rate "
        f"{work['prefix_cache_hit_rate']:.1%})"
    )
    lines.append(f"transformers model: {hf_loader}")
    return {"text": "\n".join(lines), "figures": figures}


if __name__ == "__main__":
    raise SystemExit(main())
