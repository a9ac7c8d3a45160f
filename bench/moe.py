"""Mixture-of-experts throughput: boxcar against transformers on a random-weight Qwen3-MoE-like
model, with the share of a step spent in expert compute and the tokens each expert received.

``python -m bench.moe [--quick] [--num-requests 32] [--threads 2] [--experts 16] [--top-k 2]
[--hidden 512] [--json PATH]``

The model is Qwen3-MoE's shape scaled down (default: 16 experts, top-2, hidden 512, expert
intermediate 1024, 8 layers, 32k vocabulary), saved with a word-level tokenizer and a chat
template into a temporary folder. One seeded workload (``bench.workload``) runs through boxcar
fp32 (the exact mode), transformers in static batches of 16 sorted by prompt length, and
transformers' continuous batching (``generate_batch``'s manager); every output is compared token
for token with boxcar's. Expert compute is timed with hooks around each layer's experts (the
grouped GEMMs, activation and scatter); the router's choices are counted per expert.

Threads: transformers' continuous batching runs its model in a background thread, whose OpenMP
team is one thread whatever ``torch.set_num_threads`` said (its CPU time equals its wall time);
boxcar and the static batches use ``--threads``. On a machine shared with other jobs more
threads can be slower (each OpenMP region waits for a descheduled peer), so compare the CPU
seconds too, or run with ``--threads 1``.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from bench.workload import WORDS, Result, Workload, compare, make_workload

TARGET_VS_STATIC = 3.0
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }} "
    "{{ message['content'] }}<|im_end|> {% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant {% endif %}"
)


def build_model(folder: Path, *, experts: int, top_k: int, hidden: int, inter: int,
                layers: int, vocab: int) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen3MoeConfig, Qwen3MoeForCausalLM

    specials = ["<unk>", "<|im_start|>", "<|im_end|>", "user", "assistant"]
    words = specials + [w for w in dict.fromkeys(WORDS) if w not in specials]
    words += [f"w{i}" for i in range(vocab - len(words))]
    tok = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(words)},
                                     unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<unk>",
                            eos_token="<|im_end|>", chat_template=CHAT_TEMPLATE
                            ).save_pretrained(folder)
    config = Qwen3MoeConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * inter,
        moe_intermediate_size=inter, num_experts=experts, num_experts_per_tok=top_k,
        norm_topk_prob=True, num_hidden_layers=layers, num_attention_heads=8,
        num_key_value_heads=4, head_dim=64, max_position_embeddings=2048, rms_norm_eps=1e-6,
        tie_word_embeddings=False, eos_token_id=2, pad_token_id=0, initializer_range=0.05,
    )
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(config).float()
    print(f"model: {sum(p.numel() for p in model.parameters()) / 1e6:.0f}M parameters, "
          f"{experts} experts, top-{top_k}, hidden {hidden}, {layers} layers", flush=True)
    model.save_pretrained(folder)


class ExpertMeter:
    """Hooks on a boxcar model: seconds inside the experts, and tokens routed to each expert."""

    def __init__(self, model: torch.nn.Module) -> None:
        from engine.layers.moe import FusedExperts, TopKRouter

        self.seconds = 0.0
        self.counts: torch.Tensor | None = None
        self.cpu_seconds = 0.0  # the whole run's, all threads
        self.num_steps = 0
        self._start = 0.0
        self._handles = []
        for module in model.modules():
            if isinstance(module, FusedExperts):
                self._handles.append(module.register_forward_pre_hook(self._enter))
                self._handles.append(module.register_forward_hook(self._leave))
            elif isinstance(module, TopKRouter):
                self._handles.append(module.register_forward_hook(self._route))

    def _enter(self, module: Any, args: Any) -> None:
        self._start = time.perf_counter()

    def _leave(self, module: Any, args: Any, output: Any) -> None:
        self.seconds += time.perf_counter() - self._start

    def _route(self, module: Any, args: Any, output: tuple[torch.Tensor, torch.Tensor]) -> None:
        counts = torch.bincount(output[1].flatten(), minlength=module.config.num_experts)
        self.counts = counts if self.counts is None else self.counts + counts

    def reset(self) -> None:
        self.seconds, self.counts = 0.0, None

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()


def run_boxcar(folder: Path, workload: Workload, threads: int) -> tuple[Result, ExpertMeter]:
    from engine import LLM, SamplingParams

    llm = LLM(str(folder), dtype="float32", device="cpu", num_threads=threads)
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True)
              for m in workload.max_tokens]
    llm.generate([workload.prompts[0]], SamplingParams(temperature=0.0, max_tokens=2))
    meter = ExpertMeter(llm.engine.model_runner.model)
    meter.reset()
    steps_before = llm.engine.get_stats().num_steps
    start, cpu_start = time.perf_counter(), time.process_time()
    outputs = llm.generate(workload.prompts, params)
    seconds = time.perf_counter() - start
    meter.cpu_seconds = time.process_time() - cpu_start
    meter.num_steps = llm.engine.get_stats().num_steps - steps_before
    result = Result("boxcar float32", len(workload.prompts), workload.num_prompt_tokens,
                    sum(len(o.token_ids) for o in outputs), seconds,
                    {i: list(o.token_ids) for i, o in enumerate(outputs)},
                    f"{meter.num_steps} steps")
    meter.close()
    return result, meter


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="8 short requests, 4 layers")
    parser.add_argument("--num-requests", type=int, default=None)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--expert-intermediate", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--static-batch-size", type=int, default=16)
    parser.add_argument("--skip-hf-continuous", action="store_true")
    parser.add_argument("--json", type=Path, default=None)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    num_requests = args.num_requests or (8 if args.quick else 32)
    layers = args.layers or (4 if args.quick else 8)
    prompt_range, output_range = ((20, 60), (8, 24)) if args.quick else ((30, 300), (16, 128))
    with tempfile.TemporaryDirectory(prefix="bench-moe-") as tmp:
        folder = Path(tmp)
        build_model(folder, experts=args.experts, top_k=args.top_k, hidden=args.hidden,
                    inter=args.expert_intermediate, layers=layers, vocab=32000)
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(folder)
        workload = make_workload(tokenizer, num_requests=num_requests,
                                 prompt_range=prompt_range, output_range=output_range)
        print(f"workload: {num_requests} requests, {workload.num_prompt_tokens} prompt tokens, "
              f"{workload.num_output_tokens} output tokens, {args.threads} threads", flush=True)
        boxcar, meter = run_boxcar(folder, workload, args.threads)
        print(f"boxcar done in {boxcar.seconds:.1f}s", flush=True)
        results = [boxcar]

        from bench.transformers_baselines import run_hf_continuous, run_hf_static

        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        pad_id = tokenizer.pad_token_id
        cpu = {boxcar.name: meter.cpu_seconds}
        runs = [lambda: run_hf_static(model, workload, pad_id, args.static_batch_size)]
        if not args.skip_hf_continuous:
            runs.append(lambda: run_hf_continuous(model, workload, pad_id, max_batch_tokens=2048,
                                                  max_requests=128))
        for run in runs:
            cpu_start = time.process_time()
            try:
                results.append(run())
            except Exception as exc:  # noqa: BLE001 - a baseline that cannot run is reported
                print(f"a transformers baseline failed: {type(exc).__name__}: {exc}")
                continue
            cpu[results[-1].name] = time.process_time() - cpu_start
            print(f"{results[-1].name} done in {results[-1].seconds:.1f}s", flush=True)
    figures = report(results, cpu, meter, args)
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2) + "\n")
    return 0


def report(results: list[Result], cpu: dict[str, float], meter: ExpertMeter,
           args: argparse.Namespace) -> dict[str, Any]:
    boxcar = results[0]
    print(f"\n{'system':<40} {'seconds':>8} {'cpu s':>7} {'out tok/s':>10} {'total tok/s':>12}"
          "  exact")
    figures: dict[str, Any] = {"systems": {}}
    for r in results:
        same = compare(boxcar, r) if r is not boxcar else None
        exact = "-" if same is None else f"{same['compared'] - same['mismatching']}/" \
                                          f"{same['compared']}"
        print(f"{r.name:<40} {r.seconds:>8.1f} {cpu.get(r.name, 0.0):>7.1f} "
              f"{r.output_tokens_per_s:>10.1f} {r.total_tokens_per_s:>12.1f}  {exact}  {r.note}")
        figures["systems"][r.name] = {"seconds": r.seconds, "cpu_seconds": cpu.get(r.name),
                                      "out_tok_s": r.output_tokens_per_s,
                                      "total_tok_s": r.total_tokens_per_s, "exact": exact}
    for r in results[1:]:
        ratio = boxcar.total_tokens_per_s / r.total_tokens_per_s
        target = f" (target >= {TARGET_VS_STATIC}x)" if "static" in r.name else ""
        cpu_ratio = cpu[r.name] / cpu[boxcar.name] if cpu.get(r.name) else float("nan")
        print(f"boxcar / {r.name}: {ratio:.2f}x by wall time{target}, {cpu_ratio:.2f}x by CPU "
              "time")
        figures["systems"][r.name]["boxcar_ratio"] = ratio
    share = meter.seconds / boxcar.seconds
    print(f"\nexpert compute: {meter.seconds:.1f}s of boxcar's {boxcar.seconds:.1f}s "
          f"({100 * share:.0f}% of the steps)")
    counts = meter.counts.tolist() if meter.counts is not None else []
    if counts:
        mean = sum(counts) / len(counts)
        print(f"tokens per expert (all layers, {args.top_k} per token): {counts}")
        print(f"load balance: busiest expert {max(counts) / mean:.2f}x the mean, idlest "
              f"{min(counts) / mean:.2f}x")
    figures.update(expert_share=share, tokens_per_expert=counts)
    return figures


if __name__ == "__main__":
    raise SystemExit(main())
