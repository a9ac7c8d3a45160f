"""Multi-LoRA: the same lines on the base model, spread over adapters in one batch, and one
adapter at a time with merged weights.

``python -m bench.lora [--lines 64] [--adapters 8] [--prompt-tokens 64] [--max-tokens 32]
[--rounds 3]``

Random-weight PEFT adapters (ranks spread over 8..64, every one on all seven projections) are
written next to the default model's converted folder, once per run. Three variants, greedy, EOS
ignored, every line added before the first step. Each round is new lines (its own random
prompts, the same for every variant), so no round finds an earlier one's prompts in the prefix
cache: every round prefills and decodes, as a batch of new lines does; a few warm-up lines run
first on each engine, not timed.

- ``(a) base``: the lines on the base model alone;
- ``(b) mixed``: the same lines spread round-robin over ``--adapters`` adapters, one engine,
  one batch (``max_loras`` = the number of adapters: every adapter rides every step);
- ``(c) one at a time``: the lines of each adapter as their own batch on an engine whose weights
  have that adapter merged in (``W + scaling * B @ A``): what serving each fine-tune as its own
  deployment does. Its engines' start-up is reported apart, not counted in its tokens/s.

Targets (issue 27): (b) >= 0.8x (a) tokens/s, (b) >= 2x (c). It also prints the LoRA share of
(b)'s step time (the time inside the segmented shrink/expand over the generate's wall time).
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PROJECTIONS = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn",
               "o_proj": "self_attn", "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


def shapes(config: Any) -> dict[str, tuple[int, int]]:
    """(in, out) of each projection."""
    hidden, inter = config.hidden_size, config.intermediate_size
    head_dim = getattr(config, "head_dim", None) or hidden // config.num_attention_heads
    q, kv = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
    return {"q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv),
            "o_proj": (q, hidden), "gate_proj": (hidden, inter), "up_proj": (hidden, inter),
            "down_proj": (inter, hidden)}


def write_adapter(folder: Path, config: Any, base_name: str, rank: int, seed: int) -> None:
    """A PEFT folder with random A and B on every projection of every layer."""
    import torch
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config.num_hidden_layers):
        for proj, (fan_in, fan_out) in shapes(config).items():
            prefix = f"base_model.model.model.layers.{layer}.{PROJECTIONS[proj]}.{proj}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, fan_in, generator=g) / math.sqrt(
                fan_in)
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(fan_out, rank, generator=g) * 0.02
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(shapes(
            config)), "base_model_name_or_path": base_name, "bias": "none",
    }))


def write_merged(folder: Path, base: Path, adapter: Path) -> None:
    """The base checkpoint (one safetensors file or shards) with the adapter merged into its
    projections."""
    from safetensors.torch import load_file, save_file

    lora = load_file(str(adapter / "adapter_model.safetensors"))
    meta = json.loads((adapter / "adapter_config.json").read_text())
    scaling = meta["lora_alpha"] / meta["r"]
    deltas = {}
    for key, a in lora.items():
        if key.endswith("lora_A.weight"):
            module = key.removeprefix("base_model.model.").removesuffix(".lora_A.weight")
            deltas[f"{module}.weight"] = scaling * (lora[key.replace("lora_A", "lora_B")] @ a)
    folder.mkdir(parents=True, exist_ok=True)
    for item in base.iterdir():
        if item.suffix != ".safetensors":
            shutil.copy(item, folder / item.name)
            continue
        weights = load_file(str(item))
        for name in deltas.keys() & weights.keys():
            w = weights[name]
            weights[name] = (w.float() + deltas.pop(name)).to(w.dtype)
        save_file(weights, str(folder / item.name), metadata={"format": "pt"})
    if deltas:
        raise ValueError(f"{base} has no weights for {sorted(deltas)[:3]}...")


class LoRATimer:
    """Seconds spent in the LoRA deltas (both paths), by wrapping LoRALinear's methods."""

    def __init__(self) -> None:
        from engine.lora.layers import LoRALinear

        self.seconds = 0.0
        self._originals = {}
        for name in ("_segmented_delta", "_stacked_delta"):
            original = getattr(LoRALinear, name)
            self._originals[name] = original

            def timed(linear, *args, _original=original):
                start = time.perf_counter()
                try:
                    return _original(linear, *args)
                finally:
                    self.seconds += time.perf_counter() - start

            setattr(LoRALinear, name, timed)

    def close(self) -> None:
        from engine.lora.layers import LoRALinear

        for name, original in self._originals.items():
            setattr(LoRALinear, name, original)


