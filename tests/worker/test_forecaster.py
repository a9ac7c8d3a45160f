"""worker.forecaster: the held lines' progress read on the engine thread, the forecast published
with the worker's metrics snapshot."""

from __future__ import annotations

import pytest

from engine.testing.fake_engine import FakeEngine
from metrics.forecast import StepCost
from worker.drain import Drainer
from worker.forecaster import Forecaster, line_max_tokens
from worker.items import LineWork


def line(pk: int, batch: str | None, max_tokens: int, *, job: str | None = None) -> LineWork:
    body = {"prompt": f"line {pk}", "max_tokens": max_tokens, "ignore_eos": True}
    return LineWork(pk, f"{batch or job}:0", "t", batch, job, "/v1/completions", body)


def make(engine: FakeEngine) -> tuple[Drainer, Forecaster]:
    drainer = Drainer(engine, submit=lambda result: None, model_name="m", max_num_seqs=2,
                      max_num_batched_tokens=64)
    cost = StepCost()
    for decodes in (1, 2, 1, 2):  # each step costs 1 s whatever it holds
        cost.observe(1.0, num_decode=decodes, num_prefill=0)
    forecaster = Forecaster(drainer, cost, seats=2, max_model_len=4096, interval=0.0)
    drainer.on_step = forecaster.gather
    return drainer, forecaster


def test_the_forecast_covers_lines_in_the_engine_and_in_the_queue():
    drainer, forecaster = make(FakeEngine(max_num_seqs=2))
    assert forecaster.snapshot() is None  # nothing gathered yet
    drainer.add([line(i, "x", 4) for i in range(1, 6)], is_job=False)
    drainer.add([line(9, "y", 2)], is_job=False)
    assert drainer.turn()  # one step: two of x's lines run, one token each
    snap = forecaster.snapshot()
    # Two seats: x's running lines end in 3 steps, the next two at 7, the fifth at 11; y's
    # line (queued after x's) takes the seat freed at step 7 and ends at 9.
    assert snap["batches"] == {"x": {"lines": 5, "seconds_left": 11.0},
                               "y": {"lines": 1, "seconds_left": 9.0}}
    assert snap["seconds_left"] == 11.0 and snap["seats"] == 2
    assert snap["cost"]["fixed"] + snap["cost"]["per_decode"] * 1.5 == pytest.approx(1.0)
    while drainer.turn():
        pass
    assert forecaster.snapshot()["batches"] == {}


def test_line_max_tokens_reads_either_field():
    assert line_max_tokens({"max_completion_tokens": 7, "max_tokens": 9}) == 7
    assert line_max_tokens({"max_tokens": 9}) == 9
    assert line_max_tokens({"input": "x", "max_output_tokens": 5}) == 5  # a /v1/responses body
    assert line_max_tokens({}) is None and line_max_tokens({"max_tokens": True}) is None


def test_lines_entering_an_idle_engine_are_forecast_before_their_first_step():
    """The first step of an idle engine's new lines prefills them all (seconds on a CPU): the
    forecast is gathered before it, so it does not show the engine empty meanwhile."""
    engine = FakeEngine(max_num_seqs=2)
    drainer, forecaster = make(engine)
    forecaster.interval = 3600.0  # only a forced gather reads now
    at_admit: list[tuple[int, dict]] = []

    def admitted() -> None:
        forecaster.gather(force=True)
        at_admit.append((drainer.num_steps, forecaster.snapshot()["batches"]))

    drainer.on_admit = admitted
    assert not drainer.turn()  # idle: gathers the empty engine (the first gather)
    drainer.add([line(i, "x", 4) for i in range(1, 4)], is_job=False)
    assert drainer.turn()
    assert at_admit == [(0, {"x": {"lines": 3, "seconds_left": 8.0}})]
    assert drainer.turn()  # the engine was busy: no forced gather
    assert len(at_admit) == 1
