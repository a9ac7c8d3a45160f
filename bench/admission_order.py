"""The tail of a known batch: steps with few requests running, under different admission orders.

``python -m bench.admission_order [--requests 96] [--max-num-seqs 24] [--rounds 1]``

A seeded mixed workload on the default model: half the requests share one of four ~130-token
system prompts, half are unrelated chat prompts (30-150 tokens); 80% ask for 16-48 output tokens,
20% for 96-192 (greedy, EOS ignored). The whole list is added before the first step (as
``LLM.generate`` and ``boxcar run`` do), in each of these orders, run interleaved:

- ``as given``: the seeded shuffle (what a file in no particular order looks like);
- ``longest first``: by ``max_tokens``, longest first (the longest requests start early instead
  of running alone at the end);
- ``prefix groups``: sorted by prompt token ids (lines sharing a prefix sit together);
- ``groups, longest first``: prefix groups kept together, groups ordered by their longest request,
  longest first inside a group.

A *tail step* runs fewer than a quarter of ``max_num_seqs`` requests. Printed per order: wall time,
steps, tail steps and the seconds they took, cached prompt tokens.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable
from typing import Any

from bench.engine_setup import add_engine_args, build_llm, interleaved
from bench.workload import WORDS, Workload, make_workload


def make_mixed(tokenizer: Any, num_requests: int, seed: int) -> Workload:
    rng = random.Random(seed)
    systems = [" ".join(rng.choice(WORDS) for _ in range(120)) for _ in range(4)]
    plain = make_workload(tokenizer, num_requests=num_requests - num_requests // 2,
                          prompt_range=(30, 150), output_range=(1, 1), seed=seed)
    prompts = list(plain.prompts)
    for i in range(num_requests // 2):
        messages = [{"role": "system", "content": rng.choice(systems)},
                    {"role": "user", "content": f"Item {i}: " + " ".join(
                        rng.choice(WORDS) for _ in range(rng.randint(5, 40)))}]
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        prompts.append(list(tokenizer(text, add_special_tokens=False).input_ids))
    max_tokens = [rng.randint(96, 192) if rng.random() < 0.2 else rng.randint(16, 48)
                  for _ in prompts]
    pairs = list(zip(prompts, max_tokens, strict=True))
    rng.shuffle(pairs)
    return Workload([p for p, _ in pairs], [m for _, m in pairs])


def longest_first(w: Workload) -> list[int]:
    return sorted(range(len(w.prompts)), key=lambda i: -w.max_tokens[i])


def prefix_groups(w: Workload) -> list[int]:
    return sorted(range(len(w.prompts)), key=lambda i: w.prompts[i])


def groups_longest_first(w: Workload) -> list[int]:
    from bench.prefix_groups import prefix_groups_longest_first

    return prefix_groups_longest_first(w.prompts, w.max_tokens)


ORDERS: dict[str, Callable[[Workload], list[int]]] = {
    "as given": lambda w: list(range(len(w.prompts))),
    "longest first": longest_first,
    "prefix groups": prefix_groups,
    "groups, longest first": groups_longest_first,
}


def run_order(llm: Any, w: Workload, order: list[int]) -> dict[str, Any]:
    from engine import SamplingParams

    engine = llm.engine
    sched = engine.scheduler
    sched.kv.pool.reset_prefix_cache()
    tail_seqs = max(1, engine.config.max_num_seqs // 4)
    for i in order:
        engine.add_request(f"r{i}", w.prompts[i], SamplingParams(
            temperature=0.0, max_tokens=w.max_tokens[i], ignore_eos=True))
    steps = tail_steps = 0
    tail_seconds = 0.0
    cached = 0
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        hist = dict(sched.batch_size_hist)
        t = time.perf_counter()
        for out in engine.step():
            cached += out.metrics.num_cached_tokens
        dt = time.perf_counter() - t
        sizes = [k for k, v in sched.batch_size_hist.items() if v != hist.get(k, 0)]
        if sizes:
            steps += 1
            if sizes[0] < tail_seqs:
                tail_steps += 1
                tail_seconds += dt
    return {"seconds": time.perf_counter() - start, "steps": steps, "tail_steps": tail_steps,
            "tail_seconds": tail_seconds, "cached": cached}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.admission_order",
                                     description=__doc__.split("\n\n")[0])
    add_engine_args(parser)
    parser.add_argument("--requests", type=int, default=96)
    parser.add_argument("--max-num-seqs", type=int, default=24)
    args = parser.parse_args(argv)

    llm = build_llm(args, max_num_seqs=args.max_num_seqs)
    w = make_mixed(llm.tokenizer, args.requests, args.seed)
    print(f"{args.requests} requests, {w.num_prompt_tokens} prompt tokens, "
          f"{w.num_output_tokens} output tokens, max_num_seqs {args.max_num_seqs}, tail = steps "
          f"with < {max(1, args.max_num_seqs // 4)} requests, {args.threads} thread(s), "
          "machine shared: compare ratios", flush=True)
    llm.generate([w.prompts[0][:32]])  # warm up
    results: dict[str, list[dict[str, Any]]] = {name: [] for name in ORDERS}
    for r, name in interleaved(list(ORDERS), args.rounds):
        results[name].append(run_order(llm, w, ORDERS[name](w)))
        x = results[name][-1]
        print(f"round {r} {name:<22} {x['seconds']:.1f}s, {x['tail_steps']} tail steps",
              flush=True)
    base = statistics.median(x["seconds"] for x in results["as given"])
    print(f"\n{'order':<23}{'seconds':>9}{'vs given':>10}{'steps':>7}{'tail steps':>12}"
          f"{'tail s':>8}{'cached':>8}")
    for name, runs in results.items():
        seconds = statistics.median(x["seconds"] for x in runs)
        last = runs[-1]
        print(f"{name:<23}{seconds:>9.1f}{seconds / base:>10.3f}{last['steps']:>7}"
              f"{last['tail_steps']:>12}{last['tail_seconds']:>8.1f}{last['cached']:>8}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
