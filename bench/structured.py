"""Structured-output cost: the same lines with and without a json_schema, interleaved in one run.

``python -m bench.structured [--num-lines 8] [--rounds 4] [--max-tokens 64]``

Each line is a chat prompt asking for one JSON record, on the default model. The schema run goes
first in the warm-up round and fixes each line's output length; every plain run then generates
exactly that many tokens per line (EOS ignored), so both variants do the same work with the
same batch shape and the time ratio is the throughput ratio. Two pairs are timed, rounds
alternating their order:

* greedy: plain greedy (bf16-screened argmax) vs greedy under the schema (full fp32 logits + mask)
* sampled: plain seeded sampling vs seeded sampling under the schema (both need full logits, so
  this isolates the mask: bitmask fill, apply, matcher advance)

Each run is timed by the wall clock and by this process's CPU time (less disturbed by other work
on a shared machine); ratios are medians over rounds. The grammar compile time (cache miss) and
the cache hits are printed too. Outputs of the schema runs are parsed and validated with
jsonschema.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jsonschema

from engine import LLM, SamplingParams
from engine.checkpoint.model_cache import pull
from engine.sampling_params import StructuredOutputParams

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"type": "string", "maxLength": 40},
        "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 30},
                    "minItems": 1, "maxItems": 3},
        "employed": {"type": "boolean"},
    },
    "required": ["name", "age", "city", "hobbies", "employed"],
    "additionalProperties": False,
}
SUBJECTS = ["a baker", "a pilot", "a student", "a retired teacher", "a painter", "a nurse",
            "a chess player", "a farmer", "a software engineer", "a musician", "a chef",
            "a librarian", "a sailor", "a photographer", "a gardener", "a doctor"]


def args_and_llm(description: str) -> tuple[argparse.Namespace, LLM]:
    """The flags both structured-output benches take, and the default model's engine."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--num-lines", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64)
    return parser.parse_args(), LLM(str(pull()))


def main() -> None:
    args, llm = args_and_llm(__doc__.splitlines()[0])
    engine = llm.engine
    prompts = [
        engine.apply_chat_template([{"role": "user", "content":
                                     f"Describe {SUBJECTS[i % len(SUBJECTS)]} (person {i}) as "
                                     "JSON with name, age, city, hobbies and employed."}])
        for i in range(args.num_lines)
    ]
    fmt = StructuredOutputParams(json_schema=SCHEMA)

    start = time.perf_counter()
    engine.structured_output.compile(fmt)
    compile_s = time.perf_counter() - start

    def schema_params(greedy: bool, i: int) -> SamplingParams:
        if greedy:
            return SamplingParams(temperature=0, max_tokens=args.max_tokens,
                                  structured_output=fmt)
        return SamplingParams(temperature=0.8, seed=i, max_tokens=args.max_tokens,
                              structured_output=fmt)

    lengths: dict[bool, list[int]] = {}
    for greedy in (True, False):
        outs = llm.generate(prompts, [schema_params(greedy, i) for i in range(len(prompts))])
        lengths[greedy] = [len(o.token_ids) for o in outs]
        num_valid = 0
        for o in outs:
            if o.finish_reason == "stop":
                jsonschema.validate(json.loads(o.text), SCHEMA)
                num_valid += 1
        print(f"{'greedy' if greedy else 'sampled'} schema lines: {num_valid}/{len(outs)} "
              f"complete and valid, {sum(lengths[greedy])} tokens "
              f"(the rest cut by max_tokens={args.max_tokens})")

    def plain_params(greedy: bool, i: int) -> SamplingParams:
        n = lengths[greedy][i]
        if greedy:
            return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        return SamplingParams(temperature=0.8, seed=i, max_tokens=n, ignore_eos=True)

    def timed(make) -> tuple[float, float, int]:
        params = [make(i) for i in range(len(prompts))]
        start, cpu = time.perf_counter(), time.process_time()
        outs = llm.generate(prompts, params)
        seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
        return seconds, cpu, sum(len(o.token_ids) for o in outs)

    for greedy in (True, False):  # warm up the plain paths too
        timed(lambda i, g=greedy: plain_params(g, i))
    times: dict[str, list[float]] = {}
    cpu_times: dict[str, list[float]] = {}
    for r in range(args.rounds):
        for greedy in (True, False):
            kind = "greedy" if greedy else "sampled"
            pair = [("plain", lambda i, g=greedy: plain_params(g, i)),
                    ("schema", lambda i, g=greedy: schema_params(g, i))]
            if r % 2:
                pair.reverse()
            for name, make in pair:
                seconds, cpu, num_tokens = timed(make)
                assert num_tokens == sum(lengths[greedy])
                times.setdefault(f"{kind}/{name}", []).append(seconds)
                cpu_times.setdefault(f"{kind}/{name}", []).append(cpu)
                print(f"round {r} {kind:7s} {name:6s} {seconds:7.2f} s wall {cpu:7.2f} s cpu "
                      f"{num_tokens / seconds:7.1f} tok/s", flush=True)

    manager = engine.structured_output
    print(f"\ngrammar compile (cache miss): {compile_s * 1000:.0f} ms; cache: "
          f"{manager.num_compiles} compiles, {manager.num_cache_hits} hits")
    for kind in ("greedy", "sampled"):
        tokens = sum(lengths[kind == "greedy"])
        wall = [p / s for p, s in zip(times[f"{kind}/plain"], times[f"{kind}/schema"],
                                      strict=True)]
        cpu = [p / s for p, s in zip(cpu_times[f"{kind}/plain"], cpu_times[f"{kind}/schema"],
                                     strict=True)]
        plain = statistics.median(times[f"{kind}/plain"])
        print(f"{kind:7s}: plain {tokens / plain:7.1f} tok/s (median wall); schema/plain "
              f"throughput = {statistics.median(wall):.3f} wall, {statistics.median(cpu):.3f} "
              f"cpu (medians of {args.rounds} per-round ratios)")


if __name__ == "__main__":
    main()