def warm(llm: Any, prompts: list[list[int]], loras: list[str | None] | None = None) -> None:
    """Lines run before the timed rounds, on prompts of their own: an engine's first step pays
    one-off costs."""
    from engine import SamplingParams

    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True),
                 lora_name=loras)


def generate(llm: Any, rounds: list[list[list[int]]], max_tokens: int,
             loras: list[str | None] | None = None) -> tuple[float, float, int, list[list[int]]]:
    """(median seconds, total seconds, tokens of one round, the last round's tokens) over the
    rounds, each its own prompts: no round finds another's in the prefix cache, so every round
    prefills and decodes as a batch of new lines does. The median, so that a round slowed by
    another process does not count."""
    from engine import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    times = []
    for prompts in rounds:
        start = time.perf_counter()
        outs = llm.generate(prompts, params, lora_name=loras)
        times.append(time.perf_counter() - start)
    tokens = [o.outputs[0].token_ids for o in outs]
    return statistics.median(times), sum(times), sum(len(t) for t in tokens), tokens


@dataclass
class LoRAResult:
    """One side-by-side run: tokens/s of (a), (b) and (c), and what (b) spent on LoRA."""

    a_tps: float
    b_tps: float
    c_tps: float
    lora_share: float | None  # None on a GPU: its kernels run asynchronously to the timer
    agree: int
    lines: int
    c_start_s: float

    def report(self, adapters: int) -> list[str]:
        a, b, c = self.a_tps, self.b_tps, self.c_tps
        share = (f"{100 * self.lora_share:.1f}%" if self.lora_share is not None else
                 f"not timed on a GPU; 1 - (b)/(a) = {100 * (1 - b / a):.1f}% bounds it")
        return [
            f"(a) base              {a:10.1f} tok/s",
            f"(b) mixed, {adapters} adapters {b:10.1f} tok/s",
            f"(c) one at a time     {c:10.1f} tok/s (+{self.c_start_s:.1f} s merging and "
            f"starting {adapters} engines, not counted)",
            f"(b)/(a) = {b / a:.2f}x (target >= 0.8x)   (b)/(c) = {b / c:.2f}x (target >= 2x)",
            f"LoRA share of (b)'s step time: {share}",
            f"(b) and (c) agree on {self.agree}/{self.lines} lines' greedy tokens",
        ]


