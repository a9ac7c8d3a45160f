"""The offline benchmarks' workload and results: seeded chat prompts, per-system results, and the
token-for-token comparison of two systems' outputs."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

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


