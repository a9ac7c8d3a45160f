"""A measured floor for one engine run: the least time this machine needs for the run's own work.

The run's steps are recorded as they are scheduled (rows through the linears, rows that sample,
the KV context each request attends over). Each step costs at least:

- every linear layer at that step's row count: the longer of its GEMM time, measured here at the
  model's own shape and that row count in the run's dtype (the faster of ``F.linear`` and the
  engine's prepacked ``Linear`` where it packs that dtype), and its weight bytes at the measured
  copy bandwidth;
- the output layer on the rows that sample, the same way, at the cheaper of the run's dtype and
  bf16: on a CPU with bf16 units a greedy fp32 run screens it in bf16 and computes exact logits
  for a few candidates only (``engine/runner/greedy_screen.py``); elsewhere bf16 is emulated and
  the run's own dtype is the cheaper;
- attention: the longer of its KV bytes (every context token's keys and values read once, every
  new token's written once, in the run's dtype) at the copy bandwidth and its QK^T and AV FLOPs
  at the dtype's best measured GEMM rate.

Norms, rotary, activations, sampling and scheduling are left out, so it is a floor: a run
reaching 100% of it would be doing nothing but the unavoidable GEMMs and memory traffic.
GEMM times are the fastest single call (a shared machine's interruptions only slow calls
down), at powers of two up to the largest step, never more for fewer rows (fewer can run padded
to more), interpolated linearly between. Copy bandwidth counts bytes read plus bytes written
per second.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
SCREEN_DTYPE = "bfloat16"  # the output layer's cheapest exact greedy path (see the docstring)


@dataclass(frozen=True)
class Gemm:
    """One linear layer: ``[rows, in_features] x [in_features, out_features]``."""

    name: str
    in_features: int
    out_features: int

    def flops(self, rows: int) -> int:
        return 2 * rows * self.in_features * self.out_features

    def weight_bytes(self, dtype: str) -> int:
        return self.in_features * self.out_features * DTYPES[dtype].itemsize


@dataclass(frozen=True)
class ModelShapes:
    """The GEMMs of a Llama-style decoder as the engine runs them (fused qkv and gate_up)."""

    layer_gemms: tuple[Gemm, ...]
    lm_head: Gemm
    num_layers: int
    q_size: int  # heads x head_dim
    kv_size: int  # kv heads x head_dim

    @classmethod
    def from_config(cls, config: Any) -> ModelShapes:
        hidden, heads = config.hidden_size, config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        head_dim = getattr(config, "head_dim", None) or hidden // heads
        q_size, kv_size = heads * head_dim, kv_heads * head_dim
        inter = config.intermediate_size
        return cls(
            layer_gemms=(Gemm("qkv_proj", hidden, q_size + 2 * kv_size),
                         Gemm("o_proj", q_size, hidden),
                         Gemm("gate_up_proj", hidden, 2 * inter),
                         Gemm("down_proj", inter, hidden)),
            lm_head=Gemm("lm_head", hidden, config.vocab_size),
            num_layers=config.num_hidden_layers, q_size=q_size, kv_size=kv_size,
        )

    def kv_bytes_per_token(self, dtype: str) -> int:
        return 2 * self.num_layers * self.kv_size * DTYPES[dtype].itemsize


@dataclass(frozen=True)
class Step:
    """What one engine step computed, as far as the floor needs it."""

    num_tokens: int  # rows through every linear layer
    num_sampled: int  # rows through the output layer
    kv_context_tokens: int  # sum over requests of the context attended (prefix + new tokens)
    attention_pairs: int  # sum over new tokens of the positions each attends to (causal)

    @classmethod
    def of(cls, scheduler_output: Any) -> Step:
        context = pairs = sampled = 0
        for s in scheduler_output.scheduled:
            context += s.num_computed_tokens + s.num_new_tokens
            pairs += (s.num_new_tokens * s.num_computed_tokens
                      + s.num_new_tokens * (s.num_new_tokens + 1) // 2)
            sampled += int(s.sample)
        return cls(scheduler_output.num_batched_tokens, sampled, context, pairs)


@contextmanager
def record_steps(scheduler: Any) -> Iterator[list[Step]]:
    """Record every non-empty step ``scheduler`` schedules while the block runs."""
    steps: list[Step] = []
    schedule = scheduler.schedule

    def recording() -> Any:
        out = schedule()
        if out.scheduled:
            steps.append(Step.of(out))
        return out

    scheduler.schedule = recording
    try:
        yield steps
    finally:
        del scheduler.schedule  # the class's method again


# --- measurements --------------------------------------------------------------------------------


def best_seconds(fn: Callable[[], Any], *, min_seconds: float, repeats: int) -> float:
    """The fastest single call of ``fn`` among at least ``repeats`` calls and ``min_seconds``.

    The fastest call, not the mean: on a shared machine a call that lost its core for a few
    milliseconds says nothing about what the hardware can do."""
    fn()
    best, spent, calls = float("inf"), 0.0, 0
    while calls < repeats or spent < min_seconds:
        start = time.perf_counter()
        fn()
        seconds = time.perf_counter() - start
        best, spent, calls = min(best, seconds), spent + seconds, calls + 1
    return best


def _gemm_candidates(gemm: Gemm, rows: int, dtype: str) -> list[Callable[[], Any]]:
    from engine.layers.linear import Linear

    x = torch.randn(rows, gemm.in_features).to(DTYPES[dtype])
    weight = torch.randn(gemm.out_features, gemm.in_features).to(DTYPES[dtype])
    candidates: list[Callable[[], Any]] = [lambda: F.linear(x, weight)]
    linear = Linear(gemm.in_features, gemm.out_features, bias=False)
    with torch.no_grad():
        linear.weight.copy_(weight.float())
    linear = linear.to(DTYPES[dtype])
    try:
        linear.pack()
    except ValueError:  # the engine packs only some dtypes: F.linear is what it runs then
        return candidates
    candidates.append(lambda: linear(x))
    return candidates


def gemm_ladder(max_rows: int) -> list[int]:
    """Row counts to measure: powers of two below ``max_rows``, and ``max_rows``."""
    rows = [1]
    while rows[-1] * 2 < max_rows:
        rows.append(rows[-1] * 2)
    return sorted(set(rows) | {max(max_rows, 1)})


@dataclass
class GemmTable:
    """Measured seconds of each GEMM at a ladder of row counts, in one dtype."""

    dtype: str
    seconds: dict[str, dict[int, float]] = field(default_factory=dict)  # gemm name -> rows -> s

    def time(self, gemm: Gemm, rows: int) -> float:
        """Seconds for ``rows`` rows, interpolated linearly between measured row counts."""
        if rows <= 0:
            return 0.0
        table = self.seconds[gemm.name]
        ladder = sorted(table)
        at = bisect.bisect_left(ladder, rows)
        if at < len(ladder) and ladder[at] == rows:
            return table[rows]
        if at == 0:
            return table[ladder[0]]
        low = ladder[at - 1]
        high = ladder[at] if at < len(ladder) else low
        if high == low:  # past the largest measured count: scale its rate
            return table[low] * rows / low
        share = (rows - low) / (high - low)
        return table[low] + share * (table[high] - table[low])

    def best_flops(self, gemms: tuple[Gemm, ...]) -> float:
        """The highest FLOP/s measured for any of ``gemms`` at any row count."""
        return max(g.flops(rows) / s for g in gemms for rows, s in self.seconds[g.name].items())

    def merge_best(self, other: GemmTable) -> GemmTable:
        """Entry by entry the faster of two measurements (this machine drifts over minutes)."""
        merged = GemmTable(self.dtype)
        for name, table in self.seconds.items():
            theirs = other.seconds.get(name, {})
            merged.seconds[name] = {r: min(s, theirs.get(r, s)) for r, s in table.items()}
        return merged


def padded(seconds: dict[int, float]) -> dict[int, float]:
    """Each row count's time lowered to that of any larger count measured faster: fewer rows
    can always run as more (padded), so the floor never charges more for fewer rows."""
    result, best = {}, float("inf")
    for rows in sorted(seconds, reverse=True):
        best = min(best, seconds[rows])
        result[rows] = best
    return dict(sorted(result.items()))


def measure_gemms(gemms: tuple[Gemm, ...], dtype: str, max_rows: int, *,
                  min_seconds: float = 0.05, repeats: int = 5) -> GemmTable:
    table = GemmTable(dtype)
    for gemm in gemms:
        table.seconds[gemm.name] = padded({
            rows: min(best_seconds(fn, min_seconds=min_seconds, repeats=repeats)
                      for fn in _gemm_candidates(gemm, rows, dtype))
            for rows in gemm_ladder(max_rows)
        })
    return table


def measure_copy_bandwidth(num_bytes: int = 256 << 20, repeats: int = 5) -> float:
    """Best (bytes read + bytes written) per second of a tensor copy far larger than caches."""
    src = torch.ones(num_bytes // 4)
    dst = torch.empty_like(src)
    seconds = best_seconds(lambda: dst.copy_(src), min_seconds=0.0, repeats=repeats)
    return 2 * num_bytes / seconds


# --- the floor -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Floor:
    """Least seconds for a run's steps, by part."""

    linears: float
    lm_head: float
    attention: float
    num_steps: int

    @property
    def seconds(self) -> float:
        return self.linears + self.lm_head + self.attention