def measure(model: str, *, lines: int = 64, adapters: int = 8, min_rank: int = 8,
            max_rank: int = 64, prompt_tokens: int = 64, max_tokens: int = 32, rounds: int = 1,
            seed: int = 0, device: str = "cpu", dtype: str = "auto", threads: int | None = 1,
            engine_options: dict[str, Any] | None = None) -> LoRAResult:
    """(a), (b) and (c) on ``model`` (module docstring); ``engine_options`` go to every engine."""
    import torch

    from engine import LLM
    from engine.checkpoint.loader import load_checkpoint
    from engine.runner.device import resolve_dtype

    checkpoint = load_checkpoint(model, None, convert_gguf=True)
    config = checkpoint.config
    base_name = Path(model).name
    n = adapters
    ranks = [round(min_rank + (max_rank - min_rank) * i / max(n - 1, 1)) for i in range(n)]
    g = torch.Generator().manual_seed(seed)
    # one set of lines a round, the same sets for every variant, and a warm-up set apart
    sets = [[torch.randint(100, config.vocab_size, (prompt_tokens,), generator=g).tolist()
             for _ in range(lines)] for _ in range(rounds + 1)]
    warmup, round_sets = sets[0][:n], sets[1:]
    dtype = str(resolve_dtype(dtype, torch.device(device))).removeprefix("torch.")
    engine_args: dict[str, Any] = dict(dtype=dtype, device=device, **(engine_options or {}))
    if device == "cpu":
        engine_args["num_threads"] = threads
    with tempfile.TemporaryDirectory(prefix="bench-lora-") as tmp:
        root = Path(tmp)
        folders = {}
        for i, rank in enumerate(ranks):
            folders[f"lora{i}-r{rank}"] = root / f"lora{i}"
            write_adapter(folders[f"lora{i}-r{rank}"], config, base_name, rank, seed + i)
        names = list(folders)
        spread = [names[i % n] for i in range(lines)]
        print(f"model {model}, {lines} lines of {prompt_tokens} prompt tokens, {max_tokens} "
              f"generated each; {n} adapters of ranks {ranks} on all seven projections; "
              f"{dtype} on {device}" + (f", {threads} thread(s)" if device == "cpu" else "")
              + f", median of {rounds} round(s)", flush=True)

        base = LLM(model, **engine_args)
        warm(base, warmup)
        a_s, _, a_tok, _ = generate(base, round_sets, max_tokens)
        del base

        mixed = LLM(model, lora_modules=[f"{k}={v}" for k, v in folders.items()], max_loras=n,
                    max_lora_rank=max_rank, **engine_args)
        warm(mixed, warmup, names)
        timer = LoRATimer()
        try:
            b_s, b_total, b_tok, b_tokens = generate(mixed, round_sets, max_tokens, spread)
        finally:
            timer.close()
        lora_share = timer.seconds / b_total if device == "cpu" else None
        del mixed

        c_s, c_tok, c_start = 0.0, 0, 0.0
        agree = 0
        for name, folder in folders.items():
            rows = [i for i, s in enumerate(spread) if s == name]
            merged = root / f"merged-{name}"
            start = time.perf_counter()
            write_merged(merged, checkpoint.path, folder)
            llm = LLM(str(merged), **engine_args)
            c_start += time.perf_counter() - start
            warm(llm, warmup)
            seconds, _, tokens, outs = generate(llm, [[p[i] for i in rows] for p in round_sets],
                                                max_tokens)
            c_s += seconds
            c_tok += tokens
            # merged weights round differently from base + delta: count agreeing lines
            agree += sum(outs[j] == b_tokens[i] for j, i in enumerate(rows))
            del llm
            shutil.rmtree(merged)
    return LoRAResult(a_tok / a_s, b_tok / b_s, c_tok / c_s, lora_share, agree, lines, c_start)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="default: the default model")
    parser.add_argument("--lines", type=int, default=64)
    parser.add_argument("--adapters", type=int, default=8)
    parser.add_argument("--min-rank", type=int, default=8)
    parser.add_argument("--max-rank", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cpu", help="cpu, or cuda (bench/gpu_check.py "
                        "runs it there on a random model of the default model's shapes)")
    parser.add_argument("--dtype", default="auto",
                        help="the engine's dtype (default: auto, what a user gets: bf16 on a "
                        "GPU and on a CPU with bf16 units, else fp32)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rounds", type=int, default=1,
                        help="rounds of new lines for each variant; the median counts")
    args = parser.parse_args(argv)

    from engine.checkpoint.model_cache import DEFAULT_MODEL

    result = measure(args.model or DEFAULT_MODEL, lines=args.lines, adapters=args.adapters,
                     min_rank=args.min_rank, max_rank=args.max_rank,
                     prompt_tokens=args.prompt_tokens, max_tokens=args.max_tokens,
                     rounds=args.rounds, seed=args.seed, device=args.device, dtype=args.dtype,
                     threads=args.threads)
    print("\n".join(result.report(args.adapters)))


if __name__ == "__main__":
    main()
