"""The step history a worker keeps across restarts (metrics.step_history, StepCost.restore):
the shape of a step from the earlier run, the level from this one; and a short batch on a
restarted worker, forecast as the API serves it (seconds late), against a simulated engine on a
virtual clock. No sleeping: every clock is injected."""

from __future__ import annotations

import json
import random

import pytest

from metrics.forecast import Cost, LineProgress, OutputLengths, StepCost, forecast
from metrics.publisher import MetricsPublisher
from metrics.recorder import EngineRecorder
from metrics.step_history import SAVED_STEPS, StepHistoryStore, history_key, parse_history
from service.models import WorkerStatus
from service.storage import LocalStorage, get_bytes, put_bytes
from tests.conftest_services import chat_line, wait_for

# A CPU engine's proportions: a decode row costs about twice a prompt token (its attention over
# the cache and its logits), so the fit's prior (the two equal) is off by two.
CPU = Cost(fixed=0.035, per_decode=0.0033, per_prefill=0.0017)


def seconds(cost: Cost, decodes: float, prefill: float) -> float:
    return cost.fixed + cost.per_decode * decodes + cost.per_prefill * prefill


def varied_steps(fit: StepCost, cost: Cost, num: int, *, start: float = 0.0,
                 seed: int = 0) -> float:
    rng = random.Random(seed)
    clock = start
    for _ in range(num):
        decodes, prefill = rng.randint(1, 64), rng.choice([0, 0, 0, rng.randint(1, 2048)])
        clock += seconds(cost, decodes, prefill)
        fit.observe(seconds(cost, decodes, prefill), num_decode=decodes, num_prefill=prefill,
                    at=clock)
    return clock


def test_a_restored_history_gives_the_shape_and_this_run_the_level():
    earlier = StepCost()
    varied_steps(earlier, CPU, 300)
    restarted = StepCost()
    restarted.restore(earlier.history(512))
    assert restarted.num_observed == 0 and len(restarted) == 300
    cost = restarted.fit()  # nothing of its own yet: the earlier run's cost as it was
    assert cost.per_decode == pytest.approx(CPU.per_decode, rel=0.05)
    assert cost.fixed == pytest.approx(CPU.fixed, rel=0.1)
    # This run's machine is twice as loaded: its first steps set the level at once, the
    # earlier steps keep the split between the parts.
    slow = Cost(*(2 * c for c in (CPU.fixed, CPU.per_decode, CPU.per_prefill)))
    for i, decodes in enumerate((30, 30, 29, 27, 26, 26)):
        restarted.observe(seconds(slow, decodes, 0), num_decode=decodes, num_prefill=0,
                          at=1000.0 + i)
    cost = restarted.fit()
    for decodes in (8, 16, 30):
        assert seconds(cost, decodes, 0) == pytest.approx(seconds(slow, decodes, 0), rel=0.1)
    assert seconds(cost, 1, 0) == pytest.approx(seconds(slow, 1, 0), rel=0.2)


def test_restore_puts_the_earlier_steps_first_within_the_bound():
    fit = StepCost(history=10)
    for i in range(4):
        fit.observe(1.0, num_decode=i, num_prefill=0, at=float(i))
    fit.restore([(100.0 + i, 0.0, 2.0) for i in range(20)])
    steps = fit.history(10)
    assert len(steps) == 10 and fit.num_observed == 4
    # The newest six earlier steps, then this run's four, oldest first.
    assert [d for d, _, _ in steps] == [114, 115, 116, 117, 118, 119, 0, 1, 2, 3]
    assert fit.history(3) == [(1, 0, 1.0), (2, 0, 1.0), (3, 0, 1.0)]
    assert fit.history(0) == []