def floor(steps: list[Step], shapes: ModelShapes, dtype: str, tables: dict[str, GemmTable],
          copy_bandwidth: float) -> Floor:
    """The floor of ``steps`` run in ``dtype`` (``tables`` by dtype: ``dtype`` and bf16)."""
    table, screen = tables[dtype], tables[SCREEN_DTYPE]
    attention_rate = table.best_flops(shapes.layer_gemms)
    kv_per_token = shapes.kv_bytes_per_token(dtype)
    linears = lm_head = attention = 0.0
    for step in steps:
        linears += shapes.num_layers * sum(
            max(table.time(g, step.num_tokens), g.weight_bytes(dtype) / copy_bandwidth)
            for g in shapes.layer_gemms
        )
        if step.num_sampled:
            # The cheaper of the run's dtype and the bf16 screen: on a CPU without bf16 units
            # the engine does not screen (emulated bf16 is slower than fp32 there).
            head = shapes.lm_head
            lm_head += min(max(t.time(head, step.num_sampled),
                               head.weight_bytes(t.dtype) / copy_bandwidth)
                           for t in {id(table): table, id(screen): screen}.values()
                           if head.name in t.seconds)
        kv_bytes = (step.kv_context_tokens + step.num_tokens) * kv_per_token
        flops = 4 * shapes.num_layers * shapes.q_size * step.attention_pairs
        attention += max(kv_bytes / copy_bandwidth, flops / attention_rate)
    return Floor(linears, lm_head, attention, len(steps))
