"""Shared system prompt: how much of it the prefix cache serves when every line arrives at once.

``python -m bench.prefix_sharing [--lines 32] [--prefix-tokens 420] [--rounds 2]``

The workload is seeded: one long system prompt (about ``--prefix-tokens`` tokens after the chat
template) and ``--lines`` short distinct questions, all added to the engine before its first step,
greedy, EOS ignored. One engine on the default model runs it with three schedulers, interleaved
round by round (this machine is shared, so only ratios from one run mean anything):

- ``prefix cache``: the engine as it is (a line whose prefix another line is computing waits for
  it and then hits the cache);
- ``cache, no hold``: the same engine with the hold switched off (an ablation done here, in the
  bench: lines admitted in the same step each compute the shared blocks, as before issue 10);
- ``no prefix cache``: ``enable_prefix_caching=False`` (what ``--no-prefix-caching`` sets).

It prints the cached tokens against ``(lines - 1) x shared prefix`` and the wall-time ratios, and
checks that every variant produces the same tokens.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time
from typing import Any

from bench.engine_setup import add_engine_args, build_llm, interleaved
from bench.workload import WORDS

TOPICS = (
    "rivers", "mountains", "music", "science", "gardens", "books", "engines", "windows", "caches",
    "schools", "games", "money", "families", "water", "stories", "houses", "friends", "cities",
)


def make_prompts(tokenizer: Any, *, num_lines: int, prefix_tokens: int, seed: int
                 ) -> tuple[list[list[int]], int]:
    """Chat prompts sharing one system prompt; returns them and their common prefix length."""
    rng = random.Random(seed)
    words = [rng.choice(WORDS) for _ in range(prefix_tokens)]
    ids = tokenizer(" ".join(words), add_special_tokens=False).input_ids
    system = "You are a careful assistant. " + tokenizer.decode(ids[:prefix_tokens])
    prompts = []
    for i in range(num_lines):
        question = (f"Question {i}: in one sentence, what do {rng.choice(TOPICS)} and "
                    f"{rng.choice(TOPICS)} have in common?")
        messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        prompts.append(list(tokenizer(text, add_special_tokens=False).input_ids))
    common = len(os.path.commonprefix(prompts))  # type: ignore[type-var]
    return prompts, common


def run_once(llm: Any, prompts: list[list[int]], max_tokens: int) -> dict[str, Any]:
    from engine import SamplingParams

    engine = llm.engine
    before = engine.get_stats()
    holds_before = engine.scheduler.num_prefix_holds
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    seconds = time.perf_counter() - start
    after = engine.get_stats()
    return {
        "seconds": seconds,
        "cached_tokens": sum(o.metrics.num_cached_tokens for o in outputs),
        "computed_prompt_tokens": after.num_prompt_tokens - before.num_prompt_tokens,
        "steps": after.num_steps - before.num_steps,
        "holds": engine.scheduler.num_prefix_holds - holds_before,
        "ttft": statistics.median(o.metrics.ttft or 0.0 for o in outputs),
        "tokens": [list(o.token_ids) for o in outputs],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.prefix_sharing",
                                     description=__doc__.split("\n\n")[0])
    add_engine_args(parser, rounds=2)
    parser.add_argument("--lines", type=int, default=32)
    parser.add_argument("--prefix-tokens", type=int, default=420)
    parser.add_argument("--max-tokens", type=int, default=16)
    args = parser.parse_args(argv)

    from dataclasses import replace

    from engine.core.scheduler import Scheduler

    # One model and KV cache; each run gets a fresh scheduler (the only part the prefix-cache
    # switch reaches), so every run starts cold and the variants share the same weights.
    llm = build_llm(args)
    engine = llm.engine

    def scheduler(enable_prefix_caching: bool, hold: bool) -> Scheduler:
        config = replace(engine.config, enable_prefix_caching=enable_prefix_caching)
        sched = Scheduler(config, engine.scheduler.kv.num_blocks, engine.max_model_len)
        if not hold:
            # The ablation: nobody promises blocks, so no line waits for another's prefix.
            sched.kv.promise_blocks = lambda request, num_hit_blocks: None  # type: ignore
        return sched

    variants = {
        "prefix cache": lambda: scheduler(True, True),
        "cache, no hold": lambda: scheduler(True, False),
        "no prefix cache": lambda: scheduler(False, False),
    }
    tokenizer = llm.tokenizer
    prompts, shared = make_prompts(tokenizer, num_lines=args.lines,
                                   prefix_tokens=args.prefix_tokens, seed=args.seed)
    block_size = engine.config.block_size
    shared_blocks = shared // block_size * block_size
    total_prompt = sum(len(p) for p in prompts)
    print(f"{args.lines} lines, shared prefix {shared} tokens ({shared_blocks} in full blocks), "
          f"{total_prompt} prompt tokens, {args.max_tokens} output tokens each, "
          f"{args.threads} threads (machine shared: compare ratios)", flush=True)
    llm.generate([prompts[0][:50]])  # warm up
    results: dict[str, list[dict[str, Any]]] = {name: [] for name in variants}
    for r, name in interleaved(list(variants), args.rounds):
        engine.scheduler = variants[name]()
        results[name].append(run_once(llm, prompts, args.max_tokens))
        print(f"round {r} {name:<16} {results[name][-1]['seconds']:.2f}s", flush=True)

    reference = results["no prefix cache"][0]["tokens"]
    target = (args.lines - 1) * shared
    print(f"\n{'variant':<17}{'seconds':>9}{'cached':>8}{'of (n-1)xP':>12}{'computed':>10}"
          f"{'steps':>7}{'holds':>7}{'ttft':>7}  same tokens")
    medians = {}
    for name, runs in results.items():
        seconds = statistics.median(x["seconds"] for x in runs)
        medians[name] = seconds
        last = runs[-1]
        same = all(x["tokens"] == reference for x in runs)
        print(f"{name:<17}{seconds:>9.2f}{last['cached_tokens']:>8}"
              f"{last['cached_tokens'] / target:>12.1%}{last['computed_prompt_tokens']:>10}"
              f"{last['steps']:>7}{last['holds']:>7}{last['ttft']:>7.2f}  {same}")
    print(f"\nwall time, no prefix cache / prefix cache: "
          f"{medians['no prefix cache'] / medians['prefix cache']:.2f}x (target >= 2x)")
    print(f"wall time, cache without hold / prefix cache: "
          f"{medians['cache, no hold'] / medians['prefix cache']:.2f}x")
    print(f"cached tokens / ((lines - 1) x shared prefix): "
          f"{results['prefix cache'][-1]['cached_tokens'] / target:.1%} (target >= 90%)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