def test_the_history_survives_a_restart_and_is_saved_at_most_every_save_s(tmp_path):
    storage = LocalStorage(str(tmp_path))
    key = history_key(model_name="m", engine_config={"max_num_seqs": 8}, host="h")
    now = [0.0]
    fit = StepCost()
    store = StepHistoryStore(storage, key, fit, save_s=60.0, clock=lambda: now[0])
    assert store.load() == 0 and not store.save()  # nothing saved, nothing run
    varied_steps(fit, CPU, 50)
    now[0] = 30.0
    assert not store.maybe_save()  # too soon
    now[0] = 61.0
    assert store.maybe_save() and not store.maybe_save()
    now[0] = 200.0
    assert not store.maybe_save()  # nothing ran since
    fit.observe(0.5, num_decode=3, num_prefill=0)
    assert store.save()
    restarted = StepCost()
    assert StepHistoryStore(storage, key, restarted).load() == 51
    for got, saved in zip(restarted.history(51), fit.history(51), strict=True):
        assert got == pytest.approx(saved, rel=1e-5)


def test_the_key_is_one_engine_on_one_host_and_a_bad_file_is_ignored(tmp_path):
    key = history_key(model_name="m", engine_config={"max_num_seqs": 8}, host="h")
    assert key.startswith("workers/step-history/") and key.endswith(".json")
    assert key == history_key(model_name="m", engine_config={"max_num_seqs": 8}, host="h")
    assert len({key, history_key(model_name="m", engine_config={"max_num_seqs": 16}, host="h"),
                history_key(model_name="m2", engine_config={"max_num_seqs": 8}, host="h"),
                history_key(model_name="m", engine_config={"max_num_seqs": 8}, host="h2")}) == 4
    storage = LocalStorage(str(tmp_path))
    for bad in (b"not json", b'{"version": 99, "steps": []}', b'{"version": 1}',
                b'{"version": 1, "steps": [[1, 2]]}', b'{"version": 1, "steps": [[1, -2, 3]]}'):
        put_bytes(storage, key, bad)
        fit = StepCost()
        assert StepHistoryStore(storage, key, fit).load() == 0 and len(fit) == 0
    assert parse_history(b'{"version": 1, "steps": [[1, 2, 0.5]]}') == [(1.0, 2.0, 0.5)]
    fit = StepCost()
    fit.observe(0.25, num_decode=2, num_prefill=5)
    StepHistoryStore(storage, key, fit).save()
    assert json.loads(get_bytes(storage, key)) == {"version": 1, "steps": [[2, 5, 0.25]]}


# Heartbeat 1 s + the API's 2 s cache: the estimate a poll gets was forecast up to 3 s before.
SERVED_LATE_S = 3.0


def run_batch(fit: StepCost, *, lengths: list[int], seats: int, prompt: int, cost: Cost,
              clock: float) -> tuple[float, list[tuple[float, int, float]]]:
    """A batch of lines that ignore EOS (``lengths`` tokens each) through a simulated engine
    whose steps cost ``cost``; ``fit`` observes every step. Returns the end and, after every
    step, (time, lines done, the forecast's end)."""
    queue, running = list(lengths), []  # running: [generated, length, prompt tokens left]
    timeline = []
    done = 0
    while queue or running:
        while queue and len(running) < seats:
            running.append([0, queue.pop(0), prompt])
        decodes = len(running)  # a prompt's step makes its first token too
        prefill = sum(r[2] for r in running)
        step = seconds(cost, decodes, prefill)
        clock += step
        fit.observe(step, num_decode=decodes, num_prefill=prefill, at=clock)
        for r in running:
            r[0], r[2] = r[0] + 1, 0
        done += sum(1 for r in running if r[0] >= r[1])
        running = [r for r in running if r[0] < r[1]]
        held = [LineProgress("b", True, 0, r[0], r[1], True) for r in running]
        held += [LineProgress("b", False, prompt, 0, n, True) for n in queue]
        batches, _ = forecast(held, seats=seats, cost=fit.fit(), lengths=OutputLengths())
        timeline.append((clock, done, clock + batches["b"].seconds_left if held else clock))
    return clock, timeline


