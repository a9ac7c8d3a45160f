"""The roofline floor's bookkeeping and arithmetic (bench/roofline.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from bench.roofline import (
    Gemm,
    GemmTable,
    ModelShapes,
    Step,
    floor,
    gemm_ladder,
    measure_copy_bandwidth,
    measure_gemms,
    padded,
    record_steps,
)
from engine.outputs import ScheduledRequest, SchedulerOutput


def test_step_counts_rows_samples_context_and_causal_pairs() -> None:
    out = SchedulerOutput([ScheduledRequest("a", 10, 1, True),  # a decode at position 10
                           ScheduledRequest("b", 4, 3, False)],  # a chunk at 4..6, not last
                          num_batched_tokens=4)
    step = Step.of(out)
    assert step == Step(num_tokens=4, num_sampled=1, kv_context_tokens=11 + 7,
                        attention_pairs=11 + (5 + 6 + 7))


def test_record_steps_keeps_non_empty_steps_and_restores_the_method() -> None:
    class Scheduler:
        def __init__(self) -> None:
            self.queue = [SchedulerOutput([ScheduledRequest("a", 0, 2, True)], 2),
                          SchedulerOutput([], 0)]

        def schedule(self) -> SchedulerOutput:
            return self.queue.pop(0)

    scheduler = Scheduler()
    with record_steps(scheduler) as steps:
        assert scheduler.schedule().num_batched_tokens == 2
        assert scheduler.schedule().is_empty
    assert steps == [Step(2, 1, 2, 3)]
    assert "schedule" not in vars(scheduler)  # the class's method is back


def test_gemm_ladder() -> None:
    assert gemm_ladder(1) == [1]
    assert gemm_ladder(8) == [1, 2, 4, 8]
    assert gemm_ladder(5) == [1, 2, 4, 5]


def test_fewer_rows_never_cost_more_than_more_rows() -> None:
    assert padded({1: 1.0, 2: 5.0, 4: 2.0, 8: 6.0}) == {1: 1.0, 2: 2.0, 4: 2.0, 8: 6.0}


def test_table_interpolates_between_measured_rows() -> None:
    gemm = Gemm("g", 4, 4)
    table = GemmTable("float32", {"g": {1: 1.0, 4: 2.0, 8: 6.0}})
    assert table.time(gemm, 4) == 2.0
    assert table.time(gemm, 2) == pytest.approx(1.0 + 1 / 3)
    assert table.time(gemm, 6) == pytest.approx(4.0)
    assert table.time(gemm, 16) == pytest.approx(12.0)  # past the ladder: its last rate
    assert table.time(gemm, 0) == 0.0
    assert table.best_flops((gemm,)) == pytest.approx(2 * 4 * 4 * 4 / 2.0)
    faster = table.merge_best(GemmTable("float32", {"g": {1: 0.5, 4: 3.0, 8: 6.0}}))
    assert faster.seconds["g"] == {1: 0.5, 4: 2.0, 8: 6.0}


def test_floor_takes_the_longer_of_compute_and_bytes_per_part() -> None:
    config = SimpleNamespace(hidden_size=8, num_attention_heads=2, num_key_value_heads=1,
                             intermediate_size=16, num_hidden_layers=3, vocab_size=32)
    shapes = ModelShapes.from_config(config)
    assert [g.out_features for g in shapes.layer_gemms] == [8 + 2 * 4, 8, 32, 8]
    rows_seconds = {1: 1e-3, 4: 4e-3}
    fp32 = GemmTable("float32", {g.name: dict(rows_seconds) for g in shapes.layer_gemms})
    bf16 = GemmTable("bfloat16", {"lm_head": {1: 1e-3, 2: 5e-3}})
    bandwidth = 1e6  # bytes/s: weight bytes dominate the 1-row GEMMs, compute the 4-row ones
    steps = [Step(num_tokens=1, num_sampled=1, kv_context_tokens=10, attention_pairs=10),
             Step(num_tokens=4, num_sampled=2, kv_context_tokens=4, attention_pairs=10)]
    result = floor(steps, shapes, "float32", {"float32": fp32, "bfloat16": bf16}, bandwidth)

    weights = [g.in_features * g.out_features * 4 / bandwidth for g in shapes.layer_gemms]
    assert result.linears == pytest.approx(3 * (sum(max(1e-3, w) for w in weights)
                                                + sum(max(4e-3, w) for w in weights)))
    head_bytes = 8 * 32 * 2 / bandwidth  # bf16, the greedy screen's dtype
    assert result.lm_head == pytest.approx(max(1e-3, head_bytes) + max(5e-3, head_bytes))
    kv_per_token = 2 * 3 * 4 * 4  # K and V, 3 layers, one kv head of 4, fp32
    rate = fp32.best_flops(shapes.layer_gemms)
    attention = [max((10 + 1) * kv_per_token / bandwidth, 4 * 3 * 8 * 10 / rate),
                 max((4 + 4) * kv_per_token / bandwidth, 4 * 3 * 8 * 10 / rate)]
    assert result.attention == pytest.approx(sum(attention))
    assert result.seconds == pytest.approx(result.linears + result.lm_head + result.attention)
    assert result.num_steps == 2

    # Where the run's dtype computes the output layer faster than the bf16 screen (a CPU
    # without bf16 units, where the engine does not screen), the floor takes that.
    fp32.seconds["lm_head"] = {1: 1e-4, 2: 2e-4}
    cheaper = floor(steps, shapes, "float32", {"float32": fp32, "bfloat16": bf16}, bandwidth)
    head_bytes_fp32 = 8 * 32 * 4 / bandwidth
    assert cheaper.lm_head == pytest.approx(
        min(max(1e-4, head_bytes_fp32), max(1e-3, head_bytes))  # 1 row: the bf16 screen's
        + min(max(2e-4, head_bytes_fp32), max(5e-3, head_bytes)))  # 2 rows: fp32's
    assert cheaper.lm_head < result.lm_head


def test_measurements_cover_the_ladder_in_each_dtype() -> None:
    gemms = (Gemm("a", 16, 24), Gemm("b", 24, 16))
    for dtype in ("float32", "bfloat16"):
        table = measure_gemms(gemms, dtype, 6, min_seconds=0.0, repeats=1)
        assert sorted(table.seconds) == ["a", "b"]
        assert all(sorted(t) == [1, 2, 4, 6] and min(t.values()) > 0
                   for t in table.seconds.values())
    assert measure_copy_bandwidth(1 << 20, repeats=1) > 0
