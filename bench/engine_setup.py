"""What the engine-level scheduling benchmarks share: their common flags, the fp32 CPU engine built
from them, and rounds whose variant order alternates (this machine's speed drifts over minutes,
so alternating keeps one variant from always running in the slower half)."""

from __future__ import annotations

import argparse
from collections.abc import Iterator, Sequence
from typing import Any

from engine.checkpoint.model_cache import DEFAULT_MODEL


def add_engine_args(parser: argparse.ArgumentParser, *, rounds: int = 1,
                    kv_cache_memory: int = 1 << 30) -> None:
    """``--model --threads --kv-cache-memory --seed --rounds``."""
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (1: on a shared machine more threads oversubscribe)")
    parser.add_argument("--kv-cache-memory", type=int, default=kv_cache_memory)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rounds", type=int, default=rounds)


def build_llm(args: argparse.Namespace, **engine_args: Any) -> Any:
    """An fp32 CPU ``LLM`` from the flags ``add_engine_args`` declared, plus ``engine_args``."""
    from engine import LLM

    return LLM(args.model, dtype="float32", device="cpu", num_threads=args.threads,
               kv_cache_memory=args.kv_cache_memory, **engine_args)


def interleaved(names: Sequence[str], rounds: int) -> Iterator[tuple[int, str]]:
    """``(round, name)`` for every round, names in order on even rounds and reversed on odd."""
    for r in range(rounds):
        for name in names if r % 2 == 0 else reversed(names):
            yield r, name