def error_at_quarter(timeline: list[tuple[float, int, float]], end: float,
                     num_lines: int) -> float:
    """The error, against the time left, of the estimate a poll gets when a quarter of the
    lines are done: the forecast made SERVED_LATE_S before."""
    at = next(t for t, done, _ in timeline if done >= num_lines / 4)
    served = [eta for t, _, eta in timeline if t <= at - SERVED_LATE_S]
    eta = served[-1] if served else timeline[0][2]
    return (eta - end) / (end - at)


def short_batch(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randint(16, 64) for _ in range(30)]


def warm_up_job(fit: StepCost) -> float:
    """The one job a fresh worker ran: a prompt, then a decode a step."""
    _, timeline = run_batch(fit, lengths=[32], seats=128, prompt=100, cost=CPU, clock=0.0)
    return timeline[-1][0]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_short_batch_on_a_restarted_worker_is_within_30_percent_at_25(seed):
    """The bench's short batch (30 lines of 16-64 tokens, all in the engine at once), its
    estimate read when a quarter of the lines are done, as the API serves it (forecast 3 s
    before). A restarted worker that loaded its earlier run's steps is within 30% of the time
    left."""
    earlier = StepCost()
    clock = warm_up_job(earlier)
    run_batch(earlier, lengths=short_batch(100 + seed), seats=128, prompt=100, cost=CPU,
              clock=clock)
    restarted = StepCost()
    restarted.restore(earlier.history(512))
    clock = warm_up_job(restarted)
    end, timeline = run_batch(restarted, lengths=short_batch(seed), seats=128, prompt=100,
                              cost=CPU, clock=clock)
    assert abs(error_at_quarter(timeline, end, 30)) <= 0.30



def test_a_restarted_worker_starts_from_its_engines_steps(make_stack, sqlite_url):
    """A worker saves its steps when it stops; the next worker of the same engine loads them
    at start and publishes a forecast with a fitted cost before its engine has stepped."""
    stack = make_stack(sqlite_url)
    first = stack.add_worker()
    batch = stack.create_batch([chat_line(str(i), "hi", max_tokens=4) for i in range(6)])
    stack.wait_status(batch["id"], "completed")
    num_steps = first.recorder.step_cost.num_observed
    assert num_steps > 0
    first.stop()
    stack.workers.remove(first)
    assert stack.ctx.storage.exists(first.step_history.key)

    second = stack.add_worker()
    restored = second.recorder.step_cost
    assert second.step_history.key == first.step_history.key
    assert restored.num_observed == 0 and len(restored) == min(num_steps, SAVED_STEPS)

    def published() -> dict | None:
        second.publisher.publish()
        with stack.ctx.db.read_session() as session:
            metrics = session.get(WorkerStatus, second.worker_id).metrics
        return metrics.get("forecast")

    forecast_now = wait_for(published, 10, 0.02, "the restarted worker's first forecast")
    assert forecast_now["batches"] == {} and forecast_now["cost"]["fixed"] >= 0
    assert restored.num_observed == 0  # fitted from the earlier run's steps alone


def test_the_heartbeat_saves_the_history_every_save_s(make_stack, sqlite_url, tmp_path):
    stack = make_stack(sqlite_url)
    recorder = EngineRecorder({})
    storage = LocalStorage(str(tmp_path / "history"))
    now = [0.0]
    store = StepHistoryStore(storage, "h.json", recorder.step_cost, save_s=60.0,
                             clock=lambda: now[0])
    publisher = MetricsPublisher(stack.ctx.db, recorder, worker_id="w", model="m",
                                 interval=1.0, history=store)
    recorder.step_cost.observe(0.1, num_decode=1, num_prefill=0)
    publisher.publish()
    assert not storage.exists("h.json")  # not a minute yet
    now[0] = 61.0
    publisher.publish()
    assert parse_history(get_bytes(storage, "h.json")) == [(1.0, 0.0, 0.1)]
