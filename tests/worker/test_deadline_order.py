"""Deadlines reach the engine (``service.queue_order.engine_order``), on a tiny random-weight
model driven by the worker's drain loop: a shorter-window batch's lines overtake a longer
window's lines waiting inside the engine without preempting its running ones; a batch whose
deadline is at risk does preempt them."""

from __future__ import annotations

import pytest

from engine import EngineConfig, LLMEngine
from worker.drain import Drainer
from worker.items import LineResult, LineWork

NOW = 1_800_000_000.0
DAY, HOUR = NOW + 86400, NOW + 3600


def line(pk: int, batch_id: str, deadline: float, max_tokens: int) -> LineWork:
    body = {"prompt": f"line {pk} of {batch_id}", "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True}
    return LineWork(pk, f"{batch_id}:0", "acme", batch_id, None, "/v1/completions", body,
                    0, deadline)


@pytest.fixture
def drained(tiny_model_dir):
    engine = LLMEngine(EngineConfig(
        model=str(tiny_model_dir), max_num_seqs=2, max_num_batched_tokens=128,
        num_kv_blocks=64, block_size=16, device="cpu", dtype="float32", max_model_len=256))
    finished: list[LineResult] = []
    drainer = Drainer(engine, submit=finished.append, model_name="tiny", max_num_seqs=2,
                      max_num_batched_tokens=128)
    return engine, drainer, finished


def order(finished: list[LineResult]) -> list[int]:
    assert all(r.status == "completed" for r in finished), finished
    return [r.work.line_pk for r in finished]


def run_out(drainer: Drainer) -> list[int]:
    """Turn until done; the lines in the order they got an engine seat."""
    started: list[int] = []
    for _ in range(500):
        busy = drainer.turn()
        for request in drainer.engine.scheduler.running:
            pk = int(request.request_id.removeprefix("line-"))
            if pk not in started:
                started.append(pk)
        if not busy and not len(drainer.queue):
            return started
    raise AssertionError("the drain loop did not finish")


def test_a_shorter_window_overtakes_waiting_lines_without_preempting(drained):
    engine, drainer, finished = drained
    assert engine.config.max_num_seqs == 2
    drainer.add([line(pk, "day", DAY, 12) for pk in range(6)], is_job=False)
    drainer.turn()
    # Two seats taken, another of the day's lines waiting inside the engine.
    assert [r.request_id for r in engine.scheduler.running] == ["line-0", "line-1"]
    assert [r.request_id for r in engine.scheduler.waiting] == ["line-2"]
    drainer.add([line(pk, "hour", HOUR, 12) for pk in (10, 11)], is_job=False)
    started = run_out(drainer)
    # The hour's lines got seats before the day's line already waiting in the engine, after
    # the two running ones, which kept their seats.
    assert started == [0, 1, 10, 11, 2, 3, 4, 5]
    assert order(finished)[:4] == [0, 1, 10, 11]
    assert engine.scheduler.num_preemptions == 0


def test_a_deadline_at_risk_preempts_running_lines(drained):
    engine, drainer, finished = drained
    drainer.at_risk = lambda batch_id: batch_id == "hour"
    drainer.add([line(pk, "day", DAY, 16) for pk in (0, 1)], is_job=False)
    drainer.turn()
    drainer.turn()
    assert len(engine.scheduler.running) == 2 and not engine.scheduler.waiting
    drainer.add([line(10, "hour", HOUR, 3)], is_job=False)
    run_out(drainer)
    assert order(finished)[0] == 10
    assert engine.scheduler.num_preemptions >= 1


def test_without_the_risk_the_same_line_waits_for_a_seat(drained):
    engine, drainer, finished = drained
    drainer.add([line(pk, "day", DAY, 16) for pk in (0, 1)], is_job=False)
    drainer.turn()
    drainer.turn()
    drainer.add([line(10, "hour", HOUR, 3)], is_job=False)
    run_out(drainer)
    assert order(finished) == [0, 1, 10]
    assert engine.scheduler.num_preemptions == 0
