"""worker.forecaster: the held lines' progress read on the engine thread, the forecast published
with the worker's metrics snapshot."""

from __future__ import annotations

import pytest

from engine.testing.fake_engine import FakeEngine
from metrics.forecast import StepCost
from openai_format.engine_fields import engine_fields
from pipeline.engine_adapter import PrepareError, parse_body, prepare
from worker.drain import Drainer
from worker.forecaster import Forecaster
from worker.items import LineWork


def work(pk: int, batch: str | None, endpoint: str, body: dict, *,
         job: str | None = None) -> LineWork:
    """A line as a claim loads it: its body and the engine fields prepare stored."""
    request = parse_body(endpoint, body)
    assert not isinstance(request, PrepareError)
    return LineWork(pk, f"{batch or job}:0", "t", batch, job, endpoint, body,
                    engine_fields=engine_fields(request))


def line(pk: int, batch: str | None, max_tokens: int, *, job: str | None = None) -> LineWork:
    body = {"prompt": f"line {pk}", "max_tokens": max_tokens, "ignore_eos": True}
    return work(pk, batch, "/v1/completions", body, job=job)


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


CHAT = {"messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize(("endpoint", "body", "engine_gets"), [
    ("/v1/completions", {"prompt": "x"}, 16),  # OpenAI's completions default
    ("/v1/completions", {"prompt": "x", "max_tokens": 9}, 9),
    ("/v1/chat/completions", CHAT, None),  # none: up to the context
    ("/v1/chat/completions", {**CHAT, "max_tokens": 9}, 9),
    ("/v1/chat/completions", {**CHAT, "max_completion_tokens": 7, "max_tokens": 9}, 7),
    ("/v1/responses", {"input": "x"}, None),
    ("/v1/responses", {"input": "x", "max_output_tokens": 5}, 5),
    ("/v1/chat/completions", {**CHAT, "max_tokens": 4000}, 4000),  # past the room estimated
])
def test_a_queued_lines_budget_is_the_max_tokens_the_engine_gets(endpoint, body, engine_gets):
    """A line not yet in the engine is forecast with the max_tokens the engine will get (its
    engine fields'), capped as the engine caps it, by the room its context leaves."""
    engine = FakeEngine(max_num_seqs=2)
    _, forecaster = make(engine)
    queued = work(1, "x", endpoint, body)
    engine_input = prepare(engine, endpoint, body)
    assert not isinstance(engine_input, PrepareError)
    assert engine_input.params.max_tokens == engine_gets
    room = 4096 - 100
    progress = forecaster._queued(queued, 100.0)
    assert progress.max_tokens == (room if engine_gets is None else min(engine_gets, room))
    assert not progress.ignore_eos and progress.output_tokens == 0


def test_an_embeddings_line_generates_nothing():
    drainer, forecaster = make(FakeEngine(max_num_seqs=2))
    embedding = work(1, "x", "/v1/embeddings", {"input": ["a", "b"]})
    progress = forecaster._queued(embedding, 10.0)
    assert (progress.max_tokens, progress.output_tokens) == (0, 0)  # not the context's 4086


def test_a_row_without_engine_fields_may_run_to_the_context():
    """A row from before the engine fields (0005_scale): the drain parses its body when it
    runs; until then its forecast allows it the context."""
    drainer, forecaster = make(FakeEngine(max_num_seqs=2))
    old = LineWork(1, "x:0", "t", "x", None, "/v1/completions", {"prompt": "p"})
    progress = forecaster._queued(old, 96.0)
    assert progress.max_tokens == 4096 - 96 and not progress.ignore_eos


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
