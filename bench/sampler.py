"""Sampler cost per call: sampled rows at real vocabulary sizes, on the CPU.

``python -m bench.sampler [--rows 64 256] [--vocab 1024 49152] [--repeats 5] [--threads 1]``

For each batch size and vocabulary, one ``Sampler`` call on fp32 logits for every setting below,
each once with unseeded requests (the sampler's own generator) and once with a seed per request
(a stream each: ``sampler.seeded_uniforms``): ``top_k=50``, ``top_p=0.9``, both, temperature only
(``temperature=0.8`` throughout). Printed: the median milliseconds per call over ``--repeats``.

The logits are Zipf-like, shuffled: row r ranks its tokens with ``-a_r * log(rank)`` plus noise,
``a_r`` drawn from [1.2, 2.2], so the ``top_p=0.9`` nucleus is a handful of tokens in half the
rows and a thousand or more in a few percent (as SmolLM2-135M-Instruct's are at temperature 1:
median 31 tokens, 90th percentile ~700, 99th ~1,800). Timings depend on that spread: a flat
distribution makes top-p's nucleus large.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch

from engine import SamplingParams
from engine.core.request import Request
from engine.outputs import RequestMetrics
from engine.runner.sampler import Sampler
from engine.runner.sampling_columns import SamplingColumns

SETTINGS: dict[str, dict[str, Any]] = {
    "top_k=50": {"top_k": 50},
    "top_p=0.9": {"top_p": 0.9},
    "top_k=50 top_p=0.9": {"top_k": 50, "top_p": 0.9},
    "temperature only": {},
}


def zipf_logits(num_rows: int, vocab: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    a = 1.2 + torch.rand(num_rows, 1, generator=g)
    ranks = torch.arange(1, vocab + 1, dtype=torch.float32)
    by_rank = -a * ranks.log() + 0.5 * torch.randn(num_rows, vocab, generator=g)
    order = torch.argsort(torch.rand(num_rows, vocab, generator=g), dim=-1)
    return by_rank.gather(1, order)  # [num_rows, vocab]


def make_requests(num_rows: int, params: dict[str, Any], seeded: bool) -> list[Request]:
    requests = []
    for i in range(num_rows):
        sampling = SamplingParams(temperature=0.8, seed=i if seeded else None, **params)
        requests.append(Request(f"r{i}", [1, 2, 3], sampling, 16, (), RequestMetrics(0.0),
                                seed=sampling.seed))
    return requests


def time_call(sampler: Sampler, logits: torch.Tensor, requests: list[Request],
              repeats: int) -> float:
    # the requests' sampling columns, as the engine's persistent batch keeps them across steps
    columns = SamplingColumns.of(requests)
    sampler.sample(logits, requests, columns).cross()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        sampler.sample(logits, requests, columns).cross()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--vocab", type=int, nargs="+", default=[1024, 49152])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch threads: {torch.get_num_threads()}; median ms per Sampler call")
    print(f"{'rows':>5} {'vocab':>6}  {'setting':<20} {'unseeded':>9} {'seeded':>9}")
    for vocab in args.vocab:
        for num_rows in args.rows:
            logits = zipf_logits(num_rows, vocab)
            sampler = Sampler(vocab, seed=0)
            for name, params in SETTINGS.items():
                ms = [time_call(sampler, logits, make_requests(num_rows, params, seeded),
                                args.repeats) for seeded in (False, True)]
                print(f"{num_rows:>5} {vocab:>6}  {name:<20} {ms[0]:>9.1f} {ms[1]:>9.1f}",
                      flush=True)


if __name__ == "__main__":
    main()
